"""A sandbox fleet for tmax commands: connect to a running one, or start a private one.

``open_fleet(state_dir)`` connects to the fleet whose controller runs for ``state_dir``
(started by ``sandfleet up``); ``open_fleet(None, concurrency=N)`` starts a private local
fleet in a temporary state dir with the ``sandfleet`` CLI and stops it (``sandfleet down``)
when the block ends, on errors, cancellation and Ctrl-C too::

    async with open_fleet(None, concurrency=4) as fleet:
        trajectory = await rollout(task, policy, fleet, images, config)

The private fleet is one local worker with ``concurrency`` slots of the given sandbox size.
Its slots are bookkeeping, not pinned CPUs: when ``concurrency`` sandboxes need more CPUs or
memory than this machine has, they share them (oversubscribe) and run slower; a warning
says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from sandfleet import AsyncFleetClient

log = logging.getLogger(__name__)

CLI_TIMEOUT_S = 120.0
"""Limit on each ``sandfleet up`` / ``sandfleet down`` call."""


class FleetUnavailable(Exception):
    """No fleet to use: none runs for the given state dir, or a private one did not start."""


def _sandfleet(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``python -m sandfleet.cli ARGS`` (argv, own session, timeout, output captured)."""
    return subprocess.run([sys.executable, "-m", "sandfleet.cli", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          start_new_session=True, check=False)


def _physical_memory_mb() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError):
        return None


