"""Sandfleet: a sandbox fleet on CPU nodes that Slurm hands out on demand.

The public API, what other packages (tmax among them) may import::

    from sandfleet import FleetClient, AsyncFleetClient, FleetConfig, InfraError

- clients: ``FleetClient`` (sync), ``AsyncFleetClient``; ``run_event_loop`` (the loop the
  clients are fastest on), ``read_controller_info`` and ``controller_alive`` (is a fleet
  up in a state folder), ``FleetConfig`` (a fleet's config file);
- errors: ``SandfleetError`` (the root), ``InfraError`` (infrastructure, never the agent's
  fault: masked in training), ``ImageMissing`` and the rest of ``sandfleet.errors``;
- sandboxes without a fleet, for tools that start one on this machine (image checks):
  ``get_runtime``, ``Runtime``, ``SandboxSpec``, ``ExecResult``, ``proc_start_time``,
  ``cap_output`` (a verifier's output as a fleet's verify reply keeps it: head and tail);
- ``sif`` (SIF files: pack, extract, read_partition, SifError), ``layers`` (layered
  images: the layers file, read, write, cat) and ``BwrapSpec`` /
  ``host_root`` (bubblewrap command lines), shared with tmax's image builder and checks;
- ``netproxy``: the allowlist network (``REGISTRY_HOSTS``, ``proxy_env``, and
  ``ProxiedRuntime`` for sandboxes without a fleet);
- ``slurm``: the one Slurm client (``sbatch_lines``, ``render_template``, ``SlurmClient``,
  ``Poller``, ``SlurmError``), shared with tmax's Slurm launcher and ``tmax gc``.

Names load on first use: ``import sandfleet`` itself imports nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FleetClient": "sandfleet.client",
    "AsyncFleetClient": "sandfleet.client",
    "FleetConfig": "sandfleet.config",
    "run_event_loop": "sandfleet.wire.transport",
    "read_controller_info": "sandfleet.discovery",
    "controller_alive": "sandfleet.controller",
    "SandfleetError": "sandfleet.errors",
    "InfraError": "sandfleet.errors",
    "ImageMissing": "sandfleet.errors",
    "NodeLost": "sandfleet.errors",
    "SandboxLost": "sandfleet.errors",
    "ControllerUnreachable": "sandfleet.errors",
    "LeaseExpired": "sandfleet.errors",
    "get_runtime": "sandfleet.runtime",
    "Runtime": "sandfleet.runtime.base",
    "SandboxSpec": "sandfleet.runtime.base",
    "ExecResult": "sandfleet.runtime.base",
    "proc_start_time": "sandfleet.runtime.base",
    "cap_output": "sandfleet.runtime.base",
    "BwrapSpec": "sandfleet.runtime.bwrap",
    "host_root": "sandfleet.runtime.bwrap",
    "sif": "sandfleet.runtime.sif",
    "layers": "sandfleet.runtime.layers",
    "netproxy": "sandfleet.netproxy",
    "slurm": "sandfleet.slurm",
}

__all__ = [  # noqa: RUF022 - grouped as above
    "FleetClient",
    "AsyncFleetClient",
    "FleetConfig",
    "run_event_loop",
    "read_controller_info",
    "controller_alive",
    "SandfleetError",
    "InfraError",
    "ImageMissing",
    "NodeLost",
    "SandboxLost",
    "ControllerUnreachable",
    "LeaseExpired",
    "get_runtime",
    "Runtime",
    "SandboxSpec",
    "ExecResult",
    "proc_start_time",
    "cap_output",
    "BwrapSpec",
    "host_root",
    "sif",
    "layers",
    "netproxy",
    "slurm",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sandfleet' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if name == module.rsplit(".", 1)[-1] else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
