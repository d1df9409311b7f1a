"""task.toml's tables, one pydantic model each ([metadata], [task], [verifier], [agent],
[solution], [environment] and what they hold), and the names and limits they check against.
``tmax.tasks.config.TaskConfig`` is the whole file, made of these; its module doc says how
Harbor's schema versions are read."""

from __future__ import annotations

import difflib
import ipaddress
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

DOMAINS: tuple[str, ...] = (
    "security",
    "software-engineering",
    "data-science",
    "data-processing",
    "data-querying",
    "scientific-computing",
    "system-administration",
    "file-operations",
    "debugging",
)
"""The nine task domains of the TMax recipe."""


DIFFICULTIES = ("easy", "medium", "hard")
"""TMax's difficulty levels."""


def near_miss(value: str, names: tuple[str, ...]) -> str | None:
    """The one of ``names`` that ``value`` misspells (None: it is another name)."""
    found = difflib.get_close_matches(value.lower(), names, n=1, cutoff=0.8)
    return found[0] if found else None


NetworkMode = Literal["no-network", "public", "allowlist"]

SCHEMA_VERSIONS: tuple[str, ...] = ("1.0", "1.1", "1.2", "1.3", "1.4")
"""Harbor's published task.toml schema versions, oldest first."""
CURRENT_SCHEMA = SCHEMA_VERSIONS[-1]
"""What Harbor assumes when a task.toml declares no version."""

TMAX_ONLY: dict[str, tuple[str, ...]] = {"environment": ("network",), "verifier": ("agent_system",)}
"""TMax's keys outside [metadata] that Harbor does not define (kept under [metadata.tmax] in
a Harbor export)."""
STASH = "tmax"
"""The [metadata] table of a Harbor export that holds TMax's own keys."""

_ORG_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*$")
_BARE_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]*$")
_HOST_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


def field_error(field: str, message: str) -> PydanticCustomError:
    """A validation error that names its dotted task.toml field (for cross-field checks)."""
    return PydanticCustomError("tmax_field", "{message}", {"field": field, "message": message})


class HarborTable(BaseModel):
    """A table Harbor defines. Harbor ignores keys it does not define; TMax keeps them as
    written (``unknown_keys`` lists them; validation warns, or refuses a near-miss of a
    defined key as a likely typo)."""

    model_config = ConfigDict(extra="allow", frozen=True)


# --------------------------------------------------------------------------- [metadata]


