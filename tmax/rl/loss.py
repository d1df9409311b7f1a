"""Token-level policy-gradient losses: DPPO (TMax) and the GRPO/PPO clipped baseline.

Notation, per token t of sequence b (tensors [B, T]):

    mu  = exp(old_logp)   probability of the sampled token under the inference engine
    pi  = exp(logp)       probability under the trainer (carries the gradient)
    r   = pi / mu = exp(logp - old_logp)
    A   = advantage of the sequence, broadcast over its tokens
    m   = loss_mask: 1 on sampled (assistant) tokens, 0 on prompt, tool observations,
          padding and dropped (infra-failed / filtered) rollouts

DPPO objective (token-level, no KL term):

    keep_t = not (D(mu, pi) > delta and ((A > 0 and r > 1) or (A < 0 and r < 1)))
    loss   = -sum_t m_t * keep_t * min(r_t, cap) * A_t / N

D is the binary total variation |mu - pi| (or the binary KL), keep is computed without
gradient, and N is the number of response tokens of the whole batch (sum of m, or
``n_tokens`` when the batch is split into gradient-accumulation micro-batches).

Deviations, all for safety: r is capped at ``ratio_cap`` (the cap is applied on the log-ratio,
so capped tokens contribute cap * A and no gradient); positions with m = 0 are zeroed
before exp, so padding values never reach the loss or its gradient.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Divergence = Literal["tv", "kl"]

KL_PROB_EPS = 1e-6
"""binary_kl clamps both probabilities to [KL_PROB_EPS, 1 - KL_PROB_EPS]."""


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """Advantages [B] or [B, T] -> [B, T] in the dtype of ``like``."""
    adv = advantages.to(like.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # [B] -> [B, 1]
    return adv.expand_as(like)  # [B, T]


def binary_tv(logp: Tensor, old_logp: Tensor) -> Tensor:
    """Binary total variation of the sampled token: |mu - pi| = |exp(old_logp) - exp(logp)|."""
    return (old_logp.exp() - logp.exp()).abs()  # [B, T]


def binary_kl(logp: Tensor, old_logp: Tensor) -> Tensor:
    """KL(Bernoulli(mu) || Bernoulli(pi)) = mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi)).

    mu = exp(old_logp), pi = exp(logp); both are clamped to [1e-6, 1 - 1e-6] so the logs
    stay finite when a probability is 0 or 1 (the value is then that of the clamped pair).
    """
    mu = old_logp.exp().clamp(KL_PROB_EPS, 1 - KL_PROB_EPS)  # [B, T]
    pi = logp.exp().clamp(KL_PROB_EPS, 1 - KL_PROB_EPS)  # [B, T]
    return mu * (mu.log() - pi.log()) + (1 - mu) * ((-mu).log1p() - (-pi).log1p())  # [B, T]


def dppo_mask(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    delta: float = 0.1,
    divergence: Divergence = "tv",
) -> Tensor:
    """Trust mask [B, T], True = token kept (no gradient flows through it).

    A token is masked (False) iff D(mu, pi) > delta and the update would push it further
    out: (A > 0 and r > 1) or (A < 0 and r < 1), with r = exp(logp - old_logp) and D the
    binary TV (``divergence="tv"``) or binary KL (``"kl"``).
    """
    with torch.no_grad():
        logp, old_logp = logp.detach(), old_logp.detach().to(logp.dtype)
        adv = _per_token(advantages.detach(), logp)  # [B, T]
        if divergence == "tv":
            div = binary_tv(logp, old_logp)
        elif divergence == "kl":
            div = binary_kl(logp, old_logp)
        else:
            raise ValueError(f"divergence must be 'tv' or 'kl', got {divergence!r}")
        log_ratio = logp - old_logp  # [B, T]; r > 1 <=> log_ratio > 0
        outward = ((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0))
        return ~((div > delta) & outward)  # [B, T] bool


def _prepare(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(response bool mask, sanitized log-ratio, advantages [B, T], float mask)."""
    if logp.shape != old_logp.shape or logp.shape != loss_mask.shape:
        raise ValueError(
            f"shapes differ: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, "
            f"loss_mask {tuple(loss_mask.shape)}"
        )
    resp = loss_mask.bool()  # [B, T]
    old = old_logp.detach().to(logp.dtype)
    # padding may hold anything: zero it so exp() and its gradient stay finite
    log_ratio = torch.where(resp, logp - old, torch.zeros_like(logp))  # [B, T]
    adv = _per_token(advantages.detach(), logp)  # [B, T]
    return resp, log_ratio, adv, resp.to(logp.dtype)


