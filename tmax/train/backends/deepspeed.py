"""The ``deepspeed`` trainer backend: the same step as the torch backend, under ZeRO.

Every rank builds the same model and calls every method (each runs collectives); each rank
passes its own share of the step's samples to ``step``. What differs from one process:

- **Global token-level loss.** Before the step the ranks all-reduce their response-token
  counts, so each rank's micro-batch loss is sum(its tokens' terms) / N_global. DeepSpeed
  averages gradients over the ranks; the loss handed to ``backward`` is multiplied by the
  world size to undo that, so the applied gradient is the single-process sum / N_global.
  Dropped rollouts are not samples, so they are in no rank's count.
- **Same collectives on every rank.** ZeRO-3 gathers parameters in every forward and
  reduces gradients in every backward, so all ranks run the same number of micro-batches:
  a rank with fewer (or no) samples runs filler batches that carry no loss.
- **Accumulation is ours** (``managed_gradient_accumulation: false``): any number of
  backwards, then one ``engine.step()`` (clipping, AdamW, the LR schedule).
- **FP32 LM head.** Under ZeRO-3 the head weight is a partition outside its module's
  forward, so the chunked float32 log-prob head (``tmax.train.head``) is installed as the
  head module's own forward: DeepSpeed gathers the weight around it, forward and backward.
- **Devices.** ``trainer.device`` (``resolve_device``): cuda with no GPU, or a local rank
  past the node's GPUs, stops the rank at start with a ``DeviceError``; only ``auto`` on a
  machine without GPUs trains on CPU with gloo.
- **Weights out.** ``export_weights`` gathers parameters (``GatheredParameters``, a chunk
  at a time) into full CPU tensors on rank 0.
- **Checkpoints**: DeepSpeed's own (``save_checkpoint``: each rank its partitions), plus the
  step, ``extra`` and each rank's RNG state, written into a temporary folder and renamed.

deepspeed is imported when a backend is built, never at module import. On CPU,
``DS_ACCELERATOR=cpu`` is set first and torch.distributed uses gloo. A process started
without ``RANK``/``WORLD_SIZE`` runs as a world of one on a free loopback port.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tmax.train.backends.base import weights_dir, write_weights_folder
from tmax.train.backends.config import (
    AlgoSection,
    OptimSection,
    TrainerSection,
    build_deepspeed_config,
    uses_bf16,
)
from tmax.train.head import (
    DEFAULT_CHUNK,
    enable_activation_checkpointing,
    install_scoring_head,
    score_tokens,
)
from tmax.train.trainer import (
    Sample,
    StepSums,
    lr_lambda,
    micro_batches,
    n_micro_batches,
    policy_loss,
    response_tokens,
    rng_state,
    set_rng_state,
)

DEEPSPEED_PIN = "deepspeed==0.19.8"
CHECKPOINT_TAG = "ds"
EXPORT_CHUNK_NUMEL = 1 << 27
"""Parameters gathered at once by ``export_weights`` (elements; 256 MiB of bf16)."""


class DeepSpeedUnavailable(ImportError):
    """trainer.backend=deepspeed, and deepspeed cannot be imported."""


def import_deepspeed() -> Any:
    """The deepspeed module (``DS_ACCELERATOR=cpu`` set first when there is no CUDA)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise DeepSpeedUnavailable(
            f"trainer.backend=deepspeed needs the deepspeed package ({e}); install it with "
            f"`pip install -e '.[deepspeed]'` (or `DS_BUILD_OPS=0 pip install "
            f"{DEEPSPEED_PIN}`), or set trainer.backend=torch") from e
    if not torch.cuda.is_available():
        # DeepSpeed's shared-memory all-reduce serves its inference engine only, and its
        # first use compiles a C++ op for minutes: leave it out (training uses gloo).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_dist_env() -> None:
    """A process started without a launcher becomes rank 0 of a world of one."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))


class DeviceError(RuntimeError):
    """The trainer was asked for a device this process cannot have."""


def resolve_device(trainer: TrainerSection, *, local_rank: int, cuda_available: bool,
                   device_count: int) -> tuple[str, str]:
    """``(device, dist_backend)`` of a rank (pure). ``trainer.device`` cuda (or
    ``dist_backend`` nccl) with no GPU, or a ``local_rank`` past the node's GPUs, is a
    ``DeviceError``: a GPU run must never fall back to CPU and gloo without a word."""
    want = trainer.device
    if want == "auto":
        want = "cuda" if cuda_available else "cpu"
    if trainer.dist_backend == "nccl" and want == "cpu":
        raise DeviceError("trainer.dist_backend=nccl needs CUDA, but "
                          + ("trainer.device=cpu" if trainer.device == "cpu" else
                             "torch sees no GPU here") + "; use gloo or a GPU node")
    if want == "cuda":
        if not cuda_available:
            raise DeviceError(
                "trainer.device=cuda, but torch sees no GPU on this node (is a GPU "
                "allocated? slurm.trainer.gpus_per_node; CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; a CUDA build of "
                f"torch? torch {torch.__version__})")
        if local_rank >= device_count:
            raise DeviceError(
                f"trainer rank with LOCAL_RANK={local_rank} has no GPU: this node shows "
                f"{device_count} (ranks per node must be <= GPUs per node: "
                "distributed.trainer_ranks / slurm.trainer_nodes vs "
                "slurm.trainer.gpus_per_node)")
    backend = trainer.dist_backend if trainer.dist_backend != "auto" else \
        ("nccl" if want == "cuda" else "gloo")
    return want, backend


def init_distributed(trainer: TrainerSection) -> str:
    """torch.distributed up for this rank (once), its GPU selected; returns the device
    kind (``cuda`` | ``cpu``). Raises ``DeviceError`` before any collective."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device, backend = resolve_device(trainer, local_rank=local_rank, cuda_available=cuda,
                                     device_count=torch.cuda.device_count() if cuda else 0)
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds = import_deepspeed()
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    ensure_dist_env()
    if not dist.is_initialized():
        ds.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return device


