"""A training run as separate processes: inference servers, the trainer's ranks, the
orchestrator; they meet only in the run folder (``tmax.train.handover``) and over HTTP.

- **inference servers**: ``tmax serve`` (engine=transformers) or ``vllm serve``
  (engine=vllm), each its own process group, log in ``RUN/logs/``;
- **the trainer**: ``python -m tmax.train.processes trainer RUN`` on every rank
  (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` from the launcher or Slurm),
  ``tmax.train.trainer_rank``;
- **the orchestrator** (in the launching process here): the fleet client, the engine pool,
  the group sampler and the staleness bound. Before it builds step k's batch, every engine
  serves weights of version >= k - rollout.async_steps; every new version is loaded into
  the engines as soon as it appears.

``run_processes`` is the launcher: it starts all of them (``launcher="local"``: child
processes on this machine; ``"slurm"``: Slurm jobs, ``tmax.train.slurm``), supervises them
(a dead inference server is replaced and its in-flight episodes are infrastructure
failures; a dead trainer is restarted from its checkpoint, ``distributed.max_restarts``
times) and stops every process or job it started, by process group or job id, on the way
out. Where the trainer runs is a ``TrainerRunner``, where the servers run a
``ServerRunner``: one small class of each per launcher; what each runs is
``tmax.train.commands``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from sandfleet import proc_start_time, run_event_loop
from tmax import log as tmax_log
from tmax.agent.policy import PolicyUnavailable
from tmax.images.store import default_store
from tmax.inference.base import EngineError
from tmax.inference.http import HttpEngine
from tmax.inference.process import ServerProcess, free_port
from tmax.rollout.run import TaskImages
from tmax.rollout.trajectory import append_jsonl
from tmax.train.commands import launch_plan, server_command, trainer_command, vllm_config_of
from tmax.train.config import TrainConfig, save_config
from tmax.train.engines import EnginePool
from tmax.train.handover import Handover, Heartbeat, is_done
from tmax.train.loop import (
    load_training_tasks,
    prepare_model,
    run_agent_config,
    run_fleet,
    seed_everything,
    step_metrics,
    write_plots,
)
from tmax.train.model_load import checkpoint_context_length
from tmax.train.nccl_pool import NcclCoordinator
from tmax.train.rollouts import GroupSampler
from tmax.train.runfiles import TrainProcessError
from tmax.train.slurm import SlurmInferenceServers, SlurmTrainer, make_poller
from tmax.train.trainer import samples_of
from tmax.train.trainer_rank import (
    ORCHESTRATOR,
    REQUEUE_EXIT,
    Preemption,
    Requeue,
    publish,
    requeue,
    trainer_main,
    trainer_role,
)

__all__ = ["ORCHESTRATOR", "REQUEUE_EXIT", "Preemption", "Requeue", "TrainProcessError",
           "launch_plan", "orchestrate", "publish", "requeue", "run_processes",
           "server_command", "trainer_command", "trainer_main", "trainer_role",
           "vllm_config_of"]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- orchestrator


async def orchestrate(config: TrainConfig, run_dir: Path, pool: Any, *,
                      trainer_alive: Any, progress: bool = True, nccl: Any = None) -> None:
    """Sample groups through ``pool`` and the fleet; hand step k's batch to the trainer;
    load each new weights version into the engines. Returns when the trainer is done.
    The caller holds the orchestrator's ``Heartbeat`` (from before the trainer starts, so
    the trainer never takes a slow start for a dead orchestrator). With ``nccl`` (an
    ``NcclCoordinator``) new versions arrive by broadcast: no folder path is posted."""
    d = config.distributed
    handover = Handover(run_dir)
    tasks = load_training_tasks(config)
    agent_config = run_agent_config(config)
    images = TaskImages(config.tasks.image_store or default_store())
    if nccl is not None:
        start = await nccl.start(pool)
    else:
        version, path = await asyncio.to_thread(handover.wait_weights, 0,
                                                timeout=d.weights_timeout_s,
                                                alive=trainer_alive)
        await pool.sync(path, version)
        start = version
    max_len = checkpoint_context_length(run_dir / "init")
    rollouts_path = run_dir / "rollouts.jsonl"

    def record(traj) -> None:
        append_jsonl(rollouts_path, {**traj.to_dict(), "trainer_step": pool.version})

    async def follow_weights() -> None:
        said: list[dict[str, Any]] = []
        while True:
            if nccl is not None:
                await nccl.follow(pool)
            elif (latest := handover.latest_weights()) is not None \
                    and latest[0] > pool.target:
                await pool.sync(latest[1], latest[0])
            if (now := pool.describe()) != said:
                said = now  # for `tmax-train status`: each engine's version
                await asyncio.to_thread(handover.put_engines, now)
            await asyncio.sleep(0.2)

    async def wait_version(wanted: int) -> None:
        deadline = time.monotonic() + d.weights_timeout_s
        while pool.version < wanted:
            if not trainer_alive():
                raise TrainProcessError(f"the trainer is gone while the orchestrator waits "
                                        f"for weights version {wanted}; see "
                                        f"{run_dir / 'logs'}")
            if time.monotonic() > deadline:
                raise TrainProcessError(f"weights version {wanted} did not reach the "
                                        f"engines within {d.weights_timeout_s:.0f} s")
            if follower.done():
                follower.result()  # a failed sync stops the run with its own error
            await asyncio.sleep(0.2)

    async with run_fleet(config, run_dir) as fleet:
        sampler = GroupSampler.from_config(config, tasks, pool, fleet, images, agent_config,
                                           seed=config.seed + start, on_rollout=record)
        sampler.start()
        follower = asyncio.create_task(follow_weights())
        bar = tqdm(total=config.steps, initial=start, desc="train", disable=not progress)
        try:
            for step in range(start, config.steps):
                await wait_version(step - config.rollout.async_steps)
                if handover.batch_path(step).exists():
                    continue  # made before a restart, not trained on yet
                groups = await sampler.next_batch(config.rollout.groups_per_step, step)
                samples, versions = [], []
                for group in groups:
                    mine = samples_of([group], max_len)
                    samples += mine
                    versions += [group.version] * len(mine)
                if not samples:
                    raise TrainProcessError("the step's rollouts carry no token ids: "
                                            "the inference engine must report them")
                meta = step_metrics(sampler.take_stats(), groups, step)
                await asyncio.to_thread(handover.put_batch, step, samples, versions, meta)
                bar.update(max(0, pool.version - bar.n))
                bar.set_postfix(reward=f"{meta['reward_mean']:.2f}", engines=len(pool.live))
            await wait_version(config.steps)
            bar.update(max(0, pool.version - bar.n))
            await asyncio.to_thread(handover.put_engines, pool.describe())
        finally:
            bar.close()
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follower
            await sampler.stop()


# --------------------------------------------------------------------------- where roles run


class TrainerRunner(Protocol):
    """Where the trainer's ranks run: local processes (``TrainerGroup``) or a Slurm job
    (``tmax.train.slurm.SlurmTrainer``)."""

    starts: int

    def start(self) -> None: ...
    def running(self) -> bool: ...
    def failed(self) -> bool: ...
    def wait(self, timeout_s: float = 120.0) -> None: ...
    def stop(self) -> None: ...
    @property
    def log_path(self) -> Path: ...
    def log_tail(self, n: int = 3000) -> str: ...
    def pids(self) -> list[int]: ...
    def ids(self) -> list[str]: ...


class ServerRunner(Protocol):
    """Where the inference servers run: local processes (``InferenceServers``) or one
    Slurm job each (``tmax.train.slurm.SlurmInferenceServers``)."""

    async def start_one(self) -> Any: ...
    async def stop(self, engine: Any) -> None: ...
    async def stop_all(self) -> None: ...
    def pids(self) -> dict[str, int]: ...
    def ids(self) -> dict[str, str]: ...


# --------------------------------------------------------------------------- local launcher


class TrainerGroup:
    """The trainer's ranks as child processes of this one (each its own process group)."""

    def __init__(self, run_dir: Path, world: int, threads: int | None):
        self.run_dir, self.world, self.threads = run_dir, world, threads
        self.procs: list[subprocess.Popen] = []
        self.starts = 0

    def start(self) -> None:
        port = free_port()
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        for rank in range(self.world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(self.world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            if self.threads:
                env["OMP_NUM_THREADS"] = str(self.threads)
            with open(logs / f"trainer-{rank}.log", "ab") as out:
                self.procs.append(subprocess.Popen(
                    trainer_command(self.run_dir), stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True))
        log.info("trainer: %d rank(s) started (pids %s)", self.world,
                 [p.pid for p in self.procs[-self.world:]])

    def wait(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for p in list(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def ids(self) -> list[str]:
        return []

    @property
    def log_path(self) -> Path:
        return self.run_dir / "logs" / "trainer-0.log"

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def failed(self) -> bool:
        return any(p.poll() not in (None, 0) for p in self.procs)

    def stop(self, grace_s: float = 10.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, sig)
            deadline = time.monotonic() + grace_s
            while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.05)
        self.procs = [p for p in self.procs if p.poll() is None]

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


class InferenceServers:
    """The run's inference servers: started, replaced when one dies, stopped at the end."""

    def __init__(self, config: TrainConfig, run_dir: Path):
        self.config, self.run_dir = config, run_dir
        self.servers: dict[int, Any] = {}  # id(engine) -> ServerProcess
        self.started = 0

    async def start_one(self) -> Any:
        """A new healthy server and its engine, serving ``run_dir/init``'s weights."""
        i = self.started
        self.started += 1
        argv, env = server_command(self.config, self.run_dir, i, free_port())
        url = "http://127.0.0.1:" + argv[argv.index("--port") + 1]
        server = ServerProcess(argv, url=url,
                               log_path=self.run_dir / "logs" / f"inference-{i}.log",
                               env=env, name=f"inference-{i}",
                               start_timeout_s=self.config.distributed.server_start_timeout_s)
        await server.start()
        engine = HttpEngine(server.url, self.config.name, name=f"inference-{i}",
                            temperature=self.config.rollout.temperature,
                            max_tokens=self.config.rollout.max_new_tokens,
                            max_retries=1, backoff_s=0.2)
        if self.config.engine == "vllm":
            await engine.refresh_version()
        self.servers[id(engine)] = server
        return engine

    async def stop(self, engine: Any) -> None:
        server = self.servers.pop(id(engine), None)
        with contextlib.suppress(Exception):
            await engine.aclose()
        if server is not None:
            await server.stop()

    async def stop_all(self) -> None:
        for server in list(self.servers.values()):
            await server.stop()
        self.servers.clear()

    def pids(self) -> dict[str, int]:
        return {s.name: s.pid for s in self.servers.values() if s.pid is not None}

    def ids(self) -> dict[str, str]:
        return {}


def write_processes(run_dir: Path, trainers: TrainerRunner, servers: ServerRunner) -> None:
    """``RUN/processes.json``: the pid of every process this launcher runs now and the id
    of every Slurm job (for status, stop and tests), rewritten atomically. The launcher
    names itself for good (host, pid, ``launcher_start``: its start time, and
    ``launcher_job``: the Slurm job it runs in, if any), and ``start_times`` names each
    child pid, so ``tmax gc`` never mistakes a reused pid for one of this run's."""
    trainer, inference = trainers.pids(), servers.pids()
    doc = {"host": socket.gethostname(), "launcher": os.getpid(),
           "launcher_start": proc_start_time(os.getpid()),
           "launcher_job": os.environ.get("SLURM_JOB_ID") or None, "trainer": trainer,
           "inference": inference,
           "start_times": {str(p): proc_start_time(p) for p in [*trainer, *inference.values()]},
           "jobs": {"trainer": trainers.ids(), "inference": servers.ids()}}
    tmp = run_dir / ".processes.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, run_dir / "processes.json")


def run_processes(config: TrainConfig, *, progress: bool = True,
                  launcher: str = "local") -> Path:
    """The launcher (``distributed.enabled``): see the module docstring."""
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml", launcher=launcher)
    seed_everything(config.seed)
    tasks = load_training_tasks(config)
    init = run_dir / "init"
    if not init.is_dir():
        if config.model.path and not config.sft.steps:  # no copy of a 9B model, no load here
            if not (Path(config.model.path) / "config.json").is_file():
                raise TrainProcessError(f"model.path {config.model.path}: not a Hugging Face "
                                        "model folder (no config.json)")
            init.symlink_to(Path(config.model.path).absolute(), target_is_directory=True)
        else:
            prepare_model(config, tasks, run_dir, run_agent_config(config),
                          progress)
    trainers, servers = runners(config, run_dir, launcher)
    run_event_loop(_launch(config, run_dir, progress, trainers, servers))
    write_plots(run_dir)
    return run_dir


def runners(config: TrainConfig, run_dir: Path, launcher: str
            ) -> tuple[TrainerRunner, ServerRunner]:
    """Where the trainer and the servers run, by launcher name (``local`` | ``slurm``)."""
    if launcher == "local":
        return (TrainerGroup(run_dir, config.distributed.trainer_ranks, config.torch_threads),
                InferenceServers(config, run_dir))
    if launcher == "slurm":
        poller = make_poller(config)  # one batched poll for the trainer's and servers' jobs
        return (SlurmTrainer(config, run_dir, poller),
                SlurmInferenceServers(config, run_dir, poller))
    raise ValueError(f"unknown launcher {launcher!r}; valid: local, slurm")


async def _launch(config: TrainConfig, run_dir: Path, progress: bool,
                  trainers: TrainerRunner, servers: ServerRunner) -> None:
    d = config.distributed
    handover = Handover(run_dir)
    replacing: set[asyncio.Task] = set()
    restarts = {"trainer": 0}

    def trainer_alive() -> bool:
        if trainers.running() or is_done(handover, "trainer"):
            return True
        if restarts["trainer"] >= d.max_restarts:
            return False
        restarts["trainer"] += 1
        log.warning("the trainer exited (see %s); restart %d/%d from its last checkpoint",
                    trainers.log_path, restarts["trainer"], d.max_restarts)
        trainers.stop()
        trainers.start()
        write_processes(run_dir, trainers, servers)
        return True

    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    assert me is not None
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stop like Ctrl-C: every child goes too
        loop.add_signal_handler(sig, me.cancel)
    beat = Heartbeat(handover, ORCHESTRATOR).__enter__()
    try:
        trainers.start()
        engines = await asyncio.gather(*(servers.start_one() for _ in range(d.inference_servers)))
        pool: EnginePool

        async def replace(lost: Any) -> None:
            await servers.stop(lost)
            engine = await servers.start_one()
            if nccl is not None:  # a new group; it joins the pool after its first version
                await nccl.replace(pool, engine)
                write_processes(run_dir, trainers, servers)
                return
            failures = 0
            while engine.version < pool.target:  # the newest weights, as the pool moved on
                latest = handover.latest_weights()
                if latest is None or latest[0] < pool.target:
                    await asyncio.sleep(0.2)
                    continue
                try:
                    await engine.update_weights_from_path(latest[1], latest[0])
                except (EngineError, PolicyUnavailable) as e:  # e.g. the folder was pruned
                    failures += 1
                    if failures >= d.max_restarts + 3:
                        log.error("inference: %s could not load weights %d, giving up on "
                                  "it: %s", engine.name, latest[0], e)
                        await servers.stop(engine)
                        return
                    await asyncio.sleep(1.0)
            pool.add(engine)
            write_processes(run_dir, trainers, servers)
            log.warning("inference: %s replaced by %s", lost.name, engine.name)

        def on_lost(engine: Any) -> None:
            task = asyncio.get_running_loop().create_task(replace(engine))
            replacing.add(task)
            task.add_done_callback(replacing.discard)

        pool = EnginePool(list(engines), on_lost=on_lost,
                          wait_for_engine_s=d.server_start_timeout_s)
        nccl = nccl_coordinator(config, run_dir, trainer_alive)
        write_processes(run_dir, trainers, servers)
        await orchestrate(config, run_dir, pool, trainer_alive=trainer_alive,
                          progress=progress, nccl=nccl)
        with contextlib.suppress(TimeoutError):  # rank 0 writes final/ after the last step
            await asyncio.wait_for(asyncio.to_thread(trainers.wait, 120), 130)
        if trainers.failed() or not is_done(handover, "trainer"):
            raise TrainProcessError(f"the trainer did not finish cleanly; its log: "
                                    f"{trainers.log_path}\n"
                                    f"{trainers.log_tail()}")
    finally:
        for task in list(replacing):
            task.cancel()
        await asyncio.gather(*replacing, return_exceptions=True)
        trainers.stop()
        await servers.stop_all()
        write_processes(run_dir, trainers, servers)
        beat.__exit__(None, None, None)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)


def nccl_coordinator(config: TrainConfig, run_dir: Path, trainer_alive: Any) -> Any:
    """The orchestrator's NCCL weight sync (``vllm.weight_transfer: nccl``), else None."""
    if config.engine != "vllm" or config.vllm.weight_transfer != "nccl":
        return None

    v = config.vllm
    return NcclCoordinator(run_dir, gpus_per_server=v.tensor_parallel_size
                           * v.data_parallel_size,
                           timeout_s=config.distributed.weights_timeout_s,
                           trainer_alive=trainer_alive)


def main(argv: list[str] | None = None) -> None:
    """``python -m tmax.train.processes trainer RUN_DIR``: one trainer rank."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "trainer":
        sys.exit("usage: python -m tmax.train.processes trainer RUN_DIR")
    tmax_log.setup(default=logging.INFO)
    try:
        trainer_main(Path(args[1]))
    except Requeue:
        sys.stdout.flush()
        raise
    except Exception as e:
        log.exception("trainer rank %s failed", os.environ.get("RANK", "0"))
        sys.exit(f"trainer: {type(e).__name__}: {e}")
    sys.stdout.flush()
    print(json.dumps({"rank": os.environ.get("RANK", "0"), "done": True}), flush=True)


if __name__ == "__main__":
    main()
