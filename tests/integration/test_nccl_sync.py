"""The NCCL weight sync (vllm.weight_transfer: nccl) built to vLLM's own contract.

- The payloads are validated by the installed vLLM's own classes
  (``NCCLWeightTransferInitInfo``, ``NCCLWeightTransferUpdateInfo``, the trainer side's
  ``NCCLTrainerInitInfo``), run in the vLLM venv that bin/tmax-setup-vllm makes.
- The names are the checkpoint's: a Qwen3.5 checkpoint (``Qwen3_5ForConditionalGeneration``)
  loaded as the text-only model the trainer trains is sent as ``model.language_model.*``.
- The trainer (``NcclSender``, real) and the orchestrator (``NcclCoordinator``, real, over
  HTTP to servers that answer vLLM's dev routes) meet in the run folder: one group over
  every server (rank offsets after the trainer's rank 0), one broadcast per version to all
  of them, no folder path posted, and a new group when a server is replaced. Only NCCL
  itself (a GPU collective) is replaced here, by a recorder of what rank 0 would send.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.unit.test_inference import Recorder
from tmax.inference.http import HttpEngine
from tmax.inference.nccl import nccl_group, nccl_init_info, nccl_update_info
from tmax.inference.process import free_port
from tmax.train import weight_sync
from tmax.train.engines import EnginePool
from tmax.train.nccl_pool import NcclCoordinator
from tmax.train.weight_sync import NcclSender, checkpoint_layout, checkpoint_tensors

VLLM_PYTHON = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
    "tmax" / "vllm-venv" / "bin" / "python"

QWEN35 = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                    "intermediate_size": 128, "vocab_size": 300,
                    "max_position_embeddings": 4096,
                    "layer_types": ["linear_attention", "full_attention"],
                    "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 32,
                      "num_heads": 2, "out_hidden_size": 64, "intermediate_size": 64},
}


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny random Qwen3.5 checkpoint (the multimodal class, as published), loaded as
    the trainer loads it (AutoModelForCausalLM: the text model); and its tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path = tmp_path_factory.mktemp("qwen35")
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config.from_dict(QWEN35)).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    return model, load_file(str(path / "model.safetensors"))


def test_the_trainer_sends_the_checkpoints_names(qwen35):
    model, checkpoint = qwen35
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert any(n.startswith("model.layers.") for n, _ in model.named_parameters())
    text = {k: v for k, v in checkpoint.items() if "visual" not in k}
    layout = checkpoint_layout(model)
    assert sorted(n for n, _, _ in layout) == sorted(text)
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n, _, _ in layout)
    sent = list(checkpoint_tensors(model))
    assert [n for n, _ in sent] == [n for n, _, _ in layout]  # update_info's order
    for (name, tensor), (_, dtype, shape) in zip(sent, layout, strict=True):
        assert torch.equal(tensor, text[name]), name
        assert (tensor.dtype, tuple(tensor.shape)) == (dtype, shape)


# ---- the trainer and the orchestrator, over the run folder and HTTP


class WireRecorder:
    """What vLLM's NCCL functions would have done on rank 0: the group it opened and each
    (name, tensor) it broadcast, in order."""

    def __init__(self) -> None:
        self.groups: list[tuple[str, int, int, int]] = []
        self.sent: list[list[tuple[str, torch.Tensor]]] = []

    def functions(self) -> tuple[Any, Any]:
        def init_group(host: str, port: int, rank: int, world: int, device: int) -> Any:
            self.groups.append((host, port, rank, world))
            return ("group", len(self.groups))

        def producer(*, iterator, group, src, post_iter_func, buffer_size_bytes,
                     num_buffers) -> None:
            assert src == 0 and group == ("group", len(self.groups))
            self.sent.append([(name, post_iter_func((name, t))) for name, t in iterator])
        return init_group, producer


async def start_servers(n: int) -> tuple[list[Recorder], list[HttpEngine], list[Any]]:
    from aiohttp import web

    recorders, engines, runners = [], [], []
    for i in range(n):
        recorder = Recorder()
        recorder.released = asyncio.Event()
        runner = web.AppRunner(recorder.app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        recorders.append(recorder)
        engines.append(HttpEngine(f"http://127.0.0.1:{port}/v1", "m", name=f"server-{i}",
                                  max_retries=0))
        runners.append(runner)
    return recorders, engines, runners


@pytest.mark.slow  # the vLLM venv's python imports vLLM (~40 s)
def test_one_broadcast_reaches_every_server_and_a_replacement_rebuilds_the_group(
        qwen35, tmp_path, monkeypatch):
    model, _ = qwen35
    wire = WireRecorder()
    monkeypatch.setattr(weight_sync, "_vllm_nccl", wire.functions)
    backend = SimpleNamespace(model=model, rank=0)
    sender = NcclSender(tmp_path, rank=0, timeout_s=60, orchestrator_alive=lambda: True,
                        host="127.0.0.1")
    coordinator = NcclCoordinator(tmp_path, gpus_per_server=2, timeout_s=60,
                                  trainer_alive=lambda: True)

    async def until_served(pool: EnginePool, version: int, engine: Any = None) -> None:
        while pool.target != version or (engine is not None and engine not in pool.live):
            await coordinator.follow(pool)
            await asyncio.sleep(0.05)

    async def go() -> tuple[list[Recorder], dict[str, Any]]:
        recorders, engines, runners = await start_servers(3)
        try:
            pool = EnginePool(engines[:2])
            first, _ = await asyncio.gather(coordinator.start(pool),
                                            asyncio.to_thread(sender.publish, backend, 0))
            await asyncio.gather(asyncio.to_thread(sender.publish, backend, 1),
                                 until_served(pool, 1))
            versions = [e.version for e in pool.live]
            pool._lose(engines[1], "killed by the test")
            await asyncio.gather(coordinator.replace(pool, engines[2]),
                                 asyncio.to_thread(sender.publish, backend, 2),
                                 until_served(pool, 2, engines[2]))
            live, served = [e.name for e in pool.live], [e.version for e in pool.live]
            # the trainer restarts (from its checkpoint at step 1): a group for the new one
            restarted = NcclSender(tmp_path, rank=0, timeout_s=60,
                                   orchestrator_alive=lambda: True, host="127.0.0.1")
            await asyncio.gather(asyncio.to_thread(restarted.publish, backend, 1),
                                 until_served(pool, 1))
            return recorders, {"first": first, "versions": versions, "live": live,
                               "served": served, "after_restart": [e.version
                                                                   for e in pool.live]}
        finally:
            for e in engines:
                await e.aclose()
            for r in runners:
                await r.cleanup()

    recorders, seen = asyncio.run(go())
    assert seen["first"] == 0 and seen["versions"] == [1, 1]
    assert seen["live"] == ["server-0", "server-2"] and seen["served"] == [2, 2]
    assert seen["after_restart"] == [1, 1]
    # three groups of 1 trainer rank + 2 servers x 2 GPUs: the first, one after the
    # replacement, one for the restarted trainer
    (h1, p1, r1, w1), (h2, p2, r2, w2), (h3, p3, r3, w3) = wire.groups
    assert (h1, r1, w1) == (h2, r2, w2) == (h3, r3, w3) == ("127.0.0.1", 0, 5)
    assert len({p1, p2, p3}) == 3
    inits = {i: [body["init_info"] for _, route, body in r.calls
                 if route == "/init_weight_transfer_engine"] for i, r in enumerate(recorders)}
    assert [i["master_port"] for i in inits[0]] == [p1, p2, p3]
    assert [i["rank_offset"] for i in inits[0]] == [1, 1, 1]
    assert [i["rank_offset"] for i in inits[1]] == [3]
    assert [(i["rank_offset"], i["master_port"]) for i in inits[2]] == [(3, p2), (3, p3)]
    assert all(i["packed"] is True for v in inits.values() for i in v)
    # every version, one broadcast, under the checkpoint's names, in update_info's order
    layout = checkpoint_layout(model)
    update_info = nccl_update_info(layout)
    assert len(wire.sent) == 4
    for sent in wire.sent:
        assert [n for n, _ in sent] == update_info["names"]
    for i, recorder in enumerate(recorders):
        routes = [route for _, route, _ in recorder.calls]
        assert "/collective_rpc" not in routes  # no folder is ever posted
        assert all(body == {"update_info": update_info}
                   for _, route, body in recorder.calls if route == "/update_weights")
        finished = [body["weight_version"] for _, route, body in recorder.calls
                    if route == "/finish_weight_update"]
        assert finished == {0: ["0", "1", "2", "1"], 1: ["0", "1"], 2: ["2", "1"]}[i]
    # the payloads as vLLM itself reads them
    group = json.loads((tmp_path / "nccl" / "group.json").read_text())
    vllm_accepts(inits[0] + inits[2] + nccl_group([8, 8], "10.1.2.3", 29500),
                 [update_info], trainer={
        "master_address": h2, "master_port": p2, "world_size": group["world_size"],
        "packed": True, "packed_buffer_size_bytes": group["packed_buffer_size_bytes"],
        "packed_num_buffers": group["packed_num_buffers"], "rank": 0})


# ---- vLLM's own classes

VALIDATE = r"""
import json, sys
from dataclasses import asdict
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo, NCCLWeightTransferEngine)
doc = json.load(sys.stdin)
out = {"init": [], "update": [], "refused": []}
engine = NCCLWeightTransferEngine
for init in doc["init"]:
    out["init"].append(sorted(asdict(engine.init_info_cls(**init))))