class DeepSpeedTrainer:
    """A ZeRO data-parallel trainer: the ``deepspeed`` backend."""

    def __init__(self, model: torch.nn.Module, *, algo: AlgoSection, optim: OptimSection,
                 trainer: TrainerSection, total_steps: int, temperature: float,
                 fp32_head: bool, pad_id: int, max_len: int, head_chunk: int = DEFAULT_CHUNK,
                 activation_checkpointing: bool = False):
        cuda = init_distributed(trainer) == "cuda"
        ds = self._ds = import_deepspeed()
        self.algo, self.optim_cfg, self.trainer_cfg = algo, optim, trainer
        self.temperature, self.fp32_head = temperature, fp32_head
        self.pad_id, self.max_len = pad_id, max_len
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.ds_config = build_deepspeed_config(trainer, optim,
                                                bf16=uses_bf16(trainer, cuda=cuda))
        install_scoring_head(model, fp32=fp32_head, chunk=head_chunk)
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        schedule = lr_lambda(optim.schedule, optim.warmup_steps, total_steps)
        self.engine, self.optimizer, _, self.scheduler = ds.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        self.model = self.engine.module
        self.step_count = 0
        self._pending: tuple[StepSums, float, int, float] | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    def _all_reduce(self, values: list[float], op: Any = None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM)
        return [float(v) for v in t.tolist()]

    # ---- the step

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step over this rank's ``samples`` (see the module docstring)."""
        self.forward_backward(samples)
        return self.optimizer_step()

    def forward_backward(self, samples: list[Sample]) -> None:
        """The step's gradients, reduced across ranks, not yet applied."""
        t0 = time.monotonic()
        self.engine.train()
        n_tokens, n_seq = self._all_reduce([float(response_tokens(samples)),
                                            float(len(samples))])
        if not n_seq:
            raise ValueError("a trainer step needs at least one sample (on some rank)")
        mb = self.optim_cfg.micro_batch_size
        count, = self._all_reduce([float(n_micro_batches(samples, mb))], dist.ReduceOp.MAX)
        real = n_micro_batches(samples, mb)
        sums = StepSums()
        for i, batch in enumerate(micro_batches(samples, mb, self.pad_id, int(count))):
            batch = {k: v.to(self.device) for k, v in batch.items()}
            logp, entropy = score_tokens(self.engine, batch["input_ids"],
                                         batch["attention_mask"],
                                         temperature=self.temperature)   # [B,T-1]
            loss, stats, n = policy_loss(logp, entropy, batch, algo=self.algo,
                                         n_tokens=max(n_tokens, 1.0))
            # DeepSpeed averages gradients over ranks: scale up so the sum is applied.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            if i < real:
                sums.add(loss, stats, n, int(batch["attention_mask"].sum()))
            else:
                sums.weighted.update({k: sums.weighted.get(k, 0.0) for k in stats})
        self._pending = (sums, n_tokens, int(n_seq), t0)

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step AdamW and the schedule (``engine.step``); the step's metrics, summed
        over ranks (the same on every rank)."""
        if self._pending is None:
            raise RuntimeError("optimizer_step before forward_backward")
        sums, n_tokens, sequences, t0 = self._pending
        self._pending = None
        self.engine.step()
        self.step_count += 1
        keys = sorted(sums.weighted)
        total = self._all_reduce([sums.loss, float(sums.tokens)]
                                 + [sums.weighted[k] for k in keys])
        sums = StepSums(loss=total[0], tokens=int(total[1]),
                        weighted=dict(zip(keys, total[2:], strict=True)))
        norm = self.engine.get_global_grad_norm()
        return sums.metrics(n_tokens, sequences,
                            grad_norm=float(norm) if norm is not None else float("nan"),
                            lr=self.scheduler.get_last_lr()[0],
                            train_seconds=time.monotonic() - t0)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The step's full gradient of every parameter (collective; between
        ``forward_backward`` and ``optimizer_step``), float32 on CPU, by name. ZeRO-3 only:
        stages 0-2 reduce gradients inside ``engine.step()``."""
        from deepspeed.utils import safe_get_full_grad

        if self.trainer_cfg.zero_stage != 3:
            raise NotImplementedError("full_gradients needs zero_stage 3 (stages 0-2 reduce "
                                      "the gradients inside the optimizer step)")

        out = {}
        for name, p in self.model.named_parameters():
            g = safe_get_full_grad(p)
            if g is not None:
                out[name] = g.detach().float().cpu().clone()
        return out

    # ---- weights

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict(keep_vars=True)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The full state dict as CPU tensors on rank 0 (``{}`` on other ranks); tied
        weights share one tensor, as in the model. Collective."""
        GatheredParameters = self._ds.zero.GatheredParameters
        state = self._state_tensors()
        params: dict[int, torch.Tensor] = {}
        order = list({id(t): t for t in state.values()}.values())
        chunk: list[torch.Tensor] = []
        size = 0

        def flush() -> None:
            nonlocal chunk, size
            if not chunk:
                return
            with GatheredParameters(chunk, modifier_rank=None):
                if self.rank == 0:
                    for t in chunk:
                        params[id(t)] = t.detach().cpu().clone()
            chunk, size = [], 0

        for t in order:
            if hasattr(t, "ds_id"):
                chunk.append(t)
                size += int(t.ds_numel)  # type: ignore[attr-defined]
                if size >= EXPORT_CHUNK_NUMEL:
                    flush()
            elif self.rank == 0:
                params[id(t)] = t.detach().cpu().clone()
        flush()
        if self.rank != 0:
            return {}
        return {key: params[id(t)] for key, t in state.items()}

    def export_to_path(self, root: Path, version: int) -> Path:
        """Weights ``version`` as ``<root>/v<version:08d>/`` (HF safetensors, written by
        rank 0, atomically); every rank returns once it is in place. Collective."""
        state = self.export_weights()
        if self.rank == 0:
            write_weights_folder(self.model, state, Path(root), version)
        dist.barrier()
        return weights_dir(Path(root), version)

    # ---- checkpoints

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> Path:
        """DeepSpeed checkpoint + step, ``extra`` and per-rank RNG into ``directory``
        (written as a temporary sibling, renamed by rank 0). The folder must be shared by
        all ranks. Collective."""
        directory = Path(directory)
        tmp = directory.with_name(f".{directory.name}.tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        self.engine.save_checkpoint(str(tmp), tag=CHECKPOINT_TAG,
                                    client_state={"tmax_step": self.step_count,
                                                  "tmax_extra": extra or {}})
        torch.save(rng_state(), tmp / f"rng-rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(tmp, directory)
        dist.barrier()
        return directory

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore a ``save``d checkpoint (same world size); returns its ``extra``."""
        directory = Path(directory)
        path, client = self.engine.load_checkpoint(
            str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True,
            load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"{directory}: no DeepSpeed checkpoint '{CHECKPOINT_TAG}'")
        rng = directory / f"rng-rank{self.rank}.pt"
        if not rng.is_file():
            raise FileNotFoundError(f"{rng} missing: the checkpoint was saved by fewer "
                                    f"ranks than {self.world_size}")
        set_rng_state(torch.load(rng, map_location="cpu", weights_only=False))
        self.step_count = int(client["tmax_step"])
        return dict(client.get("tmax_extra", {}))
