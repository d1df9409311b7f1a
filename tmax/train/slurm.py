"""The Slurm launcher (``tmax-train --launcher slurm``): the run's inference servers and its
trainer as Slurm jobs, the orchestrator in the launching process.

Each job is a batch script rendered from a template in ``slurm/`` (``tmax-inference.sbatch``,
``tmax-trainer.sbatch``) into ``RUN/slurm/`` and submitted with ``sbatch --parsable``. Why
rendered scripts and not submitit's pickled functions: the script a user reads in
``--dry-run``, the one in ``RUN/slurm/`` and the one Slurm runs are the same file, usable by
hand (``sbatch RUN/slurm/trainer.sbatch``) and needing nothing of the launcher's memory;
submitit's own script runs ``python -m submitit.core._submit`` on a pickle. Every sbatch
option is a keyword of one pure function (``sbatch_lines``); every Slurm call is an argv
list with a timeout; its stderr goes to the log, never the terminal.

- **inference**: one job per server. The job runs ``python -m tmax.train.slurm server RUN
  I`` (``serve_main``): the server (hf-server or vLLM) on a free port of its node, then, once
  ``/health`` answers, ``RUN/servers/I.json`` (url, job id; written atomically). The
  launcher waits for that file (``distributed.server_start_timeout_s``); a job that ends
  first or never registers is a ``TrainProcessError`` naming the job id and its log. A lost
  server's job is cancelled by id and a new job (a new index) is submitted.
- **trainer**: one job, ``slurm.trainer_nodes`` nodes x (ranks / nodes) tasks per node, each
  task one rank (``RANK=$SLURM_PROCID`` ...). ``--signal=USR2@<preempt_signal_s>`` and
  ``--requeue``: before the time limit every rank gets USR2, finishes its step, checkpoints,
  and rank 0 requeues the job (``scontrol requeue``); the requeued job resumes from the
  checkpoint. A pending or requeued job counts as running; a job that ended otherwise is
  resubmitted (``distributed.max_restarts`` times).
- **the orchestrator** stays in the launching process: it is the one process that must live
  exactly as long as the run and no longer, it holds the live progress view, and it stops
  every job of the run (by id) when it ends or is interrupted. A run that must outlive the
  login shell uses ``--detach``: the same launcher as a one-node CPU job
  (``tmax-orchestrator.sbatch``); scancel of that job stops the run like Ctrl-C.

The scripts themselves (every ``#SBATCH`` line, per role) are ``tmax.train.slurm_scripts``.

``RUN/jobs.json`` records every job the launcher submitted (role, name, id, log), so
``tmax-train status`` and ``stop`` act on exactly this run's jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tmax.train.config import TrainConfig
from tmax.train.slurm_scripts import (  # re-exported: the scripts are part of this API
    format_walltime,
    inference_script,
    orchestrator_script,
    sbatch_lines,
    slurm_plan,
    staggered,
    trainer_script,
    walltime_s,
)

__all__ = ["ACTIVE", "Slurm", "SlurmError", "SlurmInferenceServers", "SlurmTrainer",
           "detach", "format_walltime", "inference_script", "orchestrator_script",
           "read_jobs", "record_job", "run_status", "sbatch_lines", "slurm_plan",
           "staggered", "stop_run", "trainer_script", "walltime_s"]

log = logging.getLogger(__name__)

REQUEUE_EXIT = 3
"""A trainer rank's exit code after a checkpoint-and-requeue (the job comes back)."""

_JOB_ID = re.compile(r"^(\d+)(?:;\S+)?$")
ACTIVE = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
          "RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED"}
"""Job states of a job that is (or will be again) running."""


def detach(config: TrainConfig, slurm: Slurm | None = None) -> str:
    """``tmax-train --launcher slurm --detach``: save the run's config, submit the
    orchestrator job (which submits the rest); returns its job id."""
    from tmax.train.config import save_config

    run = config.run_dir.absolute()
    run.mkdir(parents=True, exist_ok=True)
    save_config(config, run / "config.yaml", launcher="slurm --detach")
    script = _write_script(run, "orchestrator.sbatch", orchestrator_script(config, run))
    job_id = (slurm or Slurm(config.slurm.command_timeout_s)).submit(script)
    record_job(run, role="orchestrator", name="orchestrator", job_id=job_id,
               log=str(job_log(run, "orchestrator", job_id)), script=str(script))
    return job_id


# --------------------------------------------------------------------------- slurm calls


class SlurmError(Exception):
    """A Slurm command failed; carries its stderr."""


