"""The training config's ${VAR} expansion and the shipped GPU configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tmax.train.config import TrainConfigError, expand_vars, load_train_config

REPO = Path(__file__).resolve().parents[2]


def test_vars_expand_with_defaults_and_escapes():
    env = {"SCRATCH": "/scratch/me", "EMPTY": ""}
    data = {"out_dir": "${SCRATCH}/runs/{name}", "n": 3,
            "model": {"path": "${MODELS:-/models}/q", "tags": ["${EMPTY:-x}", "$${LITERAL}"]}}
    assert expand_vars(data, "c.yaml", env) == {
        "out_dir": "/scratch/me/runs/{name}", "n": 3,
        "model": {"path": "/models/q", "tags": ["", "${LITERAL}"]}}


def test_an_unset_variable_names_every_key_and_the_fix():
    with pytest.raises(TrainConfigError) as e:
        expand_vars({"out_dir": "${SCRATCH}/r", "model": {"path": "${HOME_M}/m"}}, "c.yaml", {})
    assert e.value.source == "c.yaml"
    assert [p.split(":")[0] for p in e.value.problems] == ["out_dir", "model.path"]
    assert "${SCRATCH} is not set (export SCRATCH=" in e.value.problems[0]
    assert "override out_dir=" in e.value.problems[0]


def test_shipped_gpu_config_without_scratch_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("SCRATCH", raising=False)
    with pytest.raises(TrainConfigError, match=r"qwen3.5-9b.yaml: out_dir: \$\{SCRATCH\}"):
        load_train_config(REPO / "configs" / "qwen3.5-9b.yaml")
    monkeypatch.setenv("SCRATCH", "/scratch/u")
    monkeypatch.delenv("TMAX_VLLM_PYTHON", raising=False)
    config = load_train_config(REPO / "configs" / "qwen3.5-9b.yaml")
    assert config.run_dir == Path("/scratch/u/tmax/runs/qwen3.5-9b")


def test_overrides_expand_too(monkeypatch):
    monkeypatch.setenv("RUNS", "/r")
    assert load_train_config(None, ["out_dir=${RUNS}/{name}"]).run_dir == Path("/r/tiny-cpu")


def test_the_shipped_gpu_configs_print_their_exact_launch(monkeypatch):
    """--dry-run shows each vLLM server's command line and the DeepSpeed config exactly as
    the launch runs them."""
    import sys

    from click.testing import CliRunner

    from tmax.train.cli import main
    from tmax.train.processes import launch_plan

    monkeypatch.setenv("SCRATCH", "/scratch/u")
    monkeypatch.delenv("TMAX_VLLM_PYTHON", raising=False)
    config = load_train_config(REPO / "configs" / "qwen3.5-9b.yaml")
    plan = launch_plan(config)
    run = "/scratch/u/tmax/runs/qwen3.5-9b"
    assert len(plan["inference"]) == 6
    assert plan["inference"][1] == {"env": {"VLLM_SERVER_DEV_MODE": "1"}, "command": (
        f"vllm serve {run}/init --served-model-name qwen3.5-9b --host 0.0.0.0 --port 8001 "
        "--tensor-parallel-size 1 --data-parallel-size 8 --dtype bfloat16 "
        "--gpu-memory-utilization 0.85 --seed 1 --logprobs-mode processed_logprobs "
        "--generation-config vllm --max-model-len 65536 "
        "--hf-overrides '{\"head_dtype\": \"float32\"}' "
        "--reasoning-parser qwen3 --language-model-only")}
    trainer = plan["trainer"]
    assert trainer["command"] == f"{sys.executable} -m tmax.train.processes trainer {run}"
    assert (trainer["ranks"], trainer["backend"], trainer["precision"]) == \
        (16, "deepspeed", "bf16")
    ds = trainer["deepspeed_config"]
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"] == {"enabled": True}
    assert ds["optimizer"]["params"]["lr"] == 1e-6 and ds["gradient_clipping"] == 1.0
    out = CliRunner().invoke(main, ["--config", str(REPO / "configs" / "qwen3.6-27b.yaml"),
                                    "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "--tensor-parallel-size 2 --data-parallel-size 4" in out.output
    assert "ranks: 32" in out.output and "stage: 3" in out.output


def test_disk_is_not_a_weight_transfer_backend():
    with pytest.raises(TrainConfigError, match="'disk' is not a vLLM backend.*'folder'"):
        load_train_config(None, ["vllm.weight_transfer=disk"])
    config = load_train_config(None, ["engine=vllm", "vllm.python=/venv/bin/python",
                                      "vllm.device=cpu"])
    from tmax.train.commands import server_command

    argv, env = server_command(config, Path("/run"), 0, 8000)
    assert argv[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                        "--model", "/run/init"]
    assert "--weight-transfer-config" not in argv
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_SERVER_DEV_MODE"] == "1"
