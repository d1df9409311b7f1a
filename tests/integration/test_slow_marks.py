"""The quick tier's rule (tests/conftest.py): a test that uses a slow fixture or is marked
`slurm` must be marked slow on the test, or the collection fails naming it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).parents[1] / "conftest.py"

TESTS = '''
import pytest

def test_unmarked_builds(image_store):
    pass

@pytest.mark.slurm
def test_unmarked_on_slurm():
    pass

@pytest.mark.slow
def test_marked(image_store, local_slurm):
    pass

def test_quick(tmp_path):
    pass
'''

MODULE_MARKED = '''
import pytest

pytestmark = pytest.mark.slow

def test_builds(example_store):
    pass
'''


def collect(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          cwd=root, capture_output=True, text=True, timeout=120, check=False)


def test_a_slow_fixture_or_slurm_without_the_slow_mark_fails_the_collection(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_mixed.py").write_text(TESTS)
    (tmp_path / "test_module.py").write_text(MODULE_MARKED)
    out = collect(tmp_path, "-m", "not slow")
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "must be marked slow" in text, text
    text = text.split("must be marked slow", 1)[1]  # the error, after any listing
    assert "test_mixed.py::test_unmarked_builds" in text
    assert "test_mixed.py::test_unmarked_on_slurm" in text
    for fine in ("test_marked", "test_quick", "test_module.py"):
        assert fine not in text, (fine, text)


def test_marked_tests_collect_and_the_quick_tier_leaves_them_out(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_mixed.py").write_text(
        TESTS.replace("def test_unmarked", "@pytest.mark.slow\ndef test_unmarked"))
    (tmp_path / "test_module.py").write_text(MODULE_MARKED)
    out = collect(tmp_path, "-m", "not slow")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [line for line in out.stdout.splitlines() if "::" in line] == \
        ["test_mixed.py::test_quick"]
    full = collect(tmp_path)
    assert full.returncode == 0 and "5 tests collected" in full.stdout, full.stdout
