"""Mechanical hardening of a verifier the exploit probes forged, no teacher.

``tmax repair`` tries this first for a task labelled ``verifier_too_weak`` by exploit
probes alone (``tmax.audit.exploits``); what the hack that passed allows:

- ``exit-on-import`` (``os._exit(0)`` in a module the tests import; test.sh trusts its
  runner's exit status), tests run by **pytest**, once: test.sh becomes a wrapper that asks
  pytest for a JUnit XML report under /logs/verifier (``PYTEST_ADDOPTS``: every way test.sh
  starts pytest, uvx included) and runs the original (moved to ``tests/tmax-graded.sh``)
  unchanged; then a gate keeps the reward it wrote only when the report exists, collected
  at least as many tests as the reference run did, shows a test that passed, and, for a
  full reward, no test that failed or errored and at least the reference's passes. The
  gate only lowers a reward. The host reads the same report too (``tmax.tasks.reports``:
  the wrapper names it with ``--junitxml``), so a full reward without it is contradicted
  there as well. The reference counts come from the oracle run of the build-time checks.
- ``python-m`` (a ``pytest.py`` / ``unittest.py`` in the working directory shadows the
  runner: the runtime lets it through), test.sh starting it as ``python3 -m pytest`` or
  ``-m unittest``: ``-P`` is added (Python 3.11+: no working directory on ``sys.path``).

No mechanical fix, said in the repair record: unittest and other runners (no report to
grade from), pytest run more than once (one report cannot stand for several runs), a
test.sh that sets its own ``PYTEST_ADDOPTS`` or JUnit report, multi-step tasks, and the
runtime hacks (``uv-env``, ``path-programs``, ``lingering-writer``: the runtime's to hold,
e.g. sandfleet's local runtime does). Code imported by pytest runs in pytest's own process,
so it could still write a report of its own: the report raises the bar from one line to a
forged report with the reference's counts, which the probes do not try; only running the
agent's code in a subprocess closes that, and only the task's author can.

The repaired copy is accepted only when its build-time checks pass (oracle 1, untouched
below 1), the untouched environment scores 0 and every probe, the exploits included, finds
nothing (``Repairer._harden``, ``Repairer._check``); otherwise the original stays as it was, labelled, and the
record says why.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

from tmax.audit.run import AuditRecord

GRADED = "tmax-graded.sh"
REPORT = "/logs/verifier/tmax-junit.xml"
MARK = "tmax-report:"
RUNTIME_HACKS = {"uv-env": "uv's env file", "path-programs": "the image's PATH programs",
                 "lingering-writer": "a reward writer left running"}
_COUNTS = re.compile(MARK + r" tests=(\d+) passed=(\d+) failed=(\d+) errors=(\d+) "
                     r"skipped=(\d+)")
_PYTHON_M = re.compile(r"(?<![\w./-])((?:\S*/)?python3?(?:\.\d+)?)((?:\s+-[A-Za-z]+)*)"
                       r"\s+-m\s+(pytest|unittest)\b")


class NotHardened(Exception):
    """No sound mechanical fix for this task (the reason is the record's)."""


def exploit_only(audit: AuditRecord) -> bool:
    """Whether every ``verifier_too_weak`` finding of ``audit`` is an exploit probe's."""
    weak = [f for f in audit.findings if f.get("label") == "verifier_too_weak"]
    return audit.label == "verifier_too_weak" and audit.labelled_by == "probes" and \
        bool(weak) and all(f.get("probe") == "exploit" for f in weak)


def working_hacks(audit: AuditRecord) -> list[str]:
    """The hacks that scored full reward on their own; ``together`` when only the runtime
    hacks' joint run did."""
    runs = audit.probes.get("exploits", [])
    alone = [r["hacks"][0] for r in runs if len(r.get("hacks", [])) == 1
             and r.get("reward") is not None and r["reward"] >= 1.0]
    joint = [r for r in runs if len(r.get("hacks", [])) > 1
             and r.get("reward") is not None and r["reward"] >= 1.0]
    return sorted(set(alone)) or (["together"] if joint else [])


def _lines(text: str) -> list[str]:
    """test.sh's logical lines, continuations joined, comments dropped where they split."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        if words:
            out.append(" ".join(words))
    return out


def pytest_runs(text: str) -> int:
    """How many lines of ``text`` start pytest (a word ``pytest`` / ``py.test`` or a path
    ending so, not an install or a ``--with pytest==...`` requirement)."""
    n = 0
    for line in _lines(text):
        words = line.split()
        if "install" in words:
            continue
        if any(w in ("pytest", "py.test") or w.endswith(("/pytest", "/py.test"))
               for w in words):
            n += 1
    return n


def plan(tests_dir: Path, hacks: list[str], steps: bool = False) -> list[str]:
    """The fixes for ``hacks`` (``report`` and/or ``isolate``); ``NotHardened`` saying why
    when one has none."""
    if not hacks:
        raise NotHardened("no exploit run scored 1 on its own: nothing to harden")
    if steps:
        raise NotHardened("a multi-step task: its steps' verifiers are not hardened "
                          "mechanically")
    script = tests_dir / "test.sh"
    text = script.read_text(errors="replace") if script.is_file() else ""
    others = "".join(p.read_text(errors="replace") for p in sorted(tests_dir.glob("*.sh"))
                     if p.name != "test.sh")
    fixes = []
    for hack in hacks:
        if hack in RUNTIME_HACKS or hack == "together":
            what = RUNTIME_HACKS.get(hack, "the runtime hacks together")
            raise NotHardened(f"the {hack} hack ({what}) is the runtime's to hold, not the "
                              "verifier's: audit on a runtime that holds it (sandfleet's "
                              "local runtime does)")
        if hack == "python-m":
            if not _PYTHON_M.search(text):
                raise NotHardened("the python-m hack passes but test.sh starts no "
                                  "python -m pytest/unittest to isolate")
            fixes.append("isolate")
        elif hack == "exit-on-import":
            runs = pytest_runs(text + "\n" + others)
            if re.search(r"\bPYTEST_ADDOPTS\b|--junit-?xml\b", text + others):
                raise NotHardened("test.sh sets its own PYTEST_ADDOPTS or JUnit report: "
                                  "the report cannot be added without changing them")
            if runs == 0:
                raise NotHardened("the tests do not run under pytest (unittest or another "
                                  "runner that writes no report): no report to grade "
                                  "from; only the verifier's author can grade from one or "
                                  "run the agent's code in a subprocess")
            if runs > 1:
                raise NotHardened(f"test.sh runs pytest {runs} times: one report cannot "
                                  "stand for several runs")
            fixes.append("report")
        else:
            raise NotHardened(f"no mechanical fix for the {hack} hack")
    return sorted(set(fixes))


def isolate(tests_dir: Path) -> list[str]:
    """``python3 -m pytest`` -> ``python3 -P -m pytest`` in test.sh (and unittest)."""
    script = tests_dir / "test.sh"
    text = script.read_text()
    new = _PYTHON_M.sub(lambda m: f"{m.group(1)}{m.group(2)} -P -m {m.group(3)}"
                        if "P" not in m.group(2) else m.group(0), text)
    if new == text:
        return []
    _write(script, new)
    return [("tests/test.sh: python -m pytest/unittest runs with -P (no working directory "
             "on sys.path)")]


def gate_script(tests: int = 0, passed: int = 0) -> str:
    """The wrapper test.sh: ``tests`` / ``passed``: the reference run's counts (0 before
    they are known)."""
    return f"""#!/bin/bash