for update in doc["update"]:
    info = engine.update_info_cls(**update)
    out["update"].append(len(info.names))
for bad in doc["bad_update"]:
    try:
        engine.update_info_cls(**bad)
    except TypeError as e:
        out["refused"].append(str(e))
trainer = dict(doc["trainer"])
rank = trainer.pop("rank")
out["trainer"] = asdict(NCCLTrainerInitInfo(**trainer, rank=rank))["world_size"]
print(json.dumps(out))
"""


def vllm_accepts(inits: list[dict], updates: list[dict], trainer: dict) -> None:
    """Each payload builds vLLM's own dataclass (as ``parse_init_info`` /
    ``parse_update_info`` do); the update info of the old shape (packed* keys) is refused."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (bin/tmax-setup-vllm makes it): the "
                    "payloads are not checked against vLLM's classes")
    bad = dict(updates[0], packed=True, packed_buffer_size_bytes=1 << 30,
               packed_num_buffers=2)
    doc = {"init": inits, "update": updates, "bad_update": [bad], "trainer": trainer}
    out = subprocess.run([str(VLLM_PYTHON), "-c", VALIDATE], input=json.dumps(doc),
                         capture_output=True, text=True, timeout=600, check=False,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["init"]) == len(inits)
    assert all({"master_address", "master_port", "rank_offset", "world_size", "packed",
                "packed_buffer_size_bytes", "packed_num_buffers"} <= set(fields)
               for fields in result["init"])
    assert result["update"] == [len(u["names"]) for u in updates]
    assert len(result["refused"]) == 1 and "packed" in result["refused"][0]
    assert result["trainer"] == trainer["world_size"]


