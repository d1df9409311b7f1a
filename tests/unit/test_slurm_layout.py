"""The GPU layout of a Slurm launch: the shipped 9B/27B configs ask for the nodes, GPUs, CPUs
and memory of each role (8-GPU nodes, one trainer rank per GPU), a layout that cannot hold
what runs is an error before anything is submitted, and a trainer rank that was asked
for CUDA and has no GPU of its own stops at start instead of training on CPU with gloo."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tmax.train.backends.config import TrainerSection
from tmax.train.backends.deepspeed import DeviceError, init_distributed, resolve_device
from tmax.train.config import load_train_config
from tmax.train.slurm_scripts import LayoutError, check_layout, slurm_plan

REPO = Path(__file__).resolve().parents[2]
NCCL = ["vllm.weight_transfer=nccl"]  # the layout does not depend on how weights travel


def sbatch(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", script, re.MULTILINE))


@pytest.mark.parametrize(("name", "nodes", "ranks"), [("qwen3.5-9b", 2, 16),
                                                       ("qwen3.6-27b", 4, 32)])
def test_the_gpu_configs_ask_for_gpus_cpus_and_memory_per_role(monkeypatch, name, nodes,
                                                               ranks):
    monkeypatch.setenv("SCRATCH", "/scratch/u")
    config = load_train_config(REPO / "configs" / f"{name}.yaml", NCCL)
    assert config.distributed.trainer_ranks == ranks
    assert config.trainer.device == "cuda" and config.trainer.activation_checkpointing
    plan = slurm_plan(config, detach=True)
    trainer = sbatch(plan["trainer.sbatch"])
    assert (trainer["nodes"], trainer["ntasks-per-node"], trainer["gpus-per-node"]) == \
        (str(nodes), "8", "8")
    assert (trainer["cpus-per-task"], trainer["mem"]) == ("12", "800G")
    for i in range(config.distributed.inference_servers):
        server = sbatch(plan[f"inference-{i}.sbatch"])
        assert (server["nodes"], server["ntasks-per-node"], server["gpus-per-node"],
                server["cpus-per-task"], server["mem"]) == ("1", "1", "8", "96", "800G")
    orchestrator = sbatch(plan["orchestrator.sbatch"])
    assert "gpus-per-node" not in orchestrator
    assert (orchestrator["cpus-per-task"], orchestrator["mem"]) == ("8", "32G")


def test_a_layout_that_cannot_hold_its_ranks_is_refused(monkeypatch):
    monkeypatch.setenv("SCRATCH", "/scratch/u")
    path = REPO / "configs" / "qwen3.5-9b.yaml"
    # the old default: 16 ranks on one node of 8 GPUs
    with pytest.raises(LayoutError, match=r"16 trainer ranks per node .* 8 GPUs per node"):
        check_layout(load_train_config(path, NCCL + ["slurm.trainer_nodes=1"]))
    with pytest.raises(LayoutError, match="asks for none: set slurm.trainer.gpus_per_node"):
        slurm_plan(load_train_config(path, NCCL + ["slurm.trainer.gpus_per_node=null"]))
    with pytest.raises(LayoutError, match="8 GPUs .* asks for 4"):
        check_layout(load_train_config(path, NCCL + ["slurm.inference.gpus_per_node=4"]))
    # gres is read too, and an hf-server CPU run asks for nothing
    check_layout(load_train_config(path, NCCL + ["slurm.trainer.gpus_per_node=null",
                                          "slurm.trainer.gres=gpu:h100:8"]))
    check_layout(load_train_config(None, ["distributed.enabled=true"]))


def test_cuda_asked_for_and_absent_or_short_is_an_error():
    cuda = TrainerSection(backend="deepspeed", device="cuda")
    with pytest.raises(DeviceError, match="device=cuda, but torch sees no GPU"):
        resolve_device(cuda, local_rank=0, cuda_available=False, device_count=0)
    with pytest.raises(DeviceError, match="LOCAL_RANK=8 has no GPU: this node shows 8"):
        resolve_device(cuda, local_rank=8, cuda_available=True, device_count=8)
    assert resolve_device(cuda, local_rank=7, cuda_available=True, device_count=8) == \
        ("cuda", "nccl")
    nccl = TrainerSection(backend="deepspeed", dist_backend="nccl")
    with pytest.raises(DeviceError, match="nccl needs CUDA"):
        resolve_device(nccl, local_rank=0, cuda_available=False, device_count=0)
    # auto: a GPU when there is one, CPU and gloo on a machine with none (the tiny runs)
    auto = TrainerSection(backend="deepspeed")
    assert resolve_device(auto, local_rank=0, cuda_available=False, device_count=0) == \
        ("cpu", "gloo")
    assert resolve_device(auto, local_rank=1, cuda_available=True, device_count=2) == \
        ("cuda", "nccl")


def test_a_cuda_rank_on_this_cpu_machine_stops_before_any_collective(monkeypatch):
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DeviceError, match="sees no GPU"):
        init_distributed(TrainerSection(backend="deepspeed", device="cuda"))
    assert not dist.is_initialized()
