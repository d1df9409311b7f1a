"""The fleet's configuration: one strict model, loaded from YAML (``sandfleet/configs/fleet.yaml``).

Unknown keys are an error at load time. ``{user}`` in path fields is replaced by this
user's name. The controller saves the resolved config as ``fleet.json`` in its state dir;
workers read it from there, so a worker needs only the state dir and its name.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sandfleet.netproxy import parse_upstream
from sandfleet.runtime.base import default_owner
from sandfleet.wire.server import IDLE_TIMEOUT_S, WireLimits


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SlurmConfig(Strict):
    """How worker jobs are asked of Slurm (``provider: slurm``)."""

    partition: str | None = None
    """Partition of the CPU nodes (``--partition``); the cluster default when unset."""
    account: str | None = None
    """``--account`` to charge; none when unset."""
    qos: str | None = None
    """``--qos``; none when unset."""
    time_min: int = Field(default=240, ge=5)
    """Walltime of a worker job, in minutes (before staggering)."""
    stagger_min: int = Field(default=20, ge=0)
    """Walltimes are staggered: job k gets ``time_min - (k % stagger_steps) * stagger_min /
    stagger_steps`` minutes, so nodes do not all end at once."""
    stagger_steps: int = Field(default=4, ge=1)
    """How many distinct walltimes the stagger cycles through."""
    drain_before_s: float = Field(default=900.0, ge=0)
    """A worker whose job ends within this many seconds drains: no new leases (those it
    holds keep working), a replacement is submitted if leases need one, and it is released
    once it holds none."""
    extra_options: list[str] = Field(default_factory=list)
    """More sbatch options, each as ``--key=value`` (e.g. ``--constraint=cpu``)."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines the job runs before the worker (``module load apptainer``...)."""
    python: str | None = None
    """The Python that runs the worker on the nodes; the controller's own when unset."""
    poll_min_s: float = Field(default=2.0, gt=0)
    """First interval of the batched ``squeue`` poll; it backs off while nothing changes."""
    poll_max_s: float = Field(default=30.0, gt=0)
    """Longest interval of the batched ``squeue`` poll."""
    command_timeout_s: float = Field(default=60.0, gt=0)
    """Timeout of each sbatch/squeue/scancel call."""