class Slurm:
    """sbatch, squeue/scontrol, scancel as argv lists with a timeout; their stderr goes to
    the log (never to the terminal)."""

    def __init__(self, timeout_s: float = 60.0, poll_s: float = 5.0):
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._states: dict[str, str] = {}
        self._polled = 0.0

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s,
                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                 check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SlurmError(f"{shlex.join(argv)}: {e}") from None
        if out.stderr.strip():
            log.debug("%s: %s", argv[0], out.stderr.strip()[-1000:])
        return out

    def submit(self, script: Path) -> str:
        out = self._run(["sbatch", "--parsable", str(script)])
        match = _JOB_ID.match(out.stdout.strip())
        if out.returncode != 0 or not match:
            raise SlurmError(f"sbatch {script} failed ({out.returncode}): "
                             f"{out.stderr.strip()[-2000:] or out.stdout.strip()}")
        self._polled = 0.0
        return match.group(1)

    def states(self, job_ids: Sequence[str], *, fresh: bool = False) -> dict[str, str]:
        """Each job's Slurm state (``RUNNING``, ``PENDING``, ``COMPLETED``, ``FAILED`` ...;
        ``UNKNOWN`` when Slurm no longer knows it): one squeue for all, scontrol (then
        sacct) for those squeue no longer lists. At most one poll per ``poll_s``."""
        ids = [j for j in job_ids if j]
        if not fresh and time.monotonic() - self._polled < self.poll_s \
                and all(j in self._states for j in ids):
            return {j: self._states[j] for j in ids}
        self._polled = time.monotonic()
        found: dict[str, str] = {}
        if ids:
            out = self._run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"])
            for line in out.stdout.splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] in ids:
                    found[parts[0]] = parts[1]
        for j in (j for j in ids if j not in found):
            out = self._run(["scontrol", "-o", "show", "job", j])
            m = re.search(r"\bJobState=(\S+)", out.stdout)
            if m:
                found[j] = m.group(1)
                continue
            out = self._run(["sacct", "-n", "-X", "-P", "-j", j, "-o", "State"])
            lines = out.stdout.split() if out.returncode == 0 else []
            found[j] = lines[0] if lines else "UNKNOWN"
        self._states.update(found)
        return found

    def cancel(self, job_id: str) -> None:
        if not job_id.isdigit():
            raise ValueError(f"not a Slurm job id: {job_id!r}")
        out = self._run(["scancel", job_id])
        self._polled = 0.0
        if out.returncode != 0 and "Invalid job id" not in out.stderr \
                and "already completing" not in out.stderr:
            log.warning("scancel %s failed (%d): %s", job_id, out.returncode,
                        out.stderr.strip()[-500:])


# --------------------------------------------------------------------------- jobs.json


def read_jobs(run_dir: Path) -> list[dict[str, Any]]:
    """Every job a launcher submitted for this run: ``{role, name, job_id, log, script}``."""
    try:
        return list(json.loads((Path(run_dir) / "jobs.json").read_text())["jobs"])
    except (OSError, ValueError, KeyError):
        return []


def record_job(run_dir: Path, **job: Any) -> None:
    jobs = read_jobs(run_dir) + [{**job, "submitted": time.time()}]
    tmp = Path(run_dir) / ".jobs.json.tmp"
    tmp.write_text(json.dumps({"jobs": jobs}, indent=1) + "\n")
    os.replace(tmp, Path(run_dir) / "jobs.json")


