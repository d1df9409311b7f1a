"""The Slurm launcher (``tmax-train --launcher slurm``): the run's inference servers and its
trainer as Slurm jobs, the orchestrator in the launching process.

Each job is a batch script rendered from a template in ``tmax/train/templates/``
(``tmax-inference.sbatch``, ``tmax-trainer.sbatch``; package data) into ``RUN/slurm/`` and
submitted with ``sbatch --parsable``. Why
rendered scripts and not submitit's pickled functions: the script a user reads in
``--dry-run``, the one in ``RUN/slurm/`` and the one Slurm runs are the same file, usable by
hand (``sbatch RUN/slurm/trainer.sbatch``) and needing nothing of the launcher's memory;
submitit's own script runs ``python -m submitit.core._submit`` on a pickle. Every sbatch
option is a keyword of one pure function (``sbatch_lines``); every Slurm call goes through
sandfleet's one Slurm client (``sandfleet.slurm``): an argv list with a timeout, its stderr
to the log, never the terminal; the states of all the run's jobs come from one batched
poll (``Poller``, at most one per ``slurm.poll_s``).

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

``RUN/jobs.json`` records every job the launcher submitted (role, name, id, log;
``tmax.train.runfiles``), so ``tmax-train status`` and ``stop`` (``tmax.train.control``)
act on exactly this run's jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from sandfleet import run_event_loop
from sandfleet import slurm as slurm_api
from tmax import log as tmax_log
from tmax.inference.http import HttpEngine
from tmax.inference.process import ServerProcess, free_port
from tmax.train.commands import server_command
from tmax.train.config import TrainConfig, load_train_config, save_config
from tmax.train.control import run_status, stop_run
from tmax.train.handover import Handover, alive
from tmax.train.runfiles import TrainProcessError, job_log, read_jobs, record_job, tail
from tmax.train.runfiles import write_script as _write_script
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
from tmax.train.trainer_rank import ORCHESTRATOR

ACTIVE = slurm_api.ACTIVE
SlurmError = slurm_api.SlurmError

__all__ = ["ACTIVE", "SlurmError", "SlurmInferenceServers", "SlurmTrainer", "detach",
           "format_walltime", "inference_script", "make_poller", "orchestrator_script",
           "read_jobs", "record_job", "run_status", "sbatch_lines", "slurm_plan",
           "staggered", "stop_run", "trainer_script", "walltime_s"]

log = logging.getLogger(__name__)

REQUEUE_EXIT = 3
"""A trainer rank's exit code after a checkpoint-and-requeue (the job comes back)."""


def make_poller(config: TrainConfig) -> slurm_api.Poller:
    """The run's one Slurm poller: a client with ``slurm.command_timeout_s``, every job's
    state at most once per ``slurm.poll_s``."""
    return slurm_api.Poller(slurm_api.SlurmClient(config.slurm.command_timeout_s),
                            config.slurm.poll_s)


def detach(config: TrainConfig, client: slurm_api.SlurmClient | None = None) -> str:
    """``tmax-train --launcher slurm --detach``: save the run's config, submit the
    orchestrator job (which submits the rest); returns its job id."""
    run = config.run_dir.absolute()
    run.mkdir(parents=True, exist_ok=True)
    save_config(config, run / "config.yaml", launcher="slurm --detach")
    script = _write_script(run, "orchestrator.sbatch", orchestrator_script(config, run))
    job_id = (client or slurm_api.SlurmClient(config.slurm.command_timeout_s)).submit(script)
    record_job(run, role="orchestrator", name="orchestrator", job_id=job_id,
               log=str(job_log(run, "orchestrator", job_id)), script=str(script))
    return job_id


def _cancel(poller: slurm_api.Poller, job_id: str) -> None:
    """scancel by id; a refusal is logged (the launcher goes on stopping the rest)."""
    try:
        poller.client.cancel(job_id)
    except SlurmError as e:
        log.warning("%s", e)
    poller.reset()


def _submit(poller: slurm_api.Poller, script: Path) -> str:
    job_id = poller.client.submit(script)
    poller.watch([job_id])
    poller.reset()
    return job_id


# --------------------------------------------------------------------------- the roles