# Hardened by tmax repair: the tests imported the agent's code and the reward
# trusted the runner's exit status (os._exit(0) on import passed). The original verifier
# is tests/{GRADED}, run unchanged; pytest writes a JUnit XML report for it, and its reward
# stands only where the report agrees (reference run: {tests} tests, {passed} passed).
mkdir -p /logs/verifier
rm -f {REPORT}
printf -v PYTEST_ADDOPTS '%s' --junitxml={REPORT}
export PYTEST_ADDOPTS
/bin/bash /tests/{GRADED} "$@"
status=$?
unset PYTEST_ADDOPTS
min_tests={tests}
min_passed={passed}
attr() {{ printf ' %s' "$tag" | sed -n "s/.* $1=\\"\\([0-9]*\\)\\".*/\\1/p"; }}
tag=""
if [ -f {REPORT} ] && [ ! -L {REPORT} ]; then
    tag=$(tr '\\n' ' ' < {REPORT} | sed -n 's/.*<testsuite \\([^>]*\\)>.*/\\1/p')
fi
t=$(attr tests); f=$(attr failures); e=$(attr errors); s=$(attr skipped)
t=${{t:-0}}; f=${{f:-0}}; e=${{e:-0}}; s=${{s:-0}}
p=$((t - f - e - s))
echo "{MARK} tests=$t passed=$p failed=$f errors=$e skipped=$s"
full=0
reward=""
if [ -f /logs/verifier/reward.txt ]; then
    reward=$(tr -d ' \\n\\r\\t' < /logs/verifier/reward.txt)