def fleet_overrides(config: dict | str | Path | None) -> dict[str, Any]:
    """``FleetConfig`` fields from a dict or a YAML file of them (None: none)."""
    if isinstance(config, (str, Path)):
        data = yaml.safe_load(Path(config).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{config}: not a mapping of sandfleet config fields")
        return data
    return dict(config or {})


def private_fleet_config(concurrency: int, *, cpus: int = 2, memory_mb: int = 2048,
                         config: dict | str | Path | None = None) -> dict[str, Any]:
    """The config of a private fleet, owned by this process (it goes down by itself if
    this process is killed). Local (the default): one worker with room for ``concurrency``
    sandboxes of ``cpus`` CPUs and ``memory_mb`` MB each, with a warning when this machine
    would be oversubscribed. ``config`` (a dict or a YAML file of ``FleetConfig`` fields)
    overrides it; with ``provider: slurm`` the workers are Slurm jobs on its partition,
    sized by its own ``cpus_per_node`` and ``max_nodes``."""
    from sandfleet import FleetConfig, proc_start_time

    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    overrides = fleet_overrides(config)
    owner = {"owner_pid": os.getpid(), "owner_start": proc_start_time(os.getpid())}
    if overrides.get("provider") == "slurm":
        data = {"min_nodes": 0, **overrides, **owner}
        FleetConfig.model_validate(data)  # unknown keys fail here, before starting
        return data
    data = {"provider": "local", "min_nodes": 1, "max_nodes": 1, **owner,
            "cpus_per_node": concurrency * cpus,
            "memory_mb_per_node": max(256, concurrency * memory_mb), **overrides}
    resolved = FleetConfig.model_validate(data)
    have_cpus, have_mb = os.cpu_count() or 1, _physical_memory_mb()
    if resolved.cpus_per_node > have_cpus or (have_mb and resolved.memory_mb_per_node > have_mb):
        log.warning("private fleet: %d sandboxes of %d CPUs / %d MB oversubscribe this machine "
                    "(%d CPUs, %s MB): they share its CPUs and memory and run slower",
                    concurrency, cpus, memory_mb, have_cpus, have_mb or "?")
    return data


@contextlib.asynccontextmanager
async def open_fleet(state_dir: str | Path | None, *, config: dict | str | Path | None = None,
                     concurrency: int = 4, sandbox_cpus: int = 2,
                     sandbox_memory_mb: int = 2048, root: str | Path | None = None
                     ) -> AsyncIterator[AsyncFleetClient]:
    """An ``AsyncFleetClient`` on the fleet of ``state_dir``, or on a private fleet (see
    ``private_fleet_config``) when ``state_dir`` is None. ``config`` only applies to a
    private fleet; ``root`` is the folder its state goes in (default: a temporary folder,
    removed after). A private Slurm fleet needs ``root`` on a filesystem its worker jobs
    see (a run folder on shared scratch): the workers read the fleet's config there."""
    if state_dir is not None:
        if config is not None:
            raise ValueError("config applies to a private fleet only; a running fleet keeps "
                             "the config it was started with")
        check_running(Path(state_dir))
        async with AsyncFleetClient(state_dir) as client:
            await _hello(client)
            yield client
        return
    data = private_fleet_config(concurrency, cpus=sandbox_cpus, memory_mb=sandbox_memory_mb,
                                config=config)
    if data.get("provider") == "slurm" and root is None:
        raise ValueError("a private Slurm fleet needs a state folder its worker jobs can "
                         "read (on shared scratch): pass root=")
    keep = root is not None
    if root is None:
        folder = Path(tempfile.mkdtemp(prefix="tmax-fleet-"))
    else:
        folder = Path(root)
        folder.mkdir(parents=True, exist_ok=True)
    state = folder / "state"
    try:
        await asyncio.to_thread(_up, folder, state, data)
        async with AsyncFleetClient(state) as client:
            await _hello(client)
            yield client
    finally:
        # In a thread and shielded: a second Ctrl-C cannot stop the fleet's shutdown
        # halfway (asyncio.run waits for the thread before it returns).
        await asyncio.shield(asyncio.to_thread(_down, folder, state, keep))


def check_running(state_dir: Path) -> None:
    """``FleetUnavailable`` unless a controller runs for ``state_dir``."""
    from sandfleet import controller_alive, read_controller_info

    if not controller_alive(read_controller_info(state_dir)):
        raise FleetUnavailable(
            f"no sandfleet controller runs for {state_dir}; start one with `sandfleet up "
            f"--state-dir {state_dir}` (or leave out the fleet to start a private local one)")


async def _hello(client: AsyncFleetClient) -> None:
    """Ask the controller for its status once, before any concurrent use: a fleet that does
    not answer fails here, and the controller connection is opened by one request (the
    client opens it without a lock, so concurrent first requests would each open one)."""
    from sandfleet import InfraError

    try:
        await client.status()
    except (InfraError, ConnectionError, OSError) as e:
        raise FleetUnavailable(f"the fleet of {client.state_dir} does not answer: {e}") \
            from None


def _up(root: Path, state: Path, data: dict[str, Any]) -> None:
    config_path = root / "fleet.yaml"
    config_path.write_text(yaml.safe_dump(data))
    out = _sandfleet("up", "--config", str(config_path), "--state-dir", str(state))
    if out.returncode != 0:
        raise FleetUnavailable(f"could not start a private fleet in {state}: "
                               f"{(out.stderr or out.stdout).strip()[-2000:]}")
    log.info("private fleet: %s", out.stdout.strip())


def _down(root: Path, state: Path, keep: bool = False) -> None:
    """``sandfleet down``; then the temporary folder goes (a caller's ``root`` stays: the
    workers' logs are there)."""
    try:
        out = _sandfleet("down", "--state-dir", str(state))
    except subprocess.TimeoutExpired:
        log.error("private fleet %s: `sandfleet down` timed out; run `sandfleet down "
                  "--state-dir %s` (or `sandfleet gc`)", state, state)
        return
    if out.returncode != 0:
        log.error("private fleet %s: `sandfleet down` failed (state kept for `sandfleet gc`):"
                  " %s", state, (out.stderr or out.stdout).strip()[-2000:])
        return
    if not keep:
        shutil.rmtree(root, ignore_errors=True)


__all__ = ["FleetUnavailable", "check_running", "fleet_overrides", "open_fleet",
           "private_fleet_config"]
