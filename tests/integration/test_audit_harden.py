"""`tmax repair`'s mechanical hardening of verifiers the exploit probes forged
(``tmax.audit.harden``): the plan for each hack, the gate test.sh becomes (run
here by bash with this venv's pytest), and (slow) audit, repair and re-audit of planted
tasks in real sandboxes on the local runtime."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tmax.audit.harden import (
    GRADED,
    NotHardened,
    add_report,
    exploit_only,
    gate_script,
    isolate,
    plan,
    pytest_runs,
    reference_counts,
    set_counts,
    working_hacks,
)
from tmax.audit.run import AuditRecord

PLANTED = Path(__file__).parents[1] / "data" / "audit-tasks"
PYTEST_TASK, UNITTEST_TASK = "weak-exploit-pytest-exit", "weak-exploit-import-exit"
UVX = "uvx --with pytest==8.4.1 pytest /tests/test_x.py -rA\n"


def _tests(tmp_path: Path, script: str, *others: tuple[str, str]) -> Path:
    tests = tmp_path / "tests"
    tests.mkdir(parents=True)
    (tests / "test.sh").write_text("#!/bin/bash\n" + script)
    for name, text in others:
        (tests / name).write_text(text)
    return tests


def _record(runs: list[dict], findings: list[tuple[str, str]]) -> AuditRecord:
    label = findings[0][0] if findings else None
    return AuditRecord("t", "p", "d", label, "probes" if label else None,
                       findings=[{"label": lab, "probe": p, "evidence": ""}
                                 for lab, p in findings],
                       probes={"exploits": runs})


# ---- which hack has which fix


def test_the_plan_fixes_exit_on_import_under_pytest_once_and_says_why_not_otherwise(
        tmp_path):
    assert plan(_tests(tmp_path / "a", UVX), ["exit-on-import"]) == ["report"]
    why = {
        "unittest": ("python3 -m unittest discover -s /tests\n", "do not run under pytest"),
        "twice": (UVX + UVX, "runs pytest 2 times"),
        "addopts": ("export PYTEST_ADDOPTS=-q\n" + UVX, "its own PYTEST_ADDOPTS"),
        "junit": ("pytest --junitxml=/tmp/r.xml /tests\n", "JUnit report"),
    }
    for name, (script, reason) in why.items():
        with pytest.raises(NotHardened, match=reason):
            plan(_tests(tmp_path / name, script), ["exit-on-import"])
    for hack in ("uv-env", "path-programs", "lingering-writer", "together"):
        with pytest.raises(NotHardened, match="the runtime's to hold"):
            plan(_tests(tmp_path / hack, UVX), [hack])
    with pytest.raises(NotHardened, match="multi-step"):
        plan(_tests(tmp_path / "steps", UVX), ["exit-on-import"], steps=True)
    # pip's install line and uvx's --with requirement are not runs
    assert pytest_runs("pip install pytest==8.4.1\n" + UVX + "# pytest again\n") == 1


def test_python_m_runs_isolated_and_flags_stay(tmp_path):
    tests = _tests(tmp_path, "cd /app\npython3 -m pytest /tests -q && echo 1\n"
                             "/usr/bin/python3.11 -u -m unittest discover\n")
    assert plan(tests, ["python-m"]) == ["isolate"]
    assert isolate(tests)
    text = (tests / "test.sh").read_text()
    assert "python3 -P -m pytest /tests -q" in text
    assert "/usr/bin/python3.11 -u -P -m unittest discover" in text
    assert isolate(tests) == []  # once
    with pytest.raises(NotHardened, match="no python -m"):
        plan(_tests(tmp_path / "b", UVX), ["python-m"])


def test_only_exploit_findings_are_hardened_and_the_hacks_that_worked_alone_are_named():
    runs = [{"hacks": ["uv-env", "python-m"], "reward": 1.0},
            {"hacks": ["uv-env"], "reward": 0.0}, {"hacks": ["python-m"], "reward": 1.0},
            {"hacks": ["exit-on-import"], "reward": 1.0}]
    assert working_hacks(_record(runs, [])) == ["exit-on-import", "python-m"]
    assert working_hacks(_record(runs[:2], [])) == ["together"]
    assert working_hacks(_record([], [])) == []
    assert exploit_only(_record(runs, [("verifier_too_weak", "exploit")]))
    assert not exploit_only(_record(runs, [("verifier_too_weak", "exploit"),
                                           ("verifier_too_weak", "mutation")]))
    assert not exploit_only(_record(runs, [("answer_leak", "copy")]))


def test_the_reference_counts_come_from_the_oracle_run_of_the_checks_log():
    log = ("## nop in sandbox a\ntmax-report: tests=3 passed=0 failed=3 errors=0 skipped=0\n"
           "## oracle in sandbox b\ntmax-report: tests=4 passed=3 failed=0 errors=0 "
           "skipped=1\n## result: ok\n")
    assert reference_counts(log) == (4, 3)
    with pytest.raises(NotHardened, match="no JUnit report"):
        reference_counts(log.split("## oracle")[0])
    with pytest.raises(NotHardened, match="1 failed"):
        reference_counts("## oracle\ntmax-report: tests=2 passed=1 failed=1 errors=0 "
                         "skipped=0\n")


# ---- the gate, run by bash with a real pytest


GRADED_SH = f"""cd {{work}}
{sys.executable} -m pytest -p no:cacheprovider -q {{tests}}/test_mod.py
if [ $? -eq 0 ]; then echo 1 > {{logs}}/reward.txt; else echo 0 > {{logs}}/reward.txt; fi
"""
TESTS_PY = """import sys
sys.path.insert(0, {work!r})
import mod