def _write_script(run_dir: Path, name: str, text: str) -> Path:
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = folder / name
    tmp = path.with_name(f".{name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def job_log(run_dir: Path, role: str, job_id: str) -> Path:
    return Path(run_dir).absolute() / "logs" / f"slurm-{role}-{job_id}.out"


# --------------------------------------------------------------------------- the roles


class SlurmTrainer:
    """The trainer as one Slurm job (the launcher's ``Trainer`` role)."""

    def __init__(self, config: TrainConfig, run_dir: Path, slurm: Slurm):
        self.config, self.run_dir, self.slurm = config, Path(run_dir).absolute(), slurm
        self.job_id: str | None = None
        self.starts = 0

    def start(self) -> None:
        script = _write_script(self.run_dir, "trainer.sbatch",
                               trainer_script(self.config, self.run_dir))
        self.job_id = self.slurm.submit(script)
        self.starts += 1
        record_job(self.run_dir, role="trainer", name="trainer", job_id=self.job_id,
                   log=str(self.log_path), script=str(script))
        log.info("trainer: job %s submitted (%s)", self.job_id, script)

    def state(self) -> str:
        return self.slurm.states([self.job_id])[self.job_id] if self.job_id else "NONE"

    def running(self) -> bool:
        return self.state() in ACTIVE

    def failed(self) -> bool:
        state = self.state()
        return state not in ACTIVE and state not in ("COMPLETED", "NONE")

    def wait(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(1.0)

    def stop(self) -> None:
        if self.job_id and self.slurm.states([self.job_id], fresh=True)[self.job_id] in ACTIVE:
            self.slurm.cancel(self.job_id)

    @property
    def log_path(self) -> Path:
        return job_log(self.run_dir, "trainer", self.job_id or "%j")

    def ids(self) -> list[str]:
        return [self.job_id] if self.job_id and self.running() else []

    def pids(self) -> list[int]:
        return []

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


class SlurmInferenceServers:
    """The run's inference servers as Slurm jobs, one each (the launcher's ``Servers``)."""

    def __init__(self, config: TrainConfig, run_dir: Path, slurm: Slurm):
        self.config, self.run_dir, self.slurm = config, Path(run_dir).absolute(), slurm
        self.jobs: dict[int, tuple[str, str]] = {}  # id(engine) -> (name, job id)
        self.started = 0

    async def start_one(self) -> Any:
        """Submit a server job, wait for its registration, return its engine."""
        from tmax.inference.http import HttpEngine
        from tmax.train.processes import TrainProcessError

        i = self.started
        self.started += 1
        name = f"inference-{i}"
        reg = self.run_dir / "servers" / f"{i}.json"
        reg.unlink(missing_ok=True)  # a previous launch's
        script = _write_script(self.run_dir, f"{name}.sbatch",
                               inference_script(self.config, self.run_dir, i))
        job_id = await asyncio.to_thread(self.slurm.submit, script)
        logfile = job_log(self.run_dir, name, job_id)
        record_job(self.run_dir, role="inference", name=name, job_id=job_id,
                   log=str(logfile), script=str(script))
        log.info("inference: %s is job %s", name, job_id)
        try:
            url = await self._registered(reg, job_id, logfile)
        except BaseException:
            await asyncio.to_thread(self.slurm.cancel, job_id)
            raise
        engine = HttpEngine(url, self.config.name, name=name,
                            temperature=self.config.rollout.temperature,
                            max_tokens=self.config.rollout.max_new_tokens,
                            max_retries=1, backoff_s=0.2)
        if not await engine.health():
            await asyncio.to_thread(self.slurm.cancel, job_id)
            raise TrainProcessError(f"inference server {name} (job {job_id}) registered "
                                    f"{url} but does not answer there; its log: {logfile}")
        if self.config.engine == "vllm":
            await engine.refresh_version()
        self.jobs[id(engine)] = (name, job_id)
        return engine

    async def _registered(self, reg: Path, job_id: str, logfile: Path) -> str:
        from tmax.train.processes import TrainProcessError

        deadline = time.monotonic() + self.config.distributed.server_start_timeout_s
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                doc = json.loads(await asyncio.to_thread(reg.read_text))
                if str(doc["job_id"]) == job_id:
                    return str(doc["url"])
            state = (await asyncio.to_thread(self.slurm.states, [job_id]))[job_id]
            if state not in ACTIVE:
                raise TrainProcessError(f"inference job {job_id} ended ({state}) before its "
                                        f"server registered; its log: {logfile}\n"
                                        f"{_tail(logfile)}")
            if time.monotonic() > deadline:
                raise TrainProcessError(
                    f"inference job {job_id} ({state}) did not register a server in {reg} "
                    f"within {self.config.distributed.server_start_timeout_s:.0f} s; its "
                    f"log: {logfile}")
            await asyncio.sleep(1.0)

    async def stop(self, engine: Any) -> None:
        entry = self.jobs.pop(id(engine), None)
        with contextlib.suppress(Exception):
            await engine.aclose()
        if entry is not None:
            await asyncio.to_thread(self.slurm.cancel, entry[1])

    async def stop_all(self) -> None:
        for _, job_id in list(self.jobs.values()):
            await asyncio.to_thread(self.slurm.cancel, job_id)
        self.jobs.clear()

    def pids(self) -> dict[str, int]:
        return {}

    def ids(self) -> dict[str, str]:
        return dict(self.jobs.values())


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------- status, stop


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


def run_status(run_dir: str | os.PathLike, slurm: Slurm | None = None) -> dict[str, Any]:
    """``tmax-train status``: each recorded job's Slurm state (one squeue for all), each
    recorded local process, the last step and its reward, the newest weights version, the
    weights version each inference engine serves (as the orchestrator last wrote it)."""
    from tmax.train.handover import Handover, is_done

    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise SlurmError(f"{run}: not a run folder (no config.yaml)")
    from tmax.train.config import load_train_config

    config = load_train_config(run / "config.yaml")
    jobs = read_jobs(run)
    states = (slurm or Slurm()).states([j["job_id"] for j in jobs], fresh=True) if jobs else {}
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
    from sandfleet import FleetClient, InfraError, controller_alive, read_controller_info

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


def stop_run(run_dir: str | os.PathLike, slurm: Slurm | None = None) -> list[str]:
    """``tmax-train stop``: SIGTERM to the launcher (it stops what it started), scancel of
    every job recorded in ``RUN/jobs.json`` that is still queued or running (by id, nothing
    else), and SIGTERM then SIGKILL to the process groups recorded in processes.json."""
    run = Path(run_dir)
    slurm = slurm or Slurm()
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
    states = slurm.states([j["job_id"] for j in jobs], fresh=True) if jobs else {}
    for job in jobs:
        if states.get(job["job_id"]) in ACTIVE - {"COMPLETING"}:
            slurm.cancel(job["job_id"])
            said.append(f"{job['name']}: scancel {job['job_id']}")
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
    from tmax.train.gc import stop_private_fleet

    for action in stop_private_fleet(run, dry_run=False):  # its own fleet, if still up
        said.append(action.line(False) + (f" (failed: {action.error})" if action.error
                                          else ""))
    return said or [f"{run}: nothing of this run is running"]


# --------------------------------------------------------------------------- on the node


def node_address() -> str:
    """This node's address as Slurm knows it (NodeAddr), else its fully qualified name."""
    node = os.environ.get("SLURMD_NODENAME")
    if node:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            out = subprocess.run(["scontrol", "-o", "show", "node", node],
                                 capture_output=True, text=True, timeout=30, check=False)
            m = re.search(r"\bNodeAddr=(\S+)", out.stdout)
            if m:
                return m.group(1)
    return socket.getfqdn()


async def serve(run_dir: Path, index: int) -> int:
    """Inference server ``index`` on this node until it dies, the job ends, or the
    orchestrator's heartbeat goes stale (``distributed.stale_after_s``: its launcher was
    killed and cannot cancel the job); registers ``RUN/servers/<index>.json`` once
    healthy. Returns the exit code."""
    from tmax.inference.process import ServerProcess, free_port
    from tmax.train.config import load_train_config
    from tmax.train.handover import Handover, alive
    from tmax.train.processes import ORCHESTRATOR, server_command

    config = load_train_config(run_dir / "config.yaml")
    host = os.environ.get("TMAX_SERVER_HOST") or node_address()
    port = free_port(host)
    argv, env = server_command(config, run_dir, index, port, host=host)
    url = f"http://{host}:{port}"
    server = ServerProcess(argv, url=url, env=env, name=f"inference-{index}",
                           log_path=run_dir / "logs" / f"inference-{index}.log",
                           start_timeout_s=config.distributed.server_start_timeout_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        reg = run_dir / "servers" / f"{index}.json"
        reg.parent.mkdir(parents=True, exist_ok=True)
        tmp = reg.with_name(f".{reg.name}.tmp")
        tmp.write_text(json.dumps({"url": url, "job_id": os.environ.get("SLURM_JOB_ID", ""),
                                   "host": host, "port": port, "pid": server.pid,
                                   "index": index}) + "\n")
        os.replace(tmp, reg)
        log.info("inference-%d: serving at %s, registered in %s", index, url, reg)
        handover, stale_s = Handover(run_dir), config.distributed.stale_after_s
        while not stop.is_set() and server.alive():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if not await asyncio.to_thread(alive, handover, ORCHESTRATOR, stale_s):
                log.warning("inference-%d: the orchestrator's heartbeat is older than %.0f s: "
                            "its launcher is gone; stopping", index, stale_s)
                return 0
        return 0 if stop.is_set() else 1
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m tmax.train.slurm server RUN_DIR INDEX``: one inference job's payload."""
    from tmax import log as tmax_log

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "server" or not args[2].isdigit():
        sys.exit("usage: python -m tmax.train.slurm server RUN_DIR INDEX")
    tmax_log.setup(default=logging.INFO)
    from sandfleet import run_event_loop

    sys.exit(run_event_loop(serve(Path(args[1]), int(args[2]))))


if __name__ == "__main__":
    main()
