"""Training diagnostics: trainer/inference log-prob mismatch and batch filtering rates."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from tmax.rl.advantages import GroupAdvantages


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1); positions with mask 0 are ignored even if NaN."""
    m = mask.bool()
    total = torch.where(m, x, torch.zeros_like(x)).sum()  # []
    return total / m.sum().clamp_min(1).to(total.dtype)


def logprob_gap(logp: Tensor, old_logp: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """Trainer vs inference log-probs over response tokens (0.0 when there are none).

    logprob_abs_gap = mean |logp - old_logp|; logprob_abs_gap_max = max |logp - old_logp|;
    kl_k1 = mean (old_logp - logp), the k1 estimate of KL(mu || pi) on tokens sampled from mu.
    """
    with torch.no_grad():
        m = loss_mask.bool()
        diff = (old_logp.detach().float() - logp.detach().float())[m]  # [n]
        if diff.numel() == 0:
            return {"logprob_abs_gap": 0.0, "logprob_abs_gap_max": 0.0, "kl_k1": 0.0}
        return {
            "logprob_abs_gap": float(diff.abs().mean()),
            "logprob_abs_gap_max": float(diff.abs().max()),
            "kl_k1": float(diff.mean()),
        }


def batch_metrics(
    rewards: Sequence[float | None],
    valid: Sequence[bool],
    groups: Sequence[GroupAdvantages],
) -> dict[str, float]:
    """Rates of one batch of rollouts (flat lists) and its groups.

    infra_failure_rate = invalid rollouts / rollouts; filtered_group_rate = dropped groups /
    groups; filtered_too_few_valid and filtered_zero_std count dropped groups by reason;
    reward_mean = mean reward over valid rollouts (NaN when there are none).
    """
    if len(rewards) != len(valid):
        raise ValueError(f"rewards ({len(rewards)}) and valid ({len(valid)}) differ in length")
    n = len(valid)
    n_invalid = sum(1 for v in valid if not v)
    valid_rewards = [float(r) for r, v in zip(rewards, valid) if v and r is not None]
    n_groups = len(groups)
    n_dropped = sum(1 for g in groups if not g.kept)
    return {
        "rollouts": float(n),
        "infra_failure_rate": n_invalid / n if n else 0.0,
        "groups": float(n_groups),
        "filtered_group_rate": n_dropped / n_groups if n_groups else 0.0,
        "filtered_too_few_valid": float(sum(1 for g in groups if g.reason == "too_few_valid")),
        "filtered_zero_std": float(sum(1 for g in groups if g.reason == "zero_std")),
        "reward_mean": (
            math.fsum(valid_rewards) / len(valid_rewards) if valid_rewards else math.nan
        ),
    }