def test_one():
    assert mod.f(1) == 2

def test_two():
    assert mod.f(2) == 4

def test_three():
    assert mod.f(0) == 0
"""


def _gated(tmp_path: Path, counts: tuple[int, int] | None, module: str,
           tests_py: str = TESTS_PY, graded: str = GRADED_SH) -> tuple[str, str]:
    """Run the hardened verifier over ``module`` (the agent's mod.py): its reward and
    output. The sandbox paths (/logs/verifier, /tests/) are folders under ``tmp_path``."""
    work, logs = tmp_path / "work", tmp_path / "logs"
    for d in (work, logs):
        d.mkdir(exist_ok=True)
    tests = tmp_path / "tests"
    if not tests.exists():
        tests = _tests(tmp_path, graded.format(work=work, tests=tmp_path / "tests", logs=logs),
                       ("test_mod.py", tests_py.format(work=str(work))))
        add_report(tests)
        assert (tests / GRADED).read_text().endswith("reward.txt; fi\n")
    if counts:
        set_counts(tests, *counts)
    for f in logs.iterdir():
        f.unlink()
    (work / "mod.py").write_text(module)
    script = (tests / "test.sh").read_text().replace("/logs/verifier", str(logs)) \
        .replace("/tests/", f"{tests}/")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=work,
                         env=env, timeout=120)
    return (logs / "reward.txt").read_text().strip(), out.stdout + out.stderr


@pytest.mark.slow  # real pytest runs, a few seconds each
def test_the_gate_keeps_an_honest_reward_and_zeroes_one_the_report_does_not_back(tmp_path):
    honest = "def f(x):\n    return 2 * x\n"
    reward, out = _gated(tmp_path, None, honest)
    assert reward == "1" and "tmax-report: tests=3 passed=3 failed=0" in out, out
    assert reference_counts(f"## oracle\n{out}") == (3, 3)
    reward, out = _gated(tmp_path, (3, 3), honest)
    assert reward == "1", out
    # os._exit(0) on import: pytest exits 0 and writes no report
    reward, out = _gated(tmp_path, (3, 3), "import os\nos._exit(0)\n")
    assert reward == "0" and "no report at" in out, out
    # a wrong module: the original verifier's own 0 stands
    reward, out = _gated(tmp_path, (3, 3), "def f(x):\n    return x\n")
    assert reward == "0" and "tests=3 passed=1 failed=2" in out, out
    # fewer tests collected than the reference run (planted code deselected some)
    reward, out = _gated(tmp_path, (5, 5), honest)
    assert reward == "0" and "3 tests collected, the reference run had 5" in out, out


@pytest.mark.slow  # real pytest runs, a few seconds each
def test_a_partial_reward_stands_beside_failures_but_needs_the_report(tmp_path):
    partial = GRADED_SH.replace("echo 1 > {logs}/reward.txt; else echo 0",
                                "echo 1 > {logs}/reward.txt; else echo 0.5")
    reward, out = _gated(tmp_path, (3, 3), "def f(x):\n    return x * x\n", graded=partial)
    assert reward == "0.5" and "failed=1" in out, out  # 2 of 3 pass: its 0.5 stands
    reward, out = _gated(tmp_path, (3, 3), "import os\nos._exit(3)\n", graded=partial)
    assert reward == "0" and "no report" in out, out


def test_the_gate_script_is_valid_bash():
    out = subprocess.run(["bash", "-n", "-c", gate_script(3, 3)], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr


# ---- slow: audit, repair (no teacher) and audit again, in real sandboxes


@pytest.fixture(scope="module")
def harden_store(base_store):
    """A store with the two exploit tasks' images, built with their checks (kept between
    sessions; content-addressed)."""
    from tests.conftest import link_base
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import image_checker
    from tmax.images.store import ImageStore
    from tmax.tasks.native import load_task

    cache = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
    store = ImageStore(cache / "test-audit-harden")
    entry = base_store.read().bases["debian-slim"]
    if store.read().bases.get("debian-slim") != entry:
        store.path(entry.sif).unlink(missing_ok=True)
        link_base(store, base_store, "debian-slim")
    builds = ImageBuilds(store, LocalBuilder(cache), checker=image_checker(cache, "local"))
    results = builds.build_all([load_task(PLANTED / t) for t in (PYTEST_TASK, UNITTEST_TASK)],
                               jobs=2, progress=False)
    failed = {r.task_id: r.error for r in results if r.status == "failed"}
    assert not failed, f"images failed to build: {failed}"
    return builds


def _audit(builds, fleet, tasks, out):
    from tmax.audit.probes import Prober
    from tmax.audit.run import Auditor
    from tmax.fleet import open_fleet
    from tmax.rollout.run import TaskImages

    async def go():
        async with open_fleet(fleet.state) as client:
            auditor = Auditor(Prober(client, TaskImages(builds.store.root)), out)
            return await auditor.run(tasks, jobs=2, progress=False)

    return asyncio.run(go())


def _repair(builds, fleet, pairs, clean):
    from tmax.audit.probes import Prober
    from tmax.audit.repair import Repairer
    from tmax.fleet import open_fleet
    from tmax.rollout.run import TaskImages

    async def go():
        async with open_fleet(fleet.state) as client:
            repairer = Repairer(Prober(client, TaskImages(builds.store.root)), builds, clean)
            return await repairer.run(pairs, jobs=2, progress=False)

    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.sandbox
def test_repair_hardens_a_pytest_verifier_the_exit_hack_forged_and_keeps_a_unittest_one_labelled(
        harden_store, example_fleet, tmp_path):
    from tmax.tasks.native import load_task

    ids = [PYTEST_TASK, UNITTEST_TASK]
    # the pytest task with JUnit reports turned off in test.sh: a hardening that cannot hold
    # (the plan cannot see it; the rebuilt task's checks do)
    off = tmp_path / "planted" / "weak-exploit-pytest-nojunit"
    shutil.copytree(PLANTED / PYTEST_TASK, off)
    script = off / "tests" / "test.sh"
    off_sh = script.read_text().replace(" -rA", " -rA -p no:junitxml")
    script.write_text(off_sh)
    built = harden_store.build(load_task(off))
    assert built.status != "failed" and built.checks["ok"], built
    tasks = [load_task(PLANTED / t) for t in ids] + [load_task(off)]
    original = {t: (PLANTED / t / "tests" / "test.sh").read_bytes() for t in ids}
    audits = _audit(harden_store, example_fleet, tasks, tmp_path / "audit")
    for a in audits:
        assert a.label == "verifier_too_weak" and not a.error, a.to_dict()
        assert [f["probe"] for f in a.findings] == ["exploit"], a.findings
        assert working_hacks(a) == ["exit-on-import"], a.probes["exploits"]
    repairs = {r.task: r for r in _repair(harden_store, example_fleet,
                                          list(zip(tasks, audits)), tmp_path / "clean")}
    fixed, kept = repairs[PYTEST_TASK], repairs[UNITTEST_TASK]
    assert fixed.action == "repaired" and fixed.after is None, fixed.to_dict()
    assert any("3 tests, 3 passed" in c for c in fixed.changes), fixed.changes
    assert kept.action == "dropped" and kept.after == "verifier_too_weak", kept.to_dict()
    assert "do not run under pytest" in kept.reason and kept.attempts == 0
    held = repairs[off.name]
    assert held.action == "dropped" and held.after == "verifier_too_weak", held.to_dict()
    assert held.reason.startswith("the hardening did not hold (the original is kept)")
    assert script.read_text() == off_sh and not (off / "tests" / GRADED).exists()
    # the originals are untouched; only the repaired task is published
    assert {t: (PLANTED / t / "tests" / "test.sh").read_bytes() for t in ids} == original
    clean = tmp_path / "clean" / "tasks"
    assert [p.name for p in clean.iterdir()] == [PYTEST_TASK]
    assert (clean / PYTEST_TASK / "tests" / GRADED).read_bytes() == original[PYTEST_TASK]
    # probed again as a user would audit the clean folder: oracle 1, untouched 0, the
    # exit-on-import hack 0 now, nothing labelled
    again = _audit(harden_store, example_fleet, [load_task(clean / PYTEST_TASK)],
                   tmp_path / "audit-again")[0]
    assert again.label is None and not again.error, again.to_dict()
    assert again.probes["oracle"]["reward"] == 1.0 and again.probes["nop"]["reward"] == 0.0
    exits = [r for r in again.probes["exploits"] if r["hacks"] == ["exit-on-import"]]
    assert [r["reward"] for r in exits] == [0.0], again.probes["exploits"]
