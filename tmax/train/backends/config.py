"""The sections of a training config a trainer backend reads (``trainer:``, ``algo:``,
``optim:``), and the DeepSpeed JSON config built from them.

``build_deepspeed_config`` is a pure function: the exact dict handed to
``deepspeed.initialize`` (and printed by a dry run), from this section and ``optim:``.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ADAM_EPS = 1e-8
"""AdamW epsilon of both backends (torch.optim.AdamW's default)."""


class AlgoSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loss: Literal["dppo", "grpo_clip"] = Field("dppo")
    delta: float = Field(0.1, gt=0, description="DPPO divergence threshold.")
    divergence: Literal["tv", "kl"] = Field("tv", description="binary TV or binary KL.")
    ratio_cap: float = Field(10.0, gt=1, description="Cap on pi/mu.")
    clip_eps: float = Field(0.2, gt=0, description="grpo_clip only.")
    normalize_std: bool = Field(False, description="Divide advantages by the group std.")


class OptimSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-6, gt=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward; "
                                  "gradients accumulate over the step's batch.")


class TrainerSection(BaseModel):
    """Which trainer backend runs the optimizer steps, and how."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["torch", "deepspeed"] = Field(
        "torch", description="torch: one process, plain AdamW (the embedded default). "
        "deepspeed: ZeRO data parallel over the ranks of torch.distributed (needs the "
        "`deepspeed` extra).")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        3, description="deepspeed only: ZeRO stage (3 partitions parameters, gradients and "
        "optimizer states across ranks).")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="deepspeed only: parameter/activation dtype; auto = bf16 on "
        "GPU, fp32 on CPU. The LM head still runs in float32 with model.fp32_lm_head.")
    dist_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="deepspeed only: torch.distributed backend; auto = nccl on "
        "GPU, gloo on CPU.")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="deepspeed only: where the ranks train. cuda: each rank on GPU "
        "LOCAL_RANK, and a missing GPU (or more ranks on a node than it has GPUs) stops the "
        "trainer at start with an error, never a silent CPU/gloo fallback; auto: cuda when "
        "torch sees a GPU, else cpu (gloo).")
    activation_checkpointing: bool = Field(
        False, description="Recompute each transformer layer's activations in the "
        "backward (less memory for long sequences, ~1/3 more compute).")
    head_chunk: int = Field(
        1024, ge=1, description="Positions whose full-vocabulary logits the LM head holds "
        "at once (log-probs and entropy are computed, and recomputed in the backward, "
        "chunk by chunk): at a 248k vocabulary, 1024 is 1 GiB of float32.")
    param_persistence_threshold: int = Field(
        100_000, ge=0, description="deepspeed ZeRO-3: parameters with fewer elements stay "
        "whole on every rank (stage3_param_persistence_threshold); 0 partitions all.")
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="deepspeed only: overrides deep-merged into the "
        "built DeepSpeed config (a mapping merges key by key, any other value replaces).")


def uses_bf16(trainer: TrainerSection, *, cuda: bool) -> bool:
    """``trainer.precision`` resolved: auto is bf16 on GPU (``cuda``), fp32 on CPU."""
    return trainer.precision == "bf16" or (trainer.precision == "auto" and cuda)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` merged in (new dict; nested mappings merge key by key)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_deepspeed_config(trainer: TrainerSection, optim: OptimSection, *,
                           bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config of a run (pure: same inputs, same dict).

    One optimizer step per ``engine.step()`` with caller-managed gradient accumulation
    (``managed_gradient_accumulation: false``): the trainer runs as many micro-batches as
    the step's batch needs, DeepSpeed reduces each backward and steps once. AdamW is
    torch's (``torch_adam``: the same update as the torch backend, no compiled ops); the
    LR schedule is the trainer's LambdaLR, handed to ``deepspeed.initialize``.
    """
    zero: dict[str, Any] = {"stage": trainer.zero_stage}
    if trainer.zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=trainer.param_persistence_threshold,
                    stage3_gather_16bit_weights_on_model_save=False)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": optim.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": optim.grad_clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": optim.lr, "betas": list(optim.betas), "eps": ADAM_EPS,
            "weight_decay": optim.weight_decay, "torch_adam": True}},
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return deep_merge(config, trainer.deepspeed)
