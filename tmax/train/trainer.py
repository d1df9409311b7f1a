"""The policy-gradient trainer's math and its ``torch`` backend.

One step takes the step's usable groups (advantages already computed over each group's
valid rollouts), turns every valid trajectory into token sequences with
``(old_logp, loss_mask)`` from the inference engine (``samples_of``), and accumulates
gradients over micro-batches (``micro_batches``). The loss (``policy_loss``, over the pure
losses of ``tmax.rl``) is normalised by the number of response tokens of the WHOLE step
(token-level), so micro-batching does not change it; dropped rollouts contribute neither
tokens nor gradient. Then: gradient clipping, optimizer step, LR schedule.

Everything above is shared by the backends (``tmax.train.backends``): ``Trainer`` here is
the ``torch`` one (one process, plain AdamW); ``deepspeed`` runs the same functions under
ZeRO across ranks.

The LM head runs in float32 (``fp32_lm_head``): the last hidden states and the head's
weights are upcast before the projection, so log-probs near 0 or 1 keep their precision
(matters with bf16 weights; a no-op for the float32 tiny model). It computes the log-probs
and entropies chunk by chunk and recomputes them in the backward (``tmax.train.head``): no
[T, V] tensor is held whole. ``logits_of`` / ``sequence_logprobs`` are the plain
(materialising) path, kept as the reference the chunked one is tested against.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tmax.rl import dppo_loss, entropy_from_logits, grpo_clip_loss, logprob_gap, token_logprobs
from tmax.train.backends.base import write_weights_folder
from tmax.train.backends.config import AlgoSection, OptimSection
from tmax.train.head import (
    DEFAULT_CHUNK,
    enable_activation_checkpointing,
    install_scoring_head,
    score_tokens,
)


@dataclass
class Sample:
    """One token sequence for the loss."""

    tokens: list[int]
    old_logp: list[float]
    """Inference log-prob of each token (0 where mask is 0)."""
    mask: list[int]
    """1 on sampled (assistant) tokens."""
    advantage: float


def samples_of(groups: list[Any], max_len: int) -> list[Sample]:
    """Samples from kept groups: each valid trajectory's sequences with its advantage.

    ``groups``: objects with ``trajectories`` and ``advantages.advantages`` (None for
    dropped rollouts). Sequences longer than ``max_len`` are cut (their tail is lost).
    """
    out = []
    for group in groups:
        for traj, adv in zip(group.trajectories, group.advantages.advantages, strict=True):
            if adv is None:
                continue
            for tokens, logps, mask in traj.sequences():
                out.append(Sample(tokens[:max_len], logps[:max_len], mask[:max_len], adv))
    return out


def response_tokens(samples: list[Sample]) -> int:
    """The loss denominator's share of ``samples``: mask-1 tokens that have a prefix."""
    return sum(sum(s.mask[1:]) for s in samples)


def logits_of(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              *, fp32_head: bool) -> torch.Tensor:
    """Logits [B, T, V]; with ``fp32_head`` the head projection runs in float32."""
    if not fp32_head:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits
    hidden = model.get_decoder()(input_ids=input_ids,
                                 attention_mask=attention_mask).last_hidden_state  # [B,T,H]
    head = model.get_output_embeddings()
    bias = head.bias.float() if getattr(head, "bias", None) is not None else None
    return F.linear(hidden.float(), head.weight.float(), bias)                    # [B,T,V]


def logprobs_of_logits(logits: torch.Tensor, input_ids: torch.Tensor, *,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` [B, T-1] of tokens 1..T-1 from the logits [B, T, V]."""
    logits = logits[:, :-1] / temperature
    with torch.no_grad():  # a statistic only
        entropy = entropy_from_logits(logits.detach())
    return token_logprobs(logits, input_ids[:, 1:]), entropy


def sequence_logprobs(model, input_ids, attention_mask, *, temperature: float,
                      fp32_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` [B, T-1] of tokens 1..T-1 given their prefixes."""
    logits = logits_of(model, input_ids, attention_mask, fp32_head=fp32_head)
    return logprobs_of_logits(logits, input_ids, temperature=temperature)


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return f


# ---- batching and the loss, shared by the backends

def pad_batch(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Samples right-padded to the longest: ids, attention mask, old log-probs, loss mask
    [B, T] and advantages [B]."""
    width = max(len(s.tokens) for s in samples)

    def pad(rows, value, dtype):
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)
    return {
        "input_ids": pad([s.tokens for s in samples], pad_id, torch.long),          # [B,T]
        "attention_mask": pad([[1] * len(s.tokens) for s in samples], 0, torch.long),
        "old_logp": pad([s.old_logp for s in samples], 0.0, torch.float32),         # [B,T]
        "mask": pad([s.mask for s in samples], 0, torch.float32),                   # [B,T]
        "adv": torch.tensor([s.advantage for s in samples], dtype=torch.float32),   # [B]
    }


def filler_sample(pad_id: int) -> Sample:
    """A sequence that carries no loss (mask 0): a rank with fewer micro-batches than the
    others runs it, so every rank takes part in the same collectives."""
    return Sample([pad_id, pad_id], [0.0, 0.0], [0, 0], 0.0)


