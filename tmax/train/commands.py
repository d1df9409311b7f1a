"""What each process of a run executes: an inference server's argv and environment
(``vllm serve`` or ``tmax serve``), a trainer rank's argv, and the whole launch plan that
``--dry-run`` prints. Pure functions of the config."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tmax.train.config import TrainConfig


def vllm_config_of(config: TrainConfig, model: str, index: int, port: int,
                   host: str = "0.0.0.0") -> Any:
    """The ``VLLMConfig`` of inference server ``index`` of the run."""
    from tmax.inference.vllm import VLLMConfig

    v = config.vllm
    return VLLMConfig(model=model, served_model_name=config.name, host=host, port=port,
                      tensor_parallel_size=v.tensor_parallel_size,
                      data_parallel_size=v.data_parallel_size, dtype=config.model.dtype,
                      fp32_head=config.model.fp32_lm_head, max_model_len=v.max_model_len,
                      gpu_memory_utilization=v.gpu_memory_utilization,
                      max_num_seqs=v.max_num_seqs, seed=config.seed + index,
                      weight_transfer=v.weight_transfer, enforce_eager=v.enforce_eager,
                      reasoning_parser=v.reasoning_parser,
                      language_model_only=v.language_model_only, python=v.python,
                      device=v.device, cpu_kvcache_gib=v.cpu_kvcache_gib,
                      extra_args=tuple(v.extra_args))


def server_command(config: TrainConfig, run_dir: Path, index: int, port: int, *,
                   host: str | None = None) -> tuple[list[str], dict[str, str]]:
    """Inference server ``index``'s argv and added environment: ``vllm serve`` for
    engine=vllm, ``tmax serve`` (hf-server) for engine=transformers. Both start from the
    run's initial weights (``RUN/init``)."""
    init = str(run_dir / "init")
    env = {"OMP_NUM_THREADS": str(config.torch_threads)} if config.torch_threads else {}
    if config.engine == "vllm":
        from tmax.inference.vllm import serving_dir, vllm_env, vllm_serve_command

        vc = vllm_config_of(config, str(serving_dir(init)), index, port,
                            *([host] if host else []))
        return vllm_serve_command(vc), {**env, **vllm_env(vc)}
    from tmax.inference.process import hf_server_command

    return hf_server_command(init, host=host or "127.0.0.1", port=port,
                             max_batch=config.distributed.max_batch,
                             max_tokens=config.rollout.max_new_tokens,
                             temperature=config.rollout.temperature,
                             served_model_name=config.name, seed=config.seed + index), env


def trainer_command(run_dir: Path) -> list[str]:
    """One trainer rank's argv (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in its env)."""
    return [sys.executable, "-m", "tmax.train.processes", "trainer", str(run_dir)]


def launch_plan(config: TrainConfig) -> dict[str, Any]:
    """What a launch runs, for ``--dry-run``: each inference server's command line and
    environment, the trainer's command and ranks, and the DeepSpeed config."""
    import shlex

    run_dir = config.run_dir
    plan: dict[str, Any] = {"run_dir": str(run_dir), "inference": [], "trainer": {}}
    port = config.vllm.port
    for i in range(config.distributed.inference_servers):
        argv, env = server_command(config, run_dir, i, port + i)
        plan["inference"].append({"command": shlex.join(argv), "env": env})
    plan["trainer"] = {"command": shlex.join(trainer_command(run_dir)),
                       "ranks": config.distributed.trainer_ranks,
                       "backend": config.trainer.backend}
    if config.trainer.backend == "deepspeed":
        from tmax.train.backends.config import build_deepspeed_config, uses_bf16

        t = config.trainer  # on the trainer's nodes: GPUs when asked for, or a vLLM run's
        bf16 = uses_bf16(t, cuda=t.device == "cuda" or (t.device == "auto"
                                                       and config.engine == "vllm"))
        plan["trainer"]["deepspeed_config"] = build_deepspeed_config(
            config.trainer, config.optim, bf16=bf16)
        plan["trainer"]["precision"] = "bf16" if bf16 else "fp32"
    return plan
