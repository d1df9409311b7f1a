"""task.toml: Harbor's task metadata (schema versions 1.0 to 1.4) plus TMax's own keys.

Read as Harbor reads it. Harbor (``harbor.models.task.config`` in its package) validates
every task.toml with its current model, whatever ``schema_version`` says, and ignores keys
it does not define; the versions differ by the keys they added:

=======  ===================  ==============================================================
schema   Harbor releases      keys added (each release still reads every earlier key)
=======  ===================  ==============================================================
1.0      up to 0.2            ``version``; [metadata] free; [verifier] timeout_sec, env, user;
                              [agent] timeout_sec, user; [solution] env; ``source``;
                              [environment] build_timeout_sec, docker_image, cpus, memory_mb,
                              storage_mb, gpus, gpu_types, allow_internet (default true),
                              mcp_servers, env, skills_dir, and ``memory`` / ``storage`` as
                              size strings ("4G", "512M")
1.1      0.3 to 0.5           ``schema_version`` (``version`` still read); [task] name
                              ("org/name"), description, authors, keywords;
                              [environment] healthcheck, workdir; [[steps]], artifacts,
                              multi_step_reward_strategy
1.2      0.6 to 0.9           [environment] os, tpu; [verifier] environment_mode, environment
1.3      0.13 to 0.20         network_mode ("no-network" | "public" | "allowlist") and
                              allowed_hosts in [environment], [agent] and [verifier];
                              allow_internet deprecated (still mapped); [verifier] collect
1.4      0.21 to 0.26         [task] version; mcp_servers headers
=======  ===================  ==============================================================

TMax reads every key of every version. TMax's own keys are typed and strict: [metadata]
difficulty, domain, tags, skills, axes, source, extra (and Harbor's author_name,
author_email, category), timeouts, resources, [environment] network and [verifier]
agent_system. Any other [metadata] key is kept verbatim, as Harbor keeps it. A key that
neither Harbor nor TMax defines is kept as written and written back (Harbor ignores it);
validation warns about it, and refuses one that looks like a misspelt key of its table.

What TMax acts on is exposed as typed fields, whichever spelling the file used:
``environment.memory_mb`` / ``storage_mb`` (from ``memory`` / ``storage`` strings) and
``environment.network`` (from ``network``, ``network_mode``, ``allow_internet`` and [agent]'s
``network_mode``). These derived values are not recorded as given, so
``TaskConfig.to_toml_dict`` writes back the keys the file had, in its own spelling.

A task exported for Harbor (``to_harbor_dict``) keeps TMax's keys that Harbor does not define
under ``[metadata.tmax]``, with the list of keys the export added to make TMax's defaults
explicit for Harbor; reading it (``from_harbor_dict``) puts them back.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, model_validator

from sandfleet import netproxy
from tmax.tasks.config_tables import (
    CURRENT_SCHEMA,
    STASH,
    TMAX_ONLY,
    Agent,
    Environment,
    HarborTable,
    Metadata,
    PackageInfo,
    Solution,
    Verifier,
    field_error,
    phase_network,
)

_M = TypeVar("_M", bound=BaseModel)


def _defaults(model: type[_M]) -> Callable[[], _M]:
    """A default_factory: ``model`` with every field at its default, as ``model()`` makes
    it (mypy, without the pydantic plugin, reads a ``Field(default, ...)`` as required)."""
    return lambda: model.model_validate({})


class TaskConfig(HarborTable):
    """The whole of task.toml."""

    schema_version: str | None = None
    """Harbor 1.1+: the schema version the file follows."""
    version: str | None = None
    """Harbor 1.0's name for ``schema_version`` (older TMax files write it too)."""
    task: PackageInfo | None = None
    metadata: Metadata = Field(default_factory=Metadata)
    verifier: Verifier = Field(default_factory=_defaults(Verifier))
    agent: Agent = Field(default_factory=_defaults(Agent))
    solution: Solution = Field(default_factory=Solution)
    environment: Environment = Field(default_factory=_defaults(Environment))
    source: str | None = None
    """Harbor: where the task came from (top level)."""
    multi_step_reward_strategy: Literal["mean", "final"] | None = None
    steps: tuple[dict[str, Any], ...] | None = None
    """Harbor 1.1+: [[steps]] of a multi-step task (not supported by TMax)."""
    artifacts: tuple[str | dict[str, Any], ...] = ()
    """Harbor 1.1+: paths handed from the agent's sandbox to a separate verifier."""

    @model_validator(mode="after")
    def _network(self):
        env, agent = self.environment, self.agent
        harbor = phase_network(agent.network_mode, agent.allowed_hosts)
        where = "[agent] network_mode"
        if harbor is None:
            harbor = env.harbor_network
            where = ("network_mode" if env.network_mode is not None else "allow_internet")
        if "network" in env.model_fields_set:
            if harbor is not None and harbor != env.network:
                raise field_error("environment.network",
                                  f"network = {str(env.network).lower()} conflicts with "
                                  f"{where} (network {'on' if harbor else 'off'})")
        elif harbor is not None:
            object.__setattr__(env, "network", harbor)  # derived: not recorded as given
        return self

    @property
    def network_unsaid(self) -> bool:
        """A Harbor task file that says nothing about the network (Harbor runs its agent
        online; ``agent_network`` decides what TMax gives it)."""
        given = {"network", "network_mode", "allow_internet", "allowed_hosts"} & \
            self.environment.model_fields_set
        return bool(self.schema_version or self.version or self.task) and not given \
            and self.agent.network_mode is None

    def agent_network(self, unsaid: Literal["offline", "registries"] = "offline",
                      ) -> tuple[bool, tuple[str, ...]]:
        """The agent's sandbox network as a lease asks for it: (whole network, allowed
        hosts). An allowlist ([agent]'s, else [environment]'s) is only those hosts, through
        the fleet's proxy; a task that says nothing (``network_unsaid``) gets ``unsaid``:
        offline, or the package registries (``sandfleet.netproxy.REGISTRY_HOSTS``)."""
        policy = self.agent if self.agent.network_mode is not None else self.environment
        if policy.network_mode == "allowlist":
            return False, tuple(policy.allowed_hosts or ())
        if self.environment.network:
            return True, ()
        if unsaid == "registries" and self.network_unsaid:
            return False, netproxy.REGISTRY_HOSTS
        return False, ()

    @property
    def verifier_resources(self) -> Environment:
        """The separate verifier's sandbox: [verifier.environment] where the task has one
        (its network from its own keys, off unless they say so), else the task's own."""
        env = self.verifier.environment
        if env is None:
            return self.environment
        if "network" in env.model_fields_set or env.harbor_network is None:
            return env
        return env.model_copy(update={"network": env.harbor_network})

    @property
    def harbor_schema(self) -> str:
        """The schema version the file declares (Harbor's current one when it says none)."""
        return self.schema_version or self.version or CURRENT_SCHEMA

    def to_toml_dict(self) -> dict:
        """The keys the file had (or the draft was given), in their own spelling, for
        tomli_w; derived values and defaults are left out, and so are None values."""
        return _drop_none(self.model_dump(exclude_unset=True))

    def to_harbor_dict(self) -> dict:
        """task.toml for Harbor: TMax's own keys outside [metadata] move under
        [metadata.tmax]; where TMax's defaults differ from Harbor's (network off, the
        timeouts, cpus, memory, storage), the value is written out and listed there as
        added. A task with neither comes out unchanged."""
        doc = self.to_toml_dict()
        moved: dict[str, dict] = {}
        added: list[str] = []
        for section, keys in TMAX_ONLY.items():
            for key in keys:
                if key in doc.get(section, {}):
                    moved.setdefault(section, {})[key] = doc[section].pop(key)

        def add(path: str, value) -> None:
            section, _, key = path.rpartition(".")
            table = doc
            if section:
                if section not in doc:
                    doc[section] = {}
                    added.append(section)
                table = doc[section]
            if key not in table:
                table[key] = value
                added.append(path)

        env = self.environment
        if "schema_version" not in doc and "version" not in doc:
            add("schema_version", CURRENT_SCHEMA)
        if env.harbor_network is None:  # Harbor's baseline (the verifier's too) is public
            add("environment.network_mode", "public" if env.network else "no-network")
        add("verifier.timeout_sec", self.verifier.timeout_sec)
        add("agent.timeout_sec", self.agent.timeout_sec)
        add("environment.cpus", env.cpus)
        if "memory" not in doc.get("environment", {}):
            add("environment.memory_mb", env.memory_mb)
        if "storage" not in doc.get("environment", {}):
            add("environment.storage_mb", env.storage_mb)
        if not moved and not added:
            return doc
        if "metadata" not in doc:
            doc["metadata"] = {}
            added.append("metadata")
        doc["metadata"][STASH] = {"added": added, **moved}
        return doc


