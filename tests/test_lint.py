"""The linter and the type checker, as part of the suite (rules and scope in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_ruff_finds_nothing():
    out = subprocess.run([str(BIN / "ruff"), "check", "--no-cache", "."], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_mypy_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "mypy", "sandfleet", "tmax"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
