"""A training run as separate processes: inference servers, the trainer's ranks, the
orchestrator; they meet only in the run folder (``tmax.train.handover``) and over HTTP.

- **inference servers**: ``tmax serve`` (engine=transformers) or ``vllm serve``
  (engine=vllm), each its own process group, log in ``RUN/logs/``;
- **the trainer**: ``python -m tmax.train.processes trainer RUN`` on every rank
  (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` from the launcher or Slurm). It
  takes step k's batch, steps the backend, publishes weights version k+1, appends the
  step's metrics (rank 0) and checkpoints; on restart it resumes from its last checkpoint,
  so no step is lost or repeated;
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
``ServerRunner``: one small class of each per launcher.

Preemption: a trainer rank that gets SIGUSR2 (Slurm's ``--signal=USR2@90`` before the time
limit) finishes the step it is on, checkpoints, and exits with ``REQUEUE_EXIT``; under
Slurm rank 0 first requeues its job (``scontrol requeue``), which resumes from that
checkpoint, so no step is lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from tmax.rollout.trajectory import append_jsonl
from tmax.train.config import TrainConfig, load_train_config, save_config
from tmax.train.handover import Handover, Heartbeat, PeerGone, alive, is_done, mark_done

log = logging.getLogger(__name__)

ORCHESTRATOR = "orchestrator"


def trainer_role(rank: int) -> str:
    return f"trainer-{rank}"


# --------------------------------------------------------------------------- the trainer


def trainer_main(run_dir: Path) -> None:
    """One trainer rank, until ``config.steps`` are done (or the orchestrator is gone)."""
    from tmax.models.tiny import load_pretrained_dir
    from tmax.train.backends import make_trainer
    from tmax.train.loop import (
        keep_metrics_until,
        latest_checkpoint,
        save_checkpoint,
        seed_everything,
    )
    from tmax.train.tracking import TrackingSection, open_trackers

    config = load_train_config(run_dir / "config.yaml")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    seed_everything(config.seed)
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    model, tokenizer = load_pretrained_dir(run_dir / "init")
    backend = make_trainer(config, model, pad_id=tokenizer.pad_token_id or 0,
                           max_len=model.config.max_position_embeddings)
    handover = Handover(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        backend.load(ckpt)
        log.info("rank %d resumed from %s (step %d)", rank, ckpt, backend.step_count)
        if rank == 0:
            keep_metrics_until(run_dir / "metrics.jsonl", backend.step_count)
    d = config.distributed
    preempted = Preemption()
    trackers = open_trackers(config.tracking if rank == 0 else TrackingSection(), run_dir,
                             config.model_dump(mode="json"))
    with Heartbeat(handover, trainer_role(rank)), preempted, \
            contextlib.closing(trackers):
        latest = handover.latest_weights()
        if latest is None or latest[0] != backend.step_count:
            publish(handover, backend, backend.step_count)
        while backend.step_count < config.steps:
            step = backend.step_count
            path = handover.batch_path(step)
            with contextlib.suppress(PeerGone):  # PeerGone: USR2 (or the orchestrator) ...
                handover.get_batch(step, timeout=d.batch_timeout_s, alive=lambda: (
                    not preempted.is_set() and alive(handover, ORCHESTRATOR, d.stale_after_s)))
            if preempted.agreed(world):  # every rank at the same step: checkpoint, requeue
                requeue(backend, run_dir, config, rank)
            if not path.exists():  # ... the orchestrator is gone: its own error
                handover.get_batch(step, timeout=0.0, alive=lambda: alive(
                    handover, ORCHESTRATOR, d.stale_after_s))
            batch = handover.read_batch(step)
            t0 = time.monotonic()
            metrics = backend.step(batch.samples[rank::world])
            publish(handover, backend, backend.step_count)
            if rank == 0:
                metrics.update(batch.meta)
                metrics.update(step=backend.step_count, policy_version_min=min(batch.versions),
                               step_seconds=time.monotonic() - t0)
                append_jsonl(run_dir / "metrics.jsonl", metrics)
                trackers.log(metrics, backend.step_count)
                handover.prune_weights(d.keep_weights)
            if backend.step_count % config.checkpoint_every == 0 \
                    or backend.step_count == config.steps:
                save_checkpoint(backend, run_dir, config.keep_checkpoints)
                if rank == 0:  # a restart redoes the steps after it from their batches
                    handover.drop_batches_before(backend.step_count)
        if rank == 0:
            final = run_dir / "final"
            tmp = final.with_name(".final.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(handover.weights_path(backend.step_count), tmp)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            mark_done(handover, "trainer")


class Preemption:
    """SIGUSR2 (Slurm's warning before the time limit or a preemption) sets a flag the
    trainer reads between steps; ``with`` installs and restores the handler."""

    def __init__(self) -> None:
        self.flag = False
        self._old: Any = None

    def __enter__(self) -> Preemption:
        def handle(signum: int, frame: Any) -> None:
            log.warning("rank %s: SIGUSR2: checkpoint and requeue after this step",
                        os.environ.get("RANK", "0"))
            self.flag = True

        self._old = signal.signal(signal.SIGUSR2, handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGUSR2, self._old or signal.SIG_DFL)

    def is_set(self) -> bool:
        return self.flag

    def agreed(self, world: int) -> bool:
        """Whether any rank got the signal (an all-reduce with several ranks: every rank
        calls this once per step, at the same point, so they decide together)."""
        if world <= 1:
            return self.flag
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return self.flag
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        flag = torch.tensor([1 if self.flag else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


REQUEUE_EXIT = 3
"""A trainer rank's exit code after it checkpointed for a requeue."""


class Requeue(SystemExit):
    def __init__(self) -> None:
        super().__init__(REQUEUE_EXIT)


def requeue(backend: Any, run_dir: Path, config: TrainConfig, rank: int) -> None:
    """Checkpoint now (between steps), requeue this Slurm job (rank 0), exit."""
    from tmax.train.loop import latest_checkpoint, save_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None or int(ckpt.name.split("-")[1]) != backend.step_count:
        save_checkpoint(backend, run_dir, config.keep_checkpoints)
    if rank == 0:
        Handover(run_dir).drop_batches_before(backend.step_count)
        job = os.environ.get("SLURM_JOB_ID")
        log.warning("checkpointed at step %d; %s", backend.step_count,
                    f"requeueing job {job}" if job else "not a Slurm job: exiting")
        if job:
            subprocess.run(["scontrol", "requeue", job], timeout=60, check=False,
                           stdin=subprocess.DEVNULL)
    raise Requeue()


def publish(handover: Handover, backend: Any, version: int) -> None:
    """Every rank exports (ZeRO-3 gathers collectively); rank 0 writes the folder, then
    LATEST names it."""
    path = backend.export_to_path(handover.weights, version)
    if backend.rank == 0:
        handover.set_latest(version, path)


# --------------------------------------------------------------------------- orchestrator


async def orchestrate(config: TrainConfig, run_dir: Path, pool: Any, *,
                      trainer_alive: Any, progress: bool = True) -> None:
    """Sample groups through ``pool`` and the fleet; hand step k's batch to the trainer;
    load each new weights version into the engines. Returns when the trainer is done.
    The caller holds the orchestrator's ``Heartbeat`` (from before the trainer starts, so
    the trainer never takes a slow start for a dead orchestrator)."""
    from tqdm.auto import tqdm

    from tmax.images.store import default_store
    from tmax.rollout.run import TaskImages
    from tmax.train.loop import load_training_tasks, run_agent_config, run_fleet, step_metrics
    from tmax.train.rollouts import GroupSampler
    from tmax.train.trainer import samples_of

    d = config.distributed
    handover = Handover(run_dir)
    tasks = load_training_tasks(config)
    agent_config = run_agent_config(config)
    images = TaskImages(config.tasks.image_store or default_store())
    version, path = await asyncio.to_thread(handover.wait_weights, 0,
                                            timeout=d.weights_timeout_s, alive=trainer_alive)
    await pool.sync(path, version)
    start = version
    max_len = json.loads((run_dir / "init" / "config.json").read_text())[
        "max_position_embeddings"]
    rollouts_path = run_dir / "rollouts.jsonl"

    def record(traj) -> None:
        append_jsonl(rollouts_path, {**traj.to_dict(), "trainer_step": pool.version})

    async def follow_weights() -> None:
        said: list[dict[str, Any]] = []
        while True:
            latest = handover.latest_weights()
            if latest is not None and latest[0] > pool.target:
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


class TrainProcessError(Exception):
    """A process of the run failed in a way the launcher cannot repair; names its log."""


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
        from tmax.inference.process import free_port

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
        from tmax.inference.http import HttpEngine
        from tmax.inference.process import ServerProcess, free_port

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


def vllm_config_of(config: TrainConfig, model: str, index: int, port: int,
                   host: str = "0.0.0.0") -> Any:
    """The ``VLLMConfig`` of inference server ``index`` of the run."""
    from tmax.inference.vllm import VLLMConfig

    v = config.vllm
    return VLLMConfig(model=model, served_model_name=config.name, host=host, port=port,
                      tensor_parallel_size=v.tensor_parallel_size,
                      data_parallel_size=v.data_parallel_size, dtype=config.model.dtype,
                      fp32_head=config.model.fp32_lm_head, max_model_len=v.max_model_len,
                      gpu_memory_utilization=v.gpu_memory_utilization,
                      max_num_seqs=v.max_num_seqs, seed=config.seed + index,
                      weight_transfer=v.weight_transfer, enforce_eager=v.enforce_eager,
                      extra_args=tuple(v.extra_args))


def server_command(config: TrainConfig, run_dir: Path, index: int, port: int, *,
                   host: str | None = None) -> tuple[list[str], dict[str, str]]:
    """Inference server ``index``'s argv and added environment: ``vllm serve`` for
    engine=vllm, ``tmax serve`` (hf-server) for engine=transformers. Both start from the
    run's initial weights (``RUN/init``)."""
    init = str(run_dir / "init")
    env = {"OMP_NUM_THREADS": str(config.torch_threads)} if config.torch_threads else {}
    if config.engine == "vllm":
        from tmax.inference.vllm import vllm_env, vllm_serve_command

        vc = vllm_config_of(config, init, index, port, *([host] if host else []))
        return vllm_serve_command(vc), {**env, **vllm_env(vc)}
    from tmax.inference.process import hf_server_command

    return hf_server_command(init, host=host or "127.0.0.1", port=port,
                             max_batch=config.distributed.max_batch,
                             max_tokens=config.rollout.max_new_tokens,
                             temperature=config.rollout.temperature,
                             served_model_name=config.name, seed=config.seed + index), env


def trainer_command(run_dir: Path) -> list[str]:
    """One trainer rank's argv (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in its env)."""
    return [sys.executable, "-m", "tmax.train.processes", "trainer", str(run_dir)]


def launch_plan(config: TrainConfig) -> dict[str, Any]:
    """What a launch runs, for ``--dry-run``: each inference server's command line and
    environment, the trainer's command and ranks, and the DeepSpeed config."""
    import shlex

    run_dir = config.run_dir
    plan: dict[str, Any] = {"run_dir": str(run_dir), "inference": [], "trainer": {}}
    port = config.vllm.port
    for i in range(config.distributed.inference_servers):
        argv, env = server_command(config, run_dir, i, port + i)
        plan["inference"].append({"command": shlex.join(argv), "env": env})
    plan["trainer"] = {"command": shlex.join(trainer_command(run_dir)),
                       "ranks": config.distributed.trainer_ranks,
                       "backend": config.trainer.backend}
    if config.trainer.backend == "deepspeed":
        from tmax.train.backends.config import build_deepspeed_config, uses_bf16

        bf16 = uses_bf16(config.trainer, cuda=config.engine == "vllm")  # vLLM: GPU nodes
        plan["trainer"]["deepspeed_config"] = build_deepspeed_config(
            config.trainer, config.optim, bf16=bf16)
        plan["trainer"]["precision"] = "bf16" if bf16 else "fp32"
    return plan


def write_processes(run_dir: Path, trainers: TrainerRunner, servers: ServerRunner) -> None:
    """``RUN/processes.json``: the pid of every process this launcher runs now and the id
    of every Slurm job (for status, stop and tests), rewritten atomically. The launcher
    names itself for good (host, pid, ``launcher_start``: its start time, and
    ``launcher_job``: the Slurm job it runs in, if any), and ``start_times`` names each
    child pid, so ``tmax gc`` never mistakes a reused pid for one of this run's."""
    import socket

    from sandfleet import proc_start_time

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
    from sandfleet import run_event_loop
    from tmax.train.loop import (
        load_training_tasks,
        prepare_model,
        run_agent_config,
        seed_everything,
        write_plots,
    )

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
        from tmax.train.slurm import Slurm, SlurmInferenceServers, SlurmTrainer

        slurm = Slurm(config.slurm.command_timeout_s, config.slurm.poll_s)
        return (SlurmTrainer(config, run_dir, slurm),
                SlurmInferenceServers(config, run_dir, slurm))
    raise ValueError(f"unknown launcher {launcher!r}; valid: local, slurm")


async def _launch(config: TrainConfig, run_dir: Path, progress: bool,
                  trainers: TrainerRunner, servers: ServerRunner) -> None:
    from tmax.agent.policy import PolicyUnavailable
    from tmax.inference.base import EngineError
    from tmax.train.engines import EnginePool

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
        write_processes(run_dir, trainers, servers)
        await orchestrate(config, run_dir, pool, trainer_alive=trainer_alive,
                          progress=progress)
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


def main(argv: list[str] | None = None) -> None:
    """``python -m tmax.train.processes trainer RUN_DIR``: one trainer rank."""
    from tmax import log as tmax_log

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
