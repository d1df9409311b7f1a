"""Packaging contracts: the console scripts, the import rules, silence on import."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_sandfleet_never_imports_tmax():
    offenders = []
    for path in (REPO / "sandfleet").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "tmax"]
    assert offenders == []


@pytest.mark.parametrize("module", ["tmax", "tmax.cli", "tmax.tasks", "sandfleet",
                                    "sandfleet.cli", "tmax.train.cli"])
def test_silent_on_import_and_no_heavy_imports(module):
    code = (f"import sys, {module}; "
            "heavy = [m for m in ('torch', 'transformers', 'vllm', 'deepspeed', 'submitit') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]" and out.stderr == ""


@pytest.mark.parametrize("script, expected", [("tmax", "Commands:"),
                                              ("tmax-train", "--config"),
                                              ("sandfleet", "Commands:")])
def test_console_scripts_answer_help(script, expected):
    out = subprocess.run([str(BIN / script), "--help"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0 and expected in out.stdout


def test_sandfleet_doctor_reports_runtimes():
    out = subprocess.run([str(BIN / "sandfleet"), "doctor", "-o", "json"], capture_output=True,
                         text=True, timeout=60, check=True)
    report = json.loads(out.stdout)
    assert set(report["runtimes"]) == {"local", "apptainer"}
    # bwrap and squashfs tools are installed by bin/tmax-setup, so the local runtime is usable
    assert report["runtimes"]["local"] is True
    assert report["providers"]["slurm"] is True


def test_tmax_train_env_reports_torch_and_lazy_gpu_extras():
    out = subprocess.run([str(BIN / "tmax-train"), "env", "-o", "json"], capture_output=True,
                         text=True, timeout=120, check=True)
    report = json.loads(out.stdout)
    import torch

    assert report["torch"] == torch.__version__
    assert report["cuda_available"] == torch.cuda.is_available()
