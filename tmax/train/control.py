"""``tmax-train status`` and ``stop``: what a run is doing, and stopping all of it, from
its records alone (``RUN/jobs.json``, ``RUN/processes.json``, ``RUN/fleet.json``), whichever
launcher started it. Slurm jobs are asked about and cancelled by id through sandfleet's
Slurm client (one squeue for all of a run's jobs)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from sandfleet import FleetClient, InfraError, controller_alive, read_controller_info
from sandfleet import slurm as slurm_api
from tmax.train.config import TrainConfig, load_train_config
from tmax.train.gc import stop_private_fleet
from tmax.train.handover import Handover, is_done
from tmax.train.runfiles import read_jobs

log = logging.getLogger(__name__)


class NotARun(ValueError):
    """The folder given to ``status`` is not a run folder."""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _processes(run_dir: Path) -> dict[str, int]:
    """The pids in processes.json, if they are pids of this host (a launcher on another
    login node is not ours to signal from here: its pid means another process)."""
    try:
        doc = json.loads((run_dir / "processes.json").read_text())
    except (OSError, ValueError):
        return {}
    if doc.get("host", socket.gethostname()) != socket.gethostname():
        log.warning("%s: its launcher runs on %s, not here: its processes are left alone",
                    run_dir, doc["host"])
        return {}
    procs = {"launcher": int(doc["launcher"])} if doc.get("launcher") else {}
    procs.update({f"trainer-{i}": int(p) for i, p in enumerate(doc.get("trainer", []))})
    procs.update({k: int(v) for k, v in doc.get("inference", {}).items()})
    return procs


def run_status(run_dir: str | os.PathLike, slurm: slurm_api.SlurmClient | None = None) -> dict[str, Any]:
    """``tmax-train status``: each recorded job's Slurm state (one squeue for all), each
    recorded local process, the last step and its reward, the newest weights version, the
    weights version each inference engine serves (as the orchestrator last wrote it)."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise NotARun(f"{run}: not a run folder (no config.yaml)")
    config = load_train_config(run / "config.yaml")
    jobs = read_jobs(run)
    states = (slurm or slurm_api.SlurmClient()).states([j["job_id"] for j in jobs]) if jobs else {}
    rows = []
    with contextlib.suppress(OSError):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
    handover = Handover(run)
    latest = handover.latest_weights()
    return {"run_dir": str(run), "steps": config.steps,
            "step": rows[-1]["step"] if rows else 0,
            "reward": rows[-1].get("reward_mean") if rows else None,
            "weights": latest[0] if latest else None, "done": is_done(handover, "trainer"),
            "engines": handover.engines(),
            "jobs": [{**j, "state": states.get(j["job_id"], "UNKNOWN")} for j in jobs],
            "processes": {k: {"pid": p, "alive": _alive(p)}
                          for k, p in _processes(run).items()},
            "fleet": fleet_status(run, config)}


def fleet_status(run: Path, config: TrainConfig) -> dict[str, Any] | None:
    """The run's fleet: its state dir, whether it is the run's own, and (when its controller
    answers) its nodes, leases and worker jobs; None for a private local fleet (its state
    is in a temporary folder of the launcher)."""
    record: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((run / "fleet.json").read_text())
    state = record.get("state_dir") or config.fleet.state_dir
    if not state:
        return None
    out: dict[str, Any] = {"state_dir": str(state), "private": bool(record.get("private")),
                           "up": False}
    if not controller_alive(read_controller_info(Path(state))):
        return out
    try:
        with FleetClient(state) as client:
            status = client.status()
    except (InfraError, OSError) as e:
        return out | {"error": str(e)}
    nodes = [n for n in status.get("nodes", []) if n.get("state") != "lost"]
    return out | {"up": True, "nodes": len(nodes), "leases": status.get("leases", {}),
                  "jobs": [j["job_id"] for j in status.get("jobs", [])]}


def stop_run(run_dir: str | os.PathLike, slurm: slurm_api.SlurmClient | None = None) -> list[str]:
    """``tmax-train stop``: SIGTERM to the launcher (it stops what it started), scancel of
    every job recorded in ``RUN/jobs.json`` that is still queued or running (by id, nothing
    else), and SIGTERM then SIGKILL to the process groups recorded in processes.json."""
    run = Path(run_dir)
    slurm = slurm or slurm_api.SlurmClient()
    said = []
    procs = _processes(run)
    launcher = procs.pop("launcher", None)
    if launcher and _alive(launcher) and launcher != os.getpid():
        os.kill(launcher, signal.SIGTERM)
        t0 = time.monotonic()
        while _alive(launcher) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        said.append(f"launcher pid {launcher}: SIGTERM ("
                    + (f"gone after {time.monotonic() - t0:.1f} s)" if not _alive(launcher)
                       else "still there after 60 s)"))
    jobs = read_jobs(run)
    states = slurm.states([j["job_id"] for j in jobs]) if jobs else {}
    for job in jobs:
        if states.get(job["job_id"]) in slurm_api.ACTIVE - {"COMPLETING"}:
            try:
                slurm.cancel(job["job_id"])
                said.append(f"{job['name']}: scancel {job['job_id']}")
            except slurm_api.SlurmError as e:
                said.append(f"{job['name']}: scancel {job['job_id']} failed: {e}")
    termed = {}
    for name, pid in procs.items():
        with contextlib.suppress(OSError):
            if _alive(pid) and os.getpgid(pid) == pid:  # our child led its own group
                os.killpg(pid, signal.SIGTERM)
                said.append(f"{name} pid {pid}: SIGTERM")
                termed[name] = pid
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in termed.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for name, pid in termed.items():
        with contextlib.suppress(OSError):
            if _alive(pid) and os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
                said.append(f"{name} pid {pid}: SIGKILL")
    for action in stop_private_fleet(run, dry_run=False):  # its own fleet, if still up
        said.append(action.line(False) + (f" (failed: {action.error})" if action.error
                                          else ""))
    return said or [f"{run}: nothing of this run is running"]