def from_harbor_dict(doc: dict) -> dict:
    """The native form of a task.toml dict: a Harbor export's [metadata.tmax] put back (its
    keys to their sections, the keys the export added removed). Anything else unchanged.
    Raises ``ValueError`` (naming the field) for a malformed [metadata.tmax]."""
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict) or STASH not in metadata:
        return doc
    doc = copy.deepcopy(doc)
    stash = doc["metadata"].pop(STASH)
    field = f"metadata.{STASH}"
    if not isinstance(stash, dict):
        message = f"{field}: expected a table (TMax's keys in a Harbor export)"
        raise ValueError(message)
    added = stash.pop("added", [])
    if not isinstance(added, list) or not all(isinstance(a, str) for a in added):
        raise ValueError(f"{field}.added: expected a list of dotted keys")
    for path in sorted(added, key=lambda p: -p.count(".")):  # keys before their tables
        section, _, key = path.rpartition(".")
        table = doc.get(section) if section else doc
        if not isinstance(table, dict) or key not in table:
            continue
        if isinstance(table[key], dict) and table[key]:
            continue  # a table the export made that holds other keys now
        del table[key]
    for section, keys in stash.items():
        allowed = TMAX_ONLY.get(section)
        if allowed is None or not isinstance(keys, dict) or set(keys) - set(allowed):
            raise ValueError(f"{field}.{section}: not TMax's keys (expected "
                             + "; ".join(f"[{field}.{s}] {', '.join(k)}"
                                         for s, k in TMAX_ONLY.items()) + ")")
        table = doc.setdefault(section, {})
        for key, value in keys.items():
            if key in table and table[key] != value:
                raise ValueError(f"{section}.{key} is given twice, differently: "
                                 f"{table[key]!r} and {value!r} in [{field}.{section}]")
            table[key] = value
    return doc


def unknown_keys(config: BaseModel, prefix: str = "") -> list[tuple[str, tuple[str, ...]]]:
    """Keys of Harbor's tables that neither Harbor nor TMax defines, kept as written: each
    as ``(dotted key, the keys its table defines)``. [metadata] is free and not listed."""
    out = [(f"{prefix}{key}", tuple(type(config).model_fields))
           for key in (config.__pydantic_extra__ or {})]
    for name in type(config).model_fields:
        value = getattr(config, name)
        items = value if isinstance(value, tuple) else (value,)
        for i, item in enumerate(items):
            if isinstance(item, HarborTable):
                where = f"{prefix}{name}." + (f"{i}." if isinstance(value, tuple) else "")
                out.extend(unknown_keys(item, where))
    return out


def _drop_none(value):
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value]
    return value
