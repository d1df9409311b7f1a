"""One trainer rank of a multi-process run (``python -m tmax.train.processes trainer RUN``):
it takes step k's batch from the run folder, steps the backend, publishes weights version
k+1 (a versioned folder, or an NCCL broadcast to the servers, ``tmax.train.weight_sync``),
appends the step's metrics (rank 0) and checkpoints; on restart it resumes from its last
checkpoint, so no step is lost or repeated.

Preemption: a rank that gets SIGUSR2 (Slurm's ``--signal=USR2@90`` before the time limit)
finishes the step it is on, checkpoints, and exits with ``REQUEUE_EXIT``; under Slurm rank
0 first requeues its job (``scontrol requeue``), which resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from sandfleet import slurm
from tmax.rollout.trajectory import append_jsonl
from tmax.train.config import TrainConfig, load_train_config
from tmax.train.handover import Handover, Heartbeat, PeerGone, alive, mark_done

log = logging.getLogger(__name__)

ORCHESTRATOR = "orchestrator"


def trainer_role(rank: int) -> str:
    return f"trainer-{rank}"


def trainer_main(run_dir: Path) -> None:
    """One trainer rank, until ``config.steps`` are done (or the orchestrator is gone)."""
    from tmax.train.backends.choose import make_trainer
    from tmax.train.loop import (
        keep_metrics_until,
        latest_checkpoint,
        save_checkpoint,
        seed_everything,
    )
    from tmax.train.model_load import context_length, load_trainer_model
    from tmax.train.tracking import TrackingSection, open_trackers

    config = load_train_config(run_dir / "config.yaml")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    seed_everything(config.seed)
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    model, tokenizer = load_trainer_model(config, run_dir / "init")
    backend = make_trainer(config, model, pad_id=tokenizer.pad_token_id or 0,
                           max_len=context_length(model.config))
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
        sync = nccl_sender(config, run_dir, rank, handover)
        latest = handover.latest_weights()
        if sync is not None or latest is None or latest[0] != backend.step_count:
            publish(handover, backend, backend.step_count, sync)
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
            publish(handover, backend, backend.step_count, sync)
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
        if sync is not None:  # the broadcasts wrote no folder: the final one for final/
            publish(handover, backend, backend.step_count)
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
            try:
                slurm.SlurmClient(60).requeue(job)
            except (slurm.SlurmError, ValueError) as e:
                log.warning("requeue of job %s failed: %s", job, e)
    raise Requeue()


def nccl_sender(config: TrainConfig, run_dir: Path, rank: int,
                handover: Handover) -> Any:
    """The NCCL sender of an engine=vllm run with ``vllm.weight_transfer: nccl``, else
    None (weights go as folders)."""
    if config.engine != "vllm" or config.vllm.weight_transfer != "nccl":
        return None
    from tmax.train.weight_sync import NcclSender

    d = config.distributed
    return NcclSender(run_dir, rank=rank, timeout_s=d.weights_timeout_s,
                      orchestrator_alive=lambda: alive(handover, ORCHESTRATOR,
                                                       d.stale_after_s))


def publish(handover: Handover, backend: Any, version: int, sync: Any = None) -> None:
    """Weights ``version`` to the engines: broadcast by ``sync`` (NCCL), else as a folder
    (below)."""
    if sync is not None:
        sync.publish(backend, version)
        return
    _publish_folder(handover, backend, version)


def _publish_folder(handover: Handover, backend: Any, version: int) -> None:
    """Every rank exports (ZeRO-3 gathers collectively); rank 0 writes the folder, then
    LATEST names it."""
    path = backend.export_to_path(handover.weights, version)
    if backend.rank == 0:
        handover.set_latest(version, path)