class FleetConfig(Strict):
    """One fleet: its controller, workers, leases and scaling."""

    provider: Literal["local", "slurm"] = "local"
    """Where workers run: local processes on this machine, or Slurm jobs."""
    runtime: Literal["local", "apptainer"] = "local"
    """The sandbox runtime workers use (``local``: bubblewrap; ``apptainer``: instances)."""
    apptainer_allow_root: bool = False
    """With ``runtime: apptainer`` and workers run as root: start sandboxes although their
    root is host root (it can write the host's /proc/sys and cgroups). Refused by default;
    on a cluster, workers run as ordinary users and need nothing here."""
    host: str = "127.0.0.1"
    """Address the controller listens on (``0.0.0.0`` on a cluster)."""
    advertise_host: str | None = None
    """Host name or IP others use to reach the controller; derived from ``host`` (or this
    node's address when ``host`` is a wildcard) when unset."""
    port: int = Field(default=0, ge=0, le=65535)
    """Controller port; 0 picks a free one (a restarted controller tries its old one)."""
    worker_host: str = "127.0.0.1"
    """Address workers listen on (``0.0.0.0`` on a cluster); they advertise the address
    of the interface that routes to the controller."""
    min_nodes: int = Field(default=0, ge=0)
    """Workers kept up even when idle."""
    max_nodes: int = Field(default=2, ge=1)
    """Most workers (Slurm jobs, or local processes) at once."""
    cpus_per_node: int = Field(default=8, ge=1)
    """CPUs each worker hands out as lease slots (and asks Slurm for)."""
    memory_mb_per_node: int = Field(default=16384, ge=256)
    """Memory each worker hands out to leases (and asks Slurm for)."""
    idle_s: float = Field(default=300.0, ge=0)
    """A worker with no leases for this long is released (down to ``min_nodes``)."""
    heartbeat_s: float = Field(default=1.0, gt=0)
    """Interval of worker heartbeats."""
    lost_after_s: float = Field(default=3.5, gt=0)
    """A worker silent this long is lost: its leases fail with NodeLost."""
    lease_ttl_s: float = Field(default=300.0, gt=0)
    """Default lease TTL: a lease expires this long after its last renewal or exec."""
    acquire_wait_s: float = Field(default=600.0, ge=0)
    """Default time an acquire queues for capacity before CapacityTimeout."""
    max_lease_s: float = Field(default=4 * 3600.0, gt=0)
    """Hard lifetime of every sandbox (holds even if every daemon dies)."""
    sandbox_start_timeout_s: float = Field(default=120.0, gt=0)
    """How long a worker may take to start one sandbox (image unpacking included)."""
    worker_grace_s: float = Field(default=60.0, gt=0)
    """A worker that cannot reach its controller this long stops its sandboxes and exits."""
    scale_interval_s: float = Field(default=1.0, gt=0)
    """How often the scaler compares desired and current workers."""
    submit_per_tick: int = Field(default=8, ge=1)
    """Most worker submissions per scaler tick (polite to the scheduler)."""
    work_dir: str = "/tmp/sandfleet-{user}"
    """Node-local directory for sandbox state (one subdirectory per worker)."""
    cache_dir: str = "/tmp/sandfleet-{user}/cache"
    """Node-local cache shared by the node's workers (the local runtime mounts images in
    place and keeps nothing there; root filesystems unpacked by older versions are removed
    from it)."""
    storage_mb: int = Field(default=10240, ge=16)
    """Default disk quota of a sandbox's writable layer (a lease may ask for another)."""
    proxy_upstream: str = ""
    """Where the allowlist network's proxy sends what it lets through (``host:port`` of an
    HTTP proxy the nodes reach: a cluster's squid or registry mirror); "" connects from the
    node directly (``sandfleet.netproxy``)."""
    proxy_node_ca: bool = True
    """An allowlisted sandbox trusts, for https, the authorities the node trusts as well as
    its image's (``$SSL_CERT_FILE`` or Debian's bundle on the node: where the node's egress
    inspects TLS with its own authority, pip and curl work in the sandbox as on the node)."""
    conn_auth_timeout_s: float = Field(default=5.0, gt=0)
    """A connection to the controller or a worker must present the fleet token (a complete
    frame header) this soon after it opens, or it is closed."""
    conn_idle_timeout_s: float | None = Field(default=IDLE_TIMEOUT_S, gt=0)
    """Authenticated connections with nothing in flight silent this long are closed (None:
    never); clients reconnect after half of it without a word."""
    conns_per_peer: int = Field(default=4096, ge=1)
    """Most connections one IP may hold to the controller or to a worker (each sync lease
    holds one to its worker)."""
    unauth_conns_per_peer: int = Field(default=256, ge=1)
    """Most connections one IP may hold that have not presented the token yet."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """Slurm settings, used when ``provider`` is ``slurm``."""
    owner_pid: int | None = Field(default=None, gt=0)
    """A private fleet's owner process on the controller's host: when it is gone (its pid no
    longer runs with ``owner_start``), the fleet goes down as with ``sandfleet down``. This
    is the deadline of a fleet whose owner was killed before it could stop it."""
    owner_start: int | None = None
    """The owner's process start time (``/proc/<pid>/stat`` field 22), so a reused pid does
    not count as the owner."""

    @model_validator(mode="after")
    def _check(self) -> FleetConfig:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes {self.min_nodes} > max_nodes {self.max_nodes}")
        if self.lost_after_s < self.heartbeat_s * 2:
            raise ValueError("lost_after_s must be at least two heartbeat periods")
        parse_upstream(self.proxy_upstream)  # ValueError saying how to write it
        return self

    def wire_limits(self) -> WireLimits:
        """What the controller's and the workers' servers grant each peer."""
        return WireLimits(auth_timeout_s=self.conn_auth_timeout_s,
                          idle_timeout_s=self.conn_idle_timeout_s,
                          per_peer=self.conns_per_peer,
                          unauthenticated_per_peer=self.unauth_conns_per_peer)

    def path(self, field: str) -> Path:
        """A path field with ``{user}`` filled in."""
        return Path(getattr(self, field).replace("{user}", default_owner())).expanduser()

    def with_overrides(self, **changes) -> FleetConfig:
        """A copy with some fields changed (validated like a loaded config)."""
        data = self.model_dump()
        data.update({k: v for k, v in changes.items() if v is not None})
        return FleetConfig.model_validate(data)


def shipped_configs() -> dict[str, Path]:
    """The fleet configs shipped in the package (``fleet``, ``fleet-slurm``), by name."""
    folder = resources.files("sandfleet").joinpath("configs")
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir()
            if p.name.endswith(".yaml")}


def config_file(name: str | os.PathLike) -> Path:
    """A fleet config given as a path (as is, when it is a file) or as a shipped config's
    name: ``fleet-slurm``, ``fleet-slurm.yaml`` or ``configs/fleet-slurm.yaml`` (the
    checkout's path, which then works from any folder and from an installed wheel)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = shipped_configs()
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    if len(parts) == 1 and Path(parts[0]).stem in shipped and parts[0] in (
            Path(parts[0]).stem, f"{Path(parts[0]).stem}.yaml"):
        return shipped[Path(parts[0]).stem]
    raise FileNotFoundError(f"{path}: no such file, and no shipped fleet config of that name "
                            f"(shipped: {', '.join(sorted(shipped))}; `sandfleet config NAME` "
                            "prints one to copy)")


def load_config(path: str | os.PathLike | None = None) -> FleetConfig:
    """The config in ``path`` (YAML or JSON); the defaults when ``path`` is None."""
    if path is None:
        return FleetConfig()
    import yaml

    text = Path(path).read_text()
    data = yaml.safe_load(text) if str(path).endswith((".yaml", ".yml")) else json.loads(text)
    try:
        return FleetConfig.model_validate(data or {})
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


CONFIG_FILE = "fleet.json"
"""The resolved config a controller saves in its state dir (workers read it there)."""


def fleet_config_of(state_dir: str | os.PathLike) -> FleetConfig:
    """The resolved config a controller saved in ``state_dir``."""
    return FleetConfig.model_validate_json((Path(state_dir) / CONFIG_FILE).read_text())


def fleet_key(state_dir: str | os.PathLike) -> str:
    """A short stable name of the fleet of ``state_dir`` (work dirs, Slurm job names)."""
    return hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:10]