class SlurmTrainer:
    """The trainer as one Slurm job (the launcher's ``Trainer`` role)."""

    def __init__(self, config: TrainConfig, run_dir: Path, poller: slurm_api.Poller):
        self.config, self.run_dir, self.poller = config, Path(run_dir).absolute(), poller
        self.job_id: str | None = None
        self.starts = 0

    def start(self) -> None:
        script = _write_script(self.run_dir, "trainer.sbatch",
                               trainer_script(self.config, self.run_dir))
        self.job_id = _submit(self.poller, script)
        self.starts += 1
        record_job(self.run_dir, role="trainer", name="trainer", job_id=self.job_id,
                   log=str(self.log_path), script=str(script))
        log.info("trainer: job %s submitted (%s)", self.job_id, script)

    def state(self) -> str:
        return self.poller.states([self.job_id])[self.job_id] if self.job_id else "NONE"

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
        if self.job_id and self.poller.states([self.job_id], fresh=True)[self.job_id] in ACTIVE:
            _cancel(self.poller, self.job_id)

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

    def __init__(self, config: TrainConfig, run_dir: Path, poller: slurm_api.Poller):
        self.config, self.run_dir, self.poller = config, Path(run_dir).absolute(), poller
        self.jobs: dict[int, tuple[str, str]] = {}  # id(engine) -> (name, job id)
        self.started = 0

    async def start_one(self) -> Any:
        """Submit a server job, wait for its registration, return its engine."""
        i = self.started
        self.started += 1
        name = f"inference-{i}"
        reg = self.run_dir / "servers" / f"{i}.json"
        reg.unlink(missing_ok=True)  # a previous launch's
        script = _write_script(self.run_dir, f"{name}.sbatch",
                               inference_script(self.config, self.run_dir, i))
        job_id = await asyncio.to_thread(_submit, self.poller, script)
        logfile = job_log(self.run_dir, name, job_id)
        record_job(self.run_dir, role="inference", name=name, job_id=job_id,
                   log=str(logfile), script=str(script))
        log.info("inference: %s is job %s", name, job_id)
        try:
            url = await self._registered(reg, job_id, logfile)
        except BaseException:
            await asyncio.to_thread(_cancel, self.poller, job_id)
            raise
        engine = HttpEngine(url, self.config.name, name=name,
                            temperature=self.config.rollout.temperature,
                            max_tokens=self.config.rollout.max_new_tokens,
                            max_retries=1, backoff_s=0.2)
        if not await engine.health():
            await asyncio.to_thread(_cancel, self.poller, job_id)
            raise TrainProcessError(f"inference server {name} (job {job_id}) registered "
                                    f"{url} but does not answer there; its log: {logfile}")
        if self.config.engine == "vllm":
            await engine.refresh_version()
        self.jobs[id(engine)] = (name, job_id)
        return engine

    async def _registered(self, reg: Path, job_id: str, logfile: Path) -> str:
        deadline = time.monotonic() + self.config.distributed.server_start_timeout_s
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                doc = json.loads(await asyncio.to_thread(reg.read_text))
                if str(doc["job_id"]) == job_id:
                    return str(doc["url"])
            state = (await asyncio.to_thread(self.poller.states, [job_id]))[job_id]
            if state not in ACTIVE:
                raise TrainProcessError(f"inference job {job_id} ended ({state}) before its "
                                        f"server registered; its log: {logfile}\n"
                                        f"{tail(logfile)}")
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
            await asyncio.to_thread(_cancel, self.poller, entry[1])

    async def stop_all(self) -> None:
        for _, job_id in list(self.jobs.values()):
            await asyncio.to_thread(_cancel, self.poller, job_id)
        self.jobs.clear()

    def pids(self) -> dict[str, int]:
        return {}

    def ids(self) -> dict[str, str]:
        return dict(self.jobs.values())


# --------------------------------------------------------------------------- on the node


def node_address() -> str:
    """This node's address as Slurm knows it (NodeAddr), else its fully qualified name."""
    node = os.environ.get("SLURMD_NODENAME")
    address = slurm_api.SlurmClient(30).node_address(node) if node else None
    return address or socket.getfqdn()


async def serve(run_dir: Path, index: int) -> int:
    """Inference server ``index`` on this node until it dies, the job ends, or the
    orchestrator's heartbeat goes stale (``distributed.stale_after_s``: its launcher was
    killed and cannot cancel the job); registers ``RUN/servers/<index>.json`` once
    healthy. Returns the exit code."""
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
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "server" or not args[2].isdigit():
        sys.exit("usage: python -m tmax.train.slurm server RUN_DIR INDEX")
    tmax_log.setup(default=logging.INFO)
    sys.exit(run_event_loop(serve(Path(args[1]), int(args[2]))))


if __name__ == "__main__":
    main()