class Metadata(BaseModel):
    """[metadata]: TMax's keys typed, any other key kept verbatim (Harbor's is free-form)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    author_name: str = ""
    """Who wrote the task."""
    author_email: str = ""
    difficulty: str = "medium"
    """easy | medium | hard; another dataset's level is kept as written (Harbor's [metadata]
    is free-form, e.g. "very hard"; validate warns), a near miss of the three is an error."""
    category: str = ""
    """Free-form category (Harbor's field); TMax uses ``domain`` for its nine domains."""
    domain: str | None = None
    """One of the nine TMax domains (see ``DOMAINS``); another dataset's own domain is kept
    as written (validate warns), a near miss of one of the nine is an error."""
    tags: tuple[str, ...] = ()
    skills: tuple[str, ...] = ()
    """Short names of the skills the task exercises."""
    axes: dict[str, str] = Field(default_factory=dict)
    """Values a task generator sampled for this task, by axis name."""
    source: str = ""
    """Where the task came from (e.g. ``converted from terminal-bench-1``)."""
    extra: dict[str, str | int | float | bool | list[str]] = Field(default_factory=dict)
    """Free-form data (older TMax files); any other [metadata] key is kept the same way."""

    @field_validator("domain")
    @classmethod
    def _domain_not_misspelt(cls, value: str | None) -> str | None:
        if value is not None and value not in DOMAINS and (near := near_miss(value, DOMAINS)):
            raise ValueError(f"did you mean {near!r}?")
        return value

    @field_validator("difficulty")
    @classmethod
    def _difficulty_not_misspelt(cls, value: str) -> str:
        if value not in DIFFICULTIES and (near := near_miss(value, DIFFICULTIES)):
            raise ValueError(f"did you mean {near!r}?")
        return value

    @property
    def free(self) -> dict[str, Any]:
        """The [metadata] keys TMax does not define, as written."""
        return dict(self.__pydantic_extra__ or {})


# --------------------------------------------------------------------------- [task]


class Author(HarborTable):
    name: str
    email: str | None = None


class PackageInfo(HarborTable):
    """[task] (Harbor 1.1+): the task's registry identity."""

    name: str
    """``org/name`` (e.g. ``terminal-bench/regex-log``), the registry's form for publishing;
    a bare ``name`` runs as it does in Harbor, and validation warns."""
    version: str | None = Field(None, min_length=1)
    description: str = ""
    authors: tuple[Author, ...] = ()
    keywords: tuple[str, ...] = ()

    @field_validator("name")
    @classmethod
    def _org_name(cls, v: str) -> str:
        if not (_ORG_NAME.match(v) or _BARE_NAME.match(v)) or ".." in v:
            raise ValueError("task name must be 'org/name' or 'name' (letters, digits, . _ -), "
                             f"got {v!r}")
        return v


# --------------------------------------------------------------------------- network policy


def _check_hosts(hosts: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Harbor's allowlist entries: hostnames, '*.' wildcards, IP addresses, CIDR ranges
    (never URLs, ports or paths). Kept as written."""
    for raw in hosts or ():
        host = raw.strip().lower().rstrip(".")
        if not host:
            raise ValueError("allowed_hosts entries must not be empty")
        if "/" in host or ":" in host:
            try:
                ipaddress.ip_network(host, strict=True) if "/" in host else \
                    ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"allowed_hosts entry {raw!r}: a hostname, IP address or CIDR "
                                 "range, not a URL, port or path") from None
            continue
        name = host.removeprefix("*.")
        if "*" in name or not all(_HOST_LABEL.match(label) for label in name.split(".")):
            raise ValueError(f"allowed_hosts entry {raw!r} is not a hostname, '*.domain' "
                             "pattern or IP address")
    return hosts


def phase_network(mode: str | None, hosts: tuple[str, ...] | None) -> bool | None:
    """Whether a Harbor network policy gives network at all (None: no policy given).
    An allowlist with hosts means network here (a separate verifier's sandbox gets the
    whole network); the agent's sandbox gets only those hosts (``TaskConfig.agent_network``)."""
    if mode is None:
        return None
    return mode == "public" or (mode == "allowlist" and bool(hosts))


class _NetworkPolicy(HarborTable):
    network_mode: NetworkMode | None = None
    """Harbor 1.3+: no-network | public | allowlist."""
    allowed_hosts: tuple[str, ...] | None = None
    """Hosts reachable with ``network_mode = "allowlist"`` (the agent's, through the fleet's
    proxy: ``TaskConfig.agent_network``)."""

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return _check_hosts(v)

    @model_validator(mode="after")
    def _hosts_need_allowlist(self):
        if self.allowed_hosts is not None and self.network_mode != "allowlist":
            raise ValueError("allowed_hosts is only valid with network_mode = \"allowlist\"")
        return self


# --------------------------------------------------------------------------- sections


class Verifier(_NetworkPolicy):
    timeout_sec: float = Field(120.0, gt=0)
    """Wall-clock limit for tests/test.sh."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for the verifier."""
    agent_system: bool = Field(False, strict=True)
    """Run the verifier with the agent's /usr, /bin, /lib and /etc instead of the image's
    as built: for tasks that grade what the agent installed. An agent can then change the
    tools that grade it (audits flag such tasks as hackable)."""
    user: str | int | None = None
    """Harbor: the user tests/test.sh runs as, over the final USER of the image it runs in
    (``tmax.images.build.Plan.verifier_user``)."""
    environment_mode: Literal["shared", "separate"] | None = None
    """Harbor 1.2+: "separate" runs test.sh in a fresh sandbox of its own, which gets only
    the ``artifacts`` (tests/Dockerfile its image, else the task's: ``Task.separate_verifier``)."""
    environment: Environment | None = None
    """Harbor 1.2+: the separate verifier's [environment], read as [environment] is (its
    defaults, not the task's); implies the mode. Its sandbox gets its cpus, memory, storage
    and network (``TaskConfig.verifier_resources``)."""
    collect: tuple[dict[str, Any], ...] = ()
    """Harbor 1.3+: [[verifier.collect]] hooks (kept, not run)."""


class Agent(_NetworkPolicy):
    timeout_sec: float = Field(900.0, gt=0)
    """Episode time budget, counted from the moment the sandbox lease is granted."""
    user: str | int | None = None
    """Harbor: the user the agent's commands (and the reference solution) run as, over the
    Dockerfile's final USER (``tmax.images.build.ImageBuilds.run_user``)."""


class Solution(HarborTable):
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for solution/solve.sh."""


class Healthcheck(HarborTable):
    """Harbor 1.1+: a readiness command run after the environment starts (Docker's
    HEALTHCHECK options)."""

    command: str
    interval_sec: float = 5.0
    timeout_sec: float = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = 3


class MCPServer(HarborTable):
    """An MCP server Harbor offers the agent (kept; TMax's agents do not use them yet)."""

    name: str
    transport: Literal["stdio", "sse", "streamable-http", "http"] = "sse"
    url: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()
    headers: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _transport_fields(self):
        if self.transport != "stdio" and not self.url:
            raise ValueError(f"an MCP server over {self.transport!r} needs a url")
        if self.transport == "stdio" and not self.command:
            raise ValueError("an MCP server over 'stdio' needs a command")
        return self


MIN_MB = {"memory": 64, "storage": 16}


def size_to_mb(text: str) -> int:
    """Harbor's size strings: a number with a G, M or K suffix ("4G" -> 4096, "512M")."""
    s = text.strip().upper()
    scale = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}.get(s[-1:])
    try:
        if scale is None:
            raise ValueError
        return int(float(s[:-1]) * scale)
    except ValueError:
        raise ValueError(f"{text!r} is not a size like '4G', '512M' or '64K'") from None


class Environment(_NetworkPolicy):
    build_timeout_sec: float = Field(600.0, gt=0)
    docker_image: str | None = None
    """A prebuilt image Harbor may run instead of building environment/ (TMax builds
    environment/ and does not pull images)."""
    os: str = "linux"
    """Harbor 1.2+: linux | windows (TMax runs linux only)."""
    cpus: int = Field(2, ge=1)
    memory_mb: int = Field(2048, ge=MIN_MB["memory"])
    """Memory limit; also set by Harbor's ``memory = "4G"``."""
    storage_mb: int = Field(10240, ge=MIN_MB["storage"])
    """Disk quota; also set by Harbor's ``storage = "10G"``."""
    gpus: int = Field(0, ge=0)
    gpu_types: tuple[str, ...] | None = None
    tpu: dict[str, Any] | None = None
    mcp_servers: tuple[MCPServer, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    """Harbor: variables for the task's container (``${VAR}`` from the host); not applied by
    TMax yet."""
    skills_dir: str | None = None
    healthcheck: Healthcheck | None = None
    workdir: str | None = None
    """Harbor 1.1+: where commands start, over the image's WORKDIR (not applied by TMax yet)."""
    allow_internet: bool | None = Field(None, strict=True)
    """Harbor up to 1.2 (deprecated after): true = network_mode "public", false = "no-network"."""
    memory: str | None = None
    """Harbor's deprecated size string for ``memory_mb``."""
    storage: str | None = None
    """Harbor's deprecated size string for ``storage_mb``."""
    network: bool = Field(False, strict=True)
    """Whether the sandbox gets a network (TMax's key; off unless the task says so). Also set
    by Harbor's ``network_mode`` / ``allow_internet`` and [agent] ``network_mode``."""

    @field_validator("os")
    @classmethod
    def _os(cls, v: str) -> str:
        if v.lower() not in ("linux", "windows"):
            raise ValueError(f"os must be linux or windows, got {v!r}")
        return v

    @model_validator(mode="after")
    def _sizes(self):
        for key in ("memory", "storage"):
            text = getattr(self, key)
            if text is None:
                continue
            try:
                mb = size_to_mb(text)
            except ValueError as e:
                raise field_error(f"environment.{key}", str(e)) from None
            given = f"{key}_mb" in self.model_fields_set
            if given and getattr(self, f"{key}_mb") != mb:
                raise field_error(f"environment.{key}",
                                  f"{key} = {text!r} ({mb} MB) conflicts with {key}_mb = "
                                  f"{getattr(self, f'{key}_mb')}")
            if not given:
                floor = MIN_MB[key]
                if mb < floor:
                    raise field_error(f"environment.{key}",
                                      f"{key} = {text!r} is {mb} MB, below {floor} MB")
                object.__setattr__(self, f"{key}_mb", mb)  # derived: not recorded as given
        return self

    @property
    def harbor_network(self) -> bool | None:
        """What this section's Harbor keys say about network (None: they say nothing).
        network_mode or allowed_hosts win over allow_internet, as in Harbor."""
        if self.network_mode is not None:
            return phase_network(self.network_mode, self.allowed_hosts)
        return self.allow_internet


Verifier.model_rebuild()  # its [verifier.environment] is an Environment