def test_a_pool_of_8_gpu_servers_lays_its_ranks_out_after_the_trainer():
    infos = nccl_group([8, 8], "10.1.2.3", 29500)  # checked by vLLM above
    assert infos == [nccl_init_info("10.1.2.3", 29500, rank_offset=o, world_size=17)
                     for o in (1, 9)]


def test_weight_transfer_nccl_selects_the_broadcast_on_both_sides(tmp_path):
    from tmax.train.config import load_train_config
    from tmax.train.handover import Handover
    from tmax.train.processes import nccl_coordinator
    from tmax.train.trainer_rank import nccl_sender

    nccl = load_train_config(None, ["engine=vllm", "vllm.weight_transfer=nccl",
                                    "vllm.data_parallel_size=4"])
    coordinator = nccl_coordinator(nccl, tmp_path, lambda: True)
    assert isinstance(coordinator, NcclCoordinator) and coordinator.gpus == 4
    assert isinstance(nccl_sender(nccl, tmp_path, 0, Handover(tmp_path)), NcclSender)
    for folder in (load_train_config(None, ["engine=vllm"]), load_train_config(None)):
        assert nccl_coordinator(folder, tmp_path, lambda: True) is None
        assert nccl_sender(folder, tmp_path, 0, Handover(tmp_path)) is None