elif [ -f /logs/verifier/reward.json ]; then
    reward=$(tr -d ' \\n\\r\\t' < /logs/verifier/reward.json | sed -n 's/.*"reward":\\([0-9.eE+-]*\\).*/\\1/p')
fi
case "$reward" in 1|1.|1.0*|+1|+1.0*) full=1 ;; esac
why=""
if [ -z "$tag" ]; then why="no report at {REPORT}"
elif [ "$t" -lt "$min_tests" ]; then why="$t tests collected, the reference run had $min_tests"
elif [ "$p" -lt 1 ]; then why="no test passed"
elif [ "$full" = 1 ] && [ $((f + e)) -gt 0 ]; then why="$f failed and $e errored"
elif [ "$full" = 1 ] && [ "$p" -lt "$min_passed" ]; then why="$p passed, the reference run had $min_passed"
fi
if [ -n "$why" ]; then
    echo "{MARK} the reward does not stand: $why"
    if [ -f /logs/verifier/reward.txt ] || [ ! -f /logs/verifier/reward.json ]; then
        echo 0 > /logs/verifier/reward.txt
    else
        echo '{{"reward": 0}}' > /logs/verifier/reward.json
    fi
fi
exit $status
"""


def add_report(tests_dir: Path) -> list[str]:
    """Move test.sh to tests/tmax-graded.sh and write the gate in its place (counts 0)."""
    script, graded = tests_dir / "test.sh", tests_dir / GRADED
    if graded.exists():
        raise NotHardened(f"tests/{GRADED} exists already")
    shutil.copy2(script, graded)
    _write(script, gate_script())
    return [f"tests/test.sh moved to tests/{GRADED} (unchanged)",
            (f"tests/test.sh: a wrapper that asks pytest for a JUnit report ({REPORT}) and "
             "keeps the reward only where the report agrees")]


def set_counts(tests_dir: Path, tests: int, passed: int) -> str:
    _write(tests_dir / "test.sh", gate_script(tests, passed))
    return f"tests/test.sh: the reference run's counts ({tests} tests, {passed} passed)"


def reference_counts(checks_log: str) -> tuple[int, int]:
    """``(tests, passed)`` the gate printed in the oracle run of a build-time checks log;
    ``NotHardened`` when it printed none (pytest wrote no report for the oracle)."""
    oracle = checks_log.split("## oracle", 1)[-1] if "## oracle" in checks_log else ""
    found = _COUNTS.findall(oracle)
    if not found:
        raise NotHardened("the reference run left no JUnit report (pytest did not run, or "
                          "the report option did not reach it)")
    tests, passed, failed, errors, _ = (int(x) for x in found[-1])
    if failed or errors or passed < 1:
        raise NotHardened(f"the reference run's report shows {passed} passed, {failed} "
                          f"failed, {errors} errors")
    return tests, passed


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(path.stat().st_mode & 0o7777 if path.exists() else 0o755)
    tmp.replace(path)


__all__ = ["GRADED", "REPORT", "NotHardened", "add_report", "exploit_only", "gate_script",
           "isolate", "plan", "pytest_runs", "reference_counts", "set_counts", "working_hacks"]
