"""The linter and the type checker, as part of the suite (rules and scope in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_ruff_finds_nothing():
    out = subprocess.run([str(BIN / "ruff"), "check", "--no-cache", "."], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_mypy_finds_nothing():
    from tests.conftest import early_mypy

    if "proc" in early_mypy:  # started when the session began (tests/conftest.py)
        proc, out = early_mypy.pop("proc"), early_mypy.pop("out")
        code = proc.wait(timeout=600)
        out.seek(0)
        text = out.read().decode(errors="replace")
        out.close()
        assert code == 0, text[-6000:]
        return
    out = subprocess.run([sys.executable, "-m", "mypy", "sandfleet", "tmax"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
