"""How a trainer rank loads its model: the context length of Qwen3.5's multimodal
checkpoints (``text_config``), ``model.dtype`` honoured, and under DeepSpeed ZeRO-3 (for
real, on CPU with gloo, two spawned ranks) the checkpoint loaded into partitions built by
``zero.Init`` in bf16, never whole in float32 on each rank."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tmax.train.config import load_train_config
from tmax.train.model_load import checkpoint_context_length, context_length, load_trainer_model

# the shape of Qwen3.5-9B's config.json (Qwen3_5ForConditionalGeneration), abridged
QWEN35 = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "image_token_id": 248056, "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                    "intermediate_size": 128, "vocab_size": 248320,
                    "max_position_embeddings": 262144, "layer_types": [
                        "linear_attention", "full_attention"]},
    "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 32,
                      "num_heads": 2, "out_hidden_size": 64},
}


def test_the_context_length_of_a_qwen35_checkpoint_is_in_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN35))
    assert "max_position_embeddings" not in QWEN35
    assert checkpoint_context_length(tmp_path) == 262144
    assert context_length(QWEN35) == 262144
    assert context_length({"max_position_embeddings": 2048}) == 2048
    from transformers import AutoConfig

    assert context_length(AutoConfig.from_pretrained(tmp_path)) == 262144
    with pytest.raises(ValueError, match="no max_position_embeddings.*text_config"):
        context_length({"text_config": {}}, "x/config.json")


def tiny_checkpoint(path: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False)).to(dtype)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(64)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")),
                            pad_token="t0").save_pretrained(path)
    return path


def test_the_torch_backend_loads_in_model_dtype(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "m")
    for dtype in ("bfloat16", "float32"):
        config = load_train_config(None, [f"model.dtype={dtype}"])
        model, _ = load_trainer_model(config, ckpt)
        assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}


def test_a_dtype_the_deepspeed_precision_does_not_train_is_an_error(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "m")
    config = load_train_config(None, ["trainer.backend=deepspeed", "trainer.device=cpu",
                                      "trainer.precision=fp32", "model.dtype=bfloat16"])
    with pytest.raises(ValueError, match="model.dtype=bfloat16.*trainer.precision"):
        load_trainer_model(config, ckpt)


# ---- ZeRO-3 loading, two spawned ranks on CPU


def _rank(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from tmax.train.backends.choose import make_trainer
    from tmax.train.trainer import Sample

    config = load_train_config(None, [
        "trainer.backend=deepspeed", "trainer.device=cpu", "trainer.precision=bf16",
        "model.dtype=bfloat16", f"distributed.trainer_ranks={world}",
        "trainer.param_persistence_threshold=0", "optim.lr=1e-2"])
    model, _tokenizer = load_trainer_model(config, ckpt)
    seen = {name: {"dtype": p.dtype, "partitioned": hasattr(p, "ds_id"),
                   "local": int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else -1,
                   "full": int(getattr(p, "ds_numel", p.numel()))}
            for name, p in model.named_parameters()}
    backend = make_trainer(config, model, pad_id=0, max_len=128)
    loaded = backend.export_weights()  # gathered, rank 0
    metrics = backend.step([Sample([1, 2, 3, 4, 5, 6], [0, 0, -1.0, -2.0, -1.5, -0.5],
                                   [0, 0, 1, 1, 1, 1], 0.5 if rank else -0.5)])
    torch.save({"seen": seen, "loaded": loaded, "loss": metrics["loss"]},
               Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (the dev extra installs it)")
def test_zero3_loads_bf16_partitions_under_zero_init(tmp_path):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from tmax.train.backends.deepspeed import free_port

    ckpt = tiny_checkpoint(tmp_path / "m")
    world = 2
    ctx = mp.start_processes(_rank, args=(world, free_port(), str(ckpt), str(tmp_path)),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 300
    try:
        while not ctx.join(timeout=2):
            assert time.monotonic() < deadline, "the ranks did not finish in 300 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    runs: list[dict[str, Any]] = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
                                  for r in range(world)]
    for run in runs:
        for name, s in run["seen"].items():
            # built by zero.Init: a partition of each parameter, in bf16, on each rank
            assert s["partitioned"], name
            assert s["dtype"] == torch.bfloat16, name
            assert s["local"] == -(-s["full"] // world), (name, s)
    # and the partitions hold the checkpoint's values, exactly
    reference = load_file(str(ckpt / "model.safetensors"))
    loaded = runs[0]["loaded"]
    assert set(reference) <= set(loaded)
    for name, t in reference.items():
        assert torch.equal(loaded[name], t), name
    assert all(r["loss"] == runs[0]["loss"] for r in runs)