def micro_batches(samples: list[Sample], size: int, pad_id: int,
                  count: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Padded batches of ``size`` samples in order; with ``count``, filler batches (no
    loss) follow until there are ``count`` of them."""
    n = 0
    for i in range(0, len(samples), size):
        n += 1
        yield pad_batch(samples[i:i + size], pad_id)
    while count is not None and n < count:
        n += 1
        yield pad_batch([filler_sample(pad_id)], pad_id)


def n_micro_batches(samples: list[Sample], size: int) -> int:
    return -(-len(samples) // size)


def policy_loss(logp: torch.Tensor, entropy: torch.Tensor, batch: dict[str, torch.Tensor], *,
                algo: AlgoSection, n_tokens: float
                ) -> tuple[torch.Tensor, dict[str, float], float]:
    """``(loss, stats, response tokens)`` of one micro-batch from the trainer's log-probs
    and entropies [B, T-1] of tokens 1..T-1 (``score_tokens``); the loss is its share of
    the step's token-level loss (``n_tokens``: response tokens of the whole step)."""
    old, mask = batch["old_logp"][:, 1:], batch["mask"][:, 1:]       # [B,T-1]
    if algo.loss == "dppo":
        loss, stats = dppo_loss(logp, old, batch["adv"], mask, delta=algo.delta,
                                divergence=algo.divergence, ratio_cap=algo.ratio_cap,
                                n_tokens=n_tokens)
    else:
        loss, stats = grpo_clip_loss(logp, old, batch["adv"], mask, clip_eps=algo.clip_eps,
                                     n_tokens=n_tokens)
    with torch.no_grad():
        stats.update(logprob_gap(logp, old, mask))
        stats["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
    return loss, stats, float(mask.sum())


@dataclass
class StepSums:
    """What one step's micro-batches add up to (this process's share)."""

    loss: float = 0.0
    tokens: int = 0
    weighted: dict[str, float] = field(default_factory=dict)
    """Each stat times its micro-batch's response tokens."""

    def add(self, loss: torch.Tensor, stats: dict[str, float], n: float, tokens: int) -> None:
        self.loss += float(loss.detach())
        self.tokens += tokens
        for k, v in stats.items():
            self.weighted[k] = self.weighted.get(k, 0.0) + float(v) * n

    def metrics(self, n_tokens: float, sequences: int, **more: float) -> dict[str, float]:
        out = {k: v / max(n_tokens, 1.0) for k, v in self.weighted.items()}
        out.update(loss=self.loss, response_tokens=n_tokens, tokens=self.tokens,
                   sequences=sequences, **more)
        return out


class Trainer:
    """The ``torch`` backend: owns the training model, optimizer and schedule in this one
    process; ``step`` is one optimizer step."""

    rank, world_size = 0, 1

    def __init__(self, model: torch.nn.Module, *, algo: AlgoSection, optim: OptimSection,
                 total_steps: int, temperature: float, fp32_head: bool, pad_id: int,
                 max_len: int, head_chunk: int = DEFAULT_CHUNK,
                 activation_checkpointing: bool = False):
        install_scoring_head(model, fp32=fp32_head, chunk=head_chunk)
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        self.model, self.algo, self.optim_cfg = model, algo, optim
        self.temperature, self.fp32_head = temperature, fp32_head
        self.pad_id, self.max_len = pad_id, max_len
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(optim.schedule, optim.warmup_steps, total_steps))
        self.step_count = 0
        self._pending: tuple[StepSums, float, int, float] | None = None

    def _batch(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        return pad_batch(samples, self.pad_id)

    def loss(self, batch: dict[str, torch.Tensor], n_tokens: float):
        logp, entropy = score_tokens(self.model, batch["input_ids"], batch["attention_mask"],
                                     temperature=self.temperature)       # [B,T-1]
        return policy_loss(logp, entropy, batch, algo=self.algo, n_tokens=n_tokens)

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step over ``samples`` (gradient accumulation over micro-batches)."""
        self.forward_backward(samples)
        return self.optimizer_step()

    def forward_backward(self, samples: list[Sample]) -> None:
        """The step's gradients (accumulated over micro-batches), not yet applied."""
        if not samples:
            raise ValueError("a trainer step needs at least one sample")
        t0 = time.monotonic()
        self.model.train()
        n_tokens = float(response_tokens(samples))
        self.optimizer.zero_grad(set_to_none=True)
        sums = StepSums()
        for batch in micro_batches(samples, self.optim_cfg.micro_batch_size, self.pad_id):
            loss, stats, n = self.loss(batch, max(n_tokens, 1.0))
            loss.backward()
            sums.add(loss, stats, n, int(batch["attention_mask"].sum()))
        self._pending = (sums, n_tokens, len(samples), t0)

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step the optimizer and the schedule; the step's metrics."""
        if self._pending is None:
            raise RuntimeError("optimizer_step before forward_backward")
        sums, n_tokens, sequences, t0 = self._pending
        self._pending = None
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        return sums.metrics(n_tokens, sequences, grad_norm=float(norm),
                            lr=float(self.scheduler.get_last_lr()[0]),
                            train_seconds=time.monotonic() - t0)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradient of every parameter (between ``forward_backward`` and
        ``optimizer_step``), by parameter name."""
        return {name: p.grad.detach().clone() for name, p in self.model.named_parameters()
                if p.grad is not None}

    # ---- weights

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The full state dict (the engine's weight sync); the live tensors, not copies."""
        return self.model.state_dict()

    def export_to_path(self, root: Path, version: int) -> Path:
        """Weights ``version`` as a folder of HF safetensors under ``root`` (atomic)."""
        return write_weights_folder(self.model, None, Path(root), version)

    # ---- checkpoints

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> Path:
        """Write model, optimizer, schedule and RNG states to ``directory`` atomically."""
        tmp = directory.with_name(f".{directory.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "step": self.step_count,
                    "rng": rng_state(), "extra": extra or {}}, tmp / "trainer.pt")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
        return directory

    def load(self, directory: Path) -> dict[str, Any]:
        state = torch.load(directory / "trainer.pt", map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step"]
        set_rng_state(state["rng"])
        return state["extra"]


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
