"""The policy-gradient trainer: a Hugging Face causal LM, its optimizer and one DPPO step.

One step (``Trainer.step``) takes the step's usable groups (advantages already computed
over each group's valid rollouts), turns every valid trajectory into token sequences with
``(old_logp, loss_mask)`` from the inference engine, and accumulates gradients over
micro-batches. The loss is normalised by the number of response tokens of the WHOLE step
(token-level), so micro-batching does not change it; dropped rollouts contribute neither
tokens nor gradient. Then: gradient clipping, optimizer step, LR schedule.

The LM head runs in float32 (``fp32_lm_head``): the last hidden states and the head's
weights are upcast before the projection, so log-probs near 0 or 1 keep their precision
(matters with bf16 weights; a no-op for the float32 tiny model).
"""

from __future__ import annotations

import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tmax.rl import dppo_loss, entropy_from_logits, grpo_clip_loss, logprob_gap, token_logprobs
from tmax.train.config import AlgoSection, OptimSection


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


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              *, fp32_head: bool) -> torch.Tensor:
    """Logits [B, T, V]; with ``fp32_head`` the head projection runs in float32."""
    if not fp32_head:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits
    hidden = model.get_decoder()(input_ids=input_ids,
                                 attention_mask=attention_mask).last_hidden_state  # [B,T,H]
    head = model.get_output_embeddings()
    bias = head.bias.float() if getattr(head, "bias", None) is not None else None
    return F.linear(hidden.float(), head.weight.float(), bias)                    # [B,T,V]


def sequence_logprobs(model, input_ids, attention_mask, *, temperature: float,
                      fp32_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` [B, T-1] of tokens 1..T-1 given their prefixes."""
    logits = logits_of(model, input_ids, attention_mask, fp32_head=fp32_head)[:, :-1]
    logits = logits / temperature
    with torch.no_grad():  # a statistic only
        entropy = entropy_from_logits(logits.detach())
    return token_logprobs(logits, input_ids[:, 1:]), entropy


def lr_lambda(schedule: str, warmup: int, total: int):
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


class Trainer:
    """Owns the training model, optimizer and schedule; ``step`` is one optimizer step."""

    def __init__(self, model: torch.nn.Module, *, algo: AlgoSection, optim: OptimSection,
                 total_steps: int, temperature: float, fp32_head: bool, pad_id: int,
                 max_len: int):
        self.model, self.algo, self.optim_cfg = model, algo, optim
        self.temperature, self.fp32_head = temperature, fp32_head
        self.pad_id, self.max_len = pad_id, max_len
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(optim.schedule, optim.warmup_steps, total_steps))
        self.step_count = 0

    def _batch(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        width = max(len(s.tokens) for s in samples)
        def pad(rows, value, dtype):
            return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)
        return {
            "input_ids": pad([s.tokens for s in samples], self.pad_id, torch.long),    # [B,T]
            "attention_mask": pad([[1] * len(s.tokens) for s in samples], 0, torch.long),
            "old_logp": pad([s.old_logp for s in samples], 0.0, torch.float32),         # [B,T]
            "mask": pad([s.mask for s in samples], 0, torch.float32),                   # [B,T]
            "adv": torch.tensor([s.advantage for s in samples], dtype=torch.float32),   # [B]
        }

    def loss(self, batch: dict[str, torch.Tensor], n_tokens: float):
        logp, entropy = sequence_logprobs(self.model, batch["input_ids"],
                                          batch["attention_mask"],
                                          temperature=self.temperature,
                                          fp32_head=self.fp32_head)      # [B,T-1]
        old, mask = batch["old_logp"][:, 1:], batch["mask"][:, 1:]       # [B,T-1]
        a = self.algo
        if a.loss == "dppo":
            loss, stats = dppo_loss(logp, old, batch["adv"], mask, delta=a.delta,
                                    divergence=a.divergence, ratio_cap=a.ratio_cap,
                                    n_tokens=n_tokens)
        else:
            loss, stats = grpo_clip_loss(logp, old, batch["adv"], mask, clip_eps=a.clip_eps,
                                         n_tokens=n_tokens)
        with torch.no_grad():
            stats.update(logprob_gap(logp, old, mask))
            stats["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
        return loss, stats, float(mask.sum())

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step over ``samples`` (gradient accumulation over micro-batches)."""
        if not samples:
            raise ValueError("a trainer step needs at least one sample")
        t0 = time.monotonic()
        self.model.train()
        n_tokens = float(sum(sum(s.mask[1:]) for s in samples))
        self.optimizer.zero_grad(set_to_none=True)
        total, weighted, tokens = 0.0, {}, 0
        mb = self.optim_cfg.micro_batch_size
        for i in range(0, len(samples), mb):
            batch = self._batch(samples[i:i + mb])
            loss, stats, n = self.loss(batch, max(n_tokens, 1.0))
            loss.backward()
            total += float(loss.detach())
            tokens += int(batch["attention_mask"].sum())
            for k, v in stats.items():
                weighted[k] = weighted.get(k, 0.0) + float(v) * n
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        metrics = {k: v / max(n_tokens, 1.0) for k, v in weighted.items()}
        metrics.update(loss=total, grad_norm=float(norm), response_tokens=n_tokens,
                       tokens=tokens, sequences=len(samples),
                       lr=self.scheduler.get_last_lr()[0],
                       train_seconds=time.monotonic() - t0)
        return metrics

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
