"""RL math as pure torch functions (CPU-testable): group advantages, DPPO loss, metrics."""

from tmax.rl.advantages import GroupAdvantages, filter_groups, group_advantages, infra_mask
from tmax.rl.loss import (
    binary_kl,
    binary_tv,
    dppo_loss,
    dppo_mask,
    entropy_from_logits,
    grpo_clip_loss,
    token_logprobs,
)
from tmax.rl.metrics import batch_metrics, logprob_gap, masked_mean

__all__ = [
    "GroupAdvantages",
    "batch_metrics",
    "binary_kl",
    "binary_tv",
    "dppo_loss",
    "dppo_mask",
    "entropy_from_logits",
    "filter_groups",
    "group_advantages",
    "grpo_clip_loss",
    "infra_mask",
    "logprob_gap",
    "masked_mean",
    "token_logprobs",
]
