"""The trainer's model, loaded as the run asks: in ``model.dtype``, and with DeepSpeed
ZeRO-3 already partitioned while it loads.

A trainer rank that loads a 9B checkpoint whole, in float32, on CPU, before DeepSpeed
partitions it needs ~36 GB of host memory per rank (~288 GB for a node of 8). Under ZeRO-3
``load_trainer_model`` builds the model inside ``deepspeed.zero.Init`` (transformers'
own ZeRO-3 loading: each parameter is partitioned as it is created, rank 0 reads the
checkpoint and each module's weights are scattered as they load), in the dtype of the
DeepSpeed config, which must be ``model.dtype``. Other backends and stages load the
checkpoint in ``model.dtype`` directly.

It also reads what the trainer needs from a checkpoint's ``config.json``: Qwen3.5
checkpoints are ``Qwen3_5ForConditionalGeneration`` (text and vision), whose
``max_position_embeddings`` lives in ``text_config`` (``context_length``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tmax.train.config import TrainConfig


def context_length(config: Mapping[str, Any] | Any, source: str = "config.json") -> int:
    """``max_position_embeddings`` of a model config (a ``config.json`` mapping or a
    transformers config object): at the top level, else in ``text_config`` (multimodal
    checkpoints such as Qwen3.5's ``Qwen3_5ForConditionalGeneration``)."""
    doc = config if isinstance(config, Mapping) else config.to_dict()
    text = doc.get("text_config") or {}
    for where in (doc, text):
        value = where.get("max_position_embeddings")
        if value is not None:
            return int(value)
    raise ValueError(f"{source}: no max_position_embeddings at the top level or in "
                     "text_config; the trainer needs the model's context length")


def checkpoint_context_length(model_dir: str | os.PathLike) -> int:
    """``context_length`` of the checkpoint folder ``model_dir`` (its config.json)."""
    path = Path(model_dir) / "config.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the model config ({e})") from None
    return context_length(doc, str(path))


class _ZeRO3Loading:
    """What transformers asks of a DeepSpeed config while it loads (``is_zero3``,
    ``config``): its ``HfDeepSpeedConfig`` without the accelerate package."""

    def __init__(self, ds_config: dict[str, Any]):
        self.config = ds_config

    def is_zero3(self) -> bool:
        return True


@contextlib.contextmanager
def zero3_loading(ds_config: dict[str, Any]) -> Iterator[None]:
    """While open, ``from_pretrained`` builds the model under ``deepspeed.zero.Init``
    with ``ds_config`` and loads the checkpoint into the partitions."""
    from transformers.integrations import deepspeed as hf_ds

    keep = _ZeRO3Loading(ds_config)  # transformers holds a weak reference only
    hf_ds.set_hf_deepspeed_config(keep)
    try:
        yield
    finally:
        hf_ds.unset_hf_deepspeed_config()
        del keep


def load_trainer_model(config: TrainConfig, model_dir: str | os.PathLike) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``model_dir`` for this trainer rank (see the module
    docstring). Under ZeRO-3 torch.distributed is brought up first (every rank must call
    this). A ``model.dtype`` that is not the DeepSpeed precision is an error naming both."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, config.model.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    t = config.trainer
    if t.backend != "deepspeed":
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype), tokenizer
    from tmax.train.backends.config import build_deepspeed_config, uses_bf16
    from tmax.train.backends.deepspeed import init_distributed, resolve_device

    cuda = torch.cuda.is_available()
    device, _ = resolve_device(t, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                               cuda_available=cuda,
                               device_count=torch.cuda.device_count() if cuda else 0)
    bf16 = uses_bf16(t, cuda=device == "cuda")
    if bf16 != (dtype == torch.bfloat16):
        raise ValueError(
            f"model.dtype={config.model.dtype} but the DeepSpeed trainer trains in "
            f"{'bf16' if bf16 else 'fp32'} (trainer.precision={t.precision} on "
            f"{device}): set model.dtype={'bfloat16' if bf16 else 'float32'} or "
            f"trainer.precision={'bf16' if dtype == torch.bfloat16 else 'fp32'}")
    if t.zero_stage != 3:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype), tokenizer
    init_distributed(t)
    ds_config = build_deepspeed_config(t, config.optim, bf16=bf16)
    with zero3_loading(ds_config):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model, tokenizer
