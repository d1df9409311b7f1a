"""The trainer's LM head: token log-probs and entropy computed chunk by chunk, in float32.

A training forward needs, for each position t, only two numbers of the next-token
distribution: log pi(x_{t+1}) (the loss) and its entropy (a statistic). Materialising the
logits for that is the trainer's largest cost: at Qwen3.5's vocabulary (V = 248,320) one
float32 [T, V] tensor of a 65,536-token sequence is 65 GB, and the plain path holds about
five of them (logits, their temperature-scaled copy, log_softmax, its gradient, the
entropy pass).

``chunked_token_logprobs`` never holds more than ``chunk`` rows of logits: its forward
computes, per chunk of positions, logits = h W^T (+ b) in float32 (hidden states and
weight upcast, as vLLM's ``head_dtype: float32``), divides by the temperature, and keeps
only logsumexp, the picked log-prob and the entropy ([T] each); its backward recomputes
each chunk's logits and applies

    d logp_t / d z_t = (onehot(x_{t+1}) - softmax(z_t)) / temperature

so the saved state is the hidden states, the weight and [T] log-sum-exps. The entropy
carries no gradient (it is reported, never optimised).

``install_scoring_head`` makes the model's head module (the one ZeRO-3 gathers around its
own forward) do this when a ``scoring`` context is open: the module then returns
``[B, T-1, 2]`` float32 (log-prob of token t+1, entropy at t) in place of the logits, so
the model's own forward (``model(...).logits``) yields it and DeepSpeed's gather hooks
run around the head as for any forward and backward. Outside ``scoring`` it returns
float32 logits (``fp32``) or the plain projection.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_CHUNK = 1024
"""Positions per chunk: at V = 248,320 a float32 chunk of logits is 1 GiB."""


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, inv_temp: float,
                  fp32: bool) -> Tensor:
    """[c, V] logits / temperature of hidden rows ``h`` [c, H], in float32 (float64
    inputs stay float64)."""
    acc = torch.promote_types(h.dtype, torch.float32)
    if fp32:
        z = F.linear(h.to(acc), weight.to(acc), None if bias is None else bias.to(acc))
    else:
        z = F.linear(h, weight, bias).to(acc)
    return z * inv_temp if inv_temp != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    """(logp [N], entropy [N]) of ``targets`` under softmax(h W^T / temperature)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                targets: Tensor, inv_temp: float, chunk: int, fp32: bool
                ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(n, dtype=acc, device=hidden.device)               # [N]
        entropy = torch.empty_like(logp)                                     # [N]
        lse = torch.empty_like(logp)                                         # [N]
        for i in range(0, n, chunk):
            z = _chunk_logits(hidden[i:i + chunk], weight, bias, inv_temp, fp32)  # [c,V]
            lse_c = z.logsumexp(-1)                                          # [c]
            lse[i:i + chunk] = lse_c
            logp[i:i + chunk] = z.gather(-1, targets[i:i + chunk, None]).squeeze(-1) - lse_c
            pz = (z - lse_c[:, None]).exp_().mul_(z)                         # [c,V] p*z
            del z
            # H = -sum p log p = lse - sum p z; a p of 0 (z = -inf: nan here) adds nothing
            entropy[i:i + chunk] = lse_c - pz.nan_to_num_(nan=0.0).sum(-1)
            del pz
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.inv_temp, ctx.chunk, ctx.fp32 = inv_temp, chunk, fp32
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, grad_entropy: Tensor | None
                 ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        inv_temp, chunk, fp32 = ctx.inv_temp, ctx.chunk, ctx.fp32
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
            if want_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) \
            if want_b and bias is not None else None
        w32 = weight.to(acc)                                                 # [V,H]
        for i in range(0, hidden.shape[0], chunk):
            h = hidden[i:i + chunk]                                          # [c,H]
            g = grad_logp[i:i + chunk].to(acc)                               # [c]
            z = _chunk_logits(h, weight, bias, inv_temp, fp32)               # [c,V]
            # dL/dz = g * (onehot - softmax(z)), then through the 1/temperature scale
            dz = (z - lse[i:i + chunk, None]).exp_().mul_(-g[:, None])       # [c,V]
            dz.scatter_add_(-1, targets[i:i + chunk, None], g[:, None])
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            del z
            if grad_h is not None:
                grad_h[i:i + chunk] = (dz @ w32).to(hidden.dtype)          # [c,H]
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h.to(acc))                             # [V,H]
            if grad_b is not None:
                grad_b += dz.sum(0)
            del dz
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                           targets: Tensor, *, temperature: float = 1.0,
                           chunk: int = DEFAULT_CHUNK, fp32: bool = True
                           ) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` [..., ] float32 of ``targets`` [...] given ``hidden`` [..., H]
    and the head (``weight`` [V, H], ``bias`` [V] or None): log softmax(h W^T + b) /
    temperature at the target, and the distribution's entropy (no gradient). At most
    ``chunk`` rows of [.., V] logits exist at once, forward and backward."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    lead = targets.shape
    if hidden.shape[:-1] != lead:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(lead)} differ")
    flat_h = hidden.reshape(-1, hidden.shape[-1])                            # [N,H]
    logp, entropy = _ChunkedLogprobs.apply(flat_h, weight, bias,
                                           targets.reshape(-1).long(), 1.0 / temperature,
                                           int(chunk), fp32)
    return logp.view(lead), entropy.view(lead)


# --------------------------------------------------------------------------- the head module


_ACTIVE = threading.local()
"""Per thread: id(head) -> (targets, temperature) of each open ``scoring`` context. Per
thread because an inference engine sharing the model (the in-process engine of a
one-process run) generates from another thread and must keep getting logits; by id so a
copy of the model (``copy.deepcopy``) is never scoring."""


def _open(head: Any) -> dict[int, tuple[Tensor, float]]:
    if not hasattr(_ACTIVE, "heads"):
        _ACTIVE.heads = {}
    return _ACTIVE.heads


def _head_forward(self: Any, hidden: Tensor) -> Tensor:
    """The installed forward of the LM head module (bound to it: a deep copy of the model
    gets one bound to its own copy)."""
    fp32, chunk = self._tmax_head
    bias = getattr(self, "bias", None)
    scoring_as = _open(self).get(id(self))
    if scoring_as is None:
        if fp32:
            return F.linear(hidden.float(), self.weight.float(),
                            None if bias is None else bias.float())           # [B,T,V]
        return F.linear(hidden, self.weight, bias)
    targets, temperature = scoring_as                                         # [B,T-1]
    logp, entropy = chunked_token_logprobs(
        hidden[:, :targets.shape[1]], self.weight, bias, targets,
        temperature=temperature, chunk=chunk, fp32=fp32)                      # [B,T-1]
    return torch.stack([logp, entropy], dim=-1)                               # [B,T-1,2]


def install_scoring_head(model: torch.nn.Module, *, fp32: bool = True,
                         chunk: int = DEFAULT_CHUNK) -> torch.nn.Module:
    """Make the forward of ``model``'s output-embedding module the scoring head (see the
    module docstring); returns the head. Calling it again re-installs."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__}: no output embeddings (an LM head with a "
                         "weight) to compute log-probs with")
    head._tmax_head = (fp32, int(chunk))
    head.forward = types.MethodType(_head_forward, head)
    return head


@contextlib.contextmanager
def scoring(model: torch.nn.Module, targets: Tensor, temperature: float) -> Iterator[None]:
    """While open (in this thread), ``model(...).logits`` is ``[B, T-1, 2]`` (log-prob of
    ``targets`` [B, T-1] = input_ids[:, 1:], entropy) from the installed scoring head."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if not hasattr(head, "_tmax_head"):
        raise RuntimeError("scoring: call install_scoring_head(model) first")
    heads = _open(head)
    heads[id(head)] = (targets, temperature)
    try:
        yield
    finally:
        heads.pop(id(head), None)


def score_tokens(model: Any, input_ids: Tensor, attention_mask: Tensor, *,
                 temperature: float) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` [B, T-1] of tokens 1..T-1 given their prefixes, through the
    model's own forward (``model`` may be a DeepSpeed engine) and its scoring head."""
    module = getattr(model, "module", model)
    with scoring(module, input_ids[:, 1:], temperature):
        out = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B,T-1,2]
    return out[..., 0], out[..., 1]


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each transformer layer's activations in the backward (transformers'
    gradient checkpointing, non-reentrant: it works under ZeRO-3's hooks and needs no
    input that requires grad)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing "
                         "(set trainer.activation_checkpointing: false)")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
