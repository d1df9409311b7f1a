"""The training config's ${VAR} expansion and the shipped GPU configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tmax.train.config import TrainConfigError, expand_vars, load_train_config

REPO = Path(__file__).resolve().parents[1]


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
    config = load_train_config(REPO / "configs" / "qwen3.5-9b.yaml")
    assert config.run_dir == Path("/scratch/u/tmax/runs/qwen3.5-9b")


def test_overrides_expand_too(monkeypatch):
    monkeypatch.setenv("RUNS", "/r")
    assert load_train_config(None, ["out_dir=${RUNS}/{name}"]).run_dir == Path("/r/tiny-cpu")