def _denominator(n_tokens: float | None, m: Tensor) -> Tensor:
    """N: ``n_tokens`` if given, else the response-token count (at least 1)."""
    if n_tokens is not None:
        if n_tokens <= 0:
            raise ValueError(f"n_tokens must be positive, got {n_tokens}")
        return torch.tensor(float(n_tokens), dtype=m.dtype, device=m.device)
    return m.sum().clamp_min(1.0)


def _ratio_stats(raw_ratio: Tensor, resp: Tensor) -> dict[str, float]:
    n = int(resp.sum())
    if n == 0:
        return {"ratio_mean": 0.0, "ratio_max": 0.0}
    r = raw_ratio[resp]  # [n]
    return {"ratio_mean": float(r.mean()), "ratio_max": float(r.max())}


def dppo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    delta: float = 0.1,
    divergence: Divergence = "tv",
    ratio_cap: float = 10.0,
    n_tokens: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """DPPO loss = -sum(m * keep * min(r, ratio_cap) * A) / N, and its stats.

    r = exp(logp - old_logp), capped by clamping the log-ratio at log(ratio_cap): a capped
    token contributes ratio_cap * A and zero gradient. keep = ``dppo_mask`` (no gradient).
    N = ``n_tokens`` when given (the response-token count of the whole batch across
    gradient-accumulation micro-batches), else sum(loss_mask); tokens with loss_mask 0
    (dropped rollouts, observations, padding) are never counted. dL/dlogp_t =
    -m_t * keep_t * r_t * A_t / N for an uncapped token.

    Stats over response tokens (0.0 when there are none): kept_fraction, masked_tokens,
    ratio_mean and ratio_max (uncapped r), capped_fraction (share with r > ratio_cap).
    """
    resp, log_ratio, adv, m = _prepare(logp, old_logp, advantages, loss_mask)
    keep = dppo_mask(logp, old_logp, advantages, delta=delta, divergence=divergence)  # [B, T]
    ratio = log_ratio.clamp(max=math.log(ratio_cap)).exp()  # [B, T], <= ratio_cap
    weight = m * keep.to(m.dtype)  # [B, T]
    loss = -(weight * ratio * adv).sum() / _denominator(n_tokens, m)  # []

    with torch.no_grad():
        n_resp = int(resp.sum())
        masked = int((resp & ~keep).sum())
        raw_ratio = log_ratio.detach().exp()  # [B, T]
        capped = int((resp & (raw_ratio > ratio_cap)).sum())
        stats = {
            "kept_fraction": (n_resp - masked) / n_resp if n_resp else 0.0,
            "masked_tokens": float(masked),
            **_ratio_stats(raw_ratio, resp),
            "capped_fraction": capped / n_resp if n_resp else 0.0,
        }
    return loss, stats


def grpo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    n_tokens: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO/GRPO clipped surrogate, token-level: -sum(m * min(r A, clip(r, 1-eps, 1+eps) A)) / N.

    r = exp(logp - old_logp) (uncapped), N as in ``dppo_loss``. Stats over response tokens:
    clip_fraction (share where the clipped term is the smaller one, i.e. no gradient),
    ratio_mean, ratio_max.
    """
    resp, log_ratio, adv, m = _prepare(logp, old_logp, advantages, loss_mask)
    ratio = log_ratio.exp()  # [B, T]
    unclipped = ratio * adv  # [B, T]
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv  # [B, T]
    surrogate = torch.minimum(unclipped, clipped)  # [B, T]
    loss = -(m * surrogate).sum() / _denominator(n_tokens, m)  # []

    with torch.no_grad():
        n_resp = int(resp.sum())
        n_clipped = int((resp & (clipped < unclipped)).sum())
        stats = {
            "clip_fraction": n_clipped / n_resp if n_resp else 0.0,
            **_ratio_stats(ratio.detach(), resp),
        }
    return loss, stats


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[tokens] in float32: logits [B, T, V], tokens [B, T] -> [B, T].

    logits[:, t] must predict tokens[:, t] (the caller does the shift).
    """
    logits = logits.float()  # [B, T, V]
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - logits.logsumexp(-1)  # [B, T]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) in float32: -sum_v p_v log p_v, [B, T, V] -> [B, T].

    Terms with p_v = 0 (e.g. logits of -inf) count as 0, not NaN.
    """
    logp = logits.float().log_softmax(-1)  # [B, T, V]
    p = logp.exp()  # [B, T, V]
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)  # [B, T]
