"""Test reports a verifier asked its runner for, read to check a full reward against them.

Harbor's and Terminal-Bench 2.0's boilerplate runs ``pytest --ctrf /logs/verifier/ctrf.json``
and writes reward 1 when pytest exits 0. An exit status is easy to forge (a ``uvx`` shell
function, a ``pytest.py`` in the working directory, every test skipped); the report pytest
writes is the tests' own account. ``contradiction(tests, logs)`` says why a reward of 1
does not hold against the reports test.sh asked for, or None.

Formats read (from the host copy of /logs/verifier, never through a link, at most
``MAX_REPORT_BYTES``):

- **CTRF** JSON (``--ctrf PATH``, pytest-json-ctrf): ``results.summary`` counts and
  ``results.tests[].status``;
- **JUnit XML** (``--junitxml PATH`` / ``--junit-xml PATH``, pytest's own; also what most
  other runners write): ``<testsuite>`` / ``<testcase>`` with ``<failure>``, ``<error>``,
  ``<skipped>``.

A report contradicts a reward of 1 when it is missing or unreadable, shows no test that
passed (none collected, all skipped or deselected), or shows a test that failed or
errored. Skipped tests beside passing ones do not (skip markers are common in legitimate
suites). Only reports requested under /logs/verifier are read (the verifier's own folder,
which the agent cannot write); a report elsewhere, and a verifier that asks for none, leave
the reward as the exit status gave it.
"""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath

from tmax.tasks.reward import VerifierError, _read_regular

LOGS = PurePosixPath("/logs/verifier")
MAX_REPORT_BYTES = 16 << 20
_FLAGS = {"--ctrf": "ctrf", "--junitxml": "junit", "--junit-xml": "junit"}


def requested(tests: Path) -> list[tuple[str, str]]:
    """``(format, path in the sandbox)`` of each report the verifier scripts in ``tests``
    (test.sh, then the other top-level ``*.sh``) ask for; format ``ctrf`` or ``junit``."""
    found: list[tuple[str, str]] = []
    scripts = [tests / "test.sh", *sorted(p for p in tests.glob("*.sh") if p.name != "test.sh")]
    for script in scripts:
        try:
            text = script.read_text(errors="replace") if script.is_file() else ""
        except OSError:
            continue
        for line in text.replace("\\\n", " ").splitlines():
            for kind, path in _flags(line):
                if (kind, path) not in found:
                    found.append((kind, path))
    return found


def _flags(line: str) -> list[tuple[str, str]]:
    """The report flags of one shell line, its words split as the shell would (comments
    dropped); a line that does not split is not read."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    out = []
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag not in _FLAGS:
            continue
        path = value if eq else (words[i + 1] if i + 1 < len(words) else "")
        if path:
            out.append((_FLAGS[flag], path))
    return out


def contradiction(tests: Path | None, logs: Path) -> str | None:
    """Why the reports the verifier asked for contradict a reward of 1 (``logs``: the host
    copy of /logs/verifier), or None when they agree or none can be read."""
    if tests is None or not tests.is_dir():
        return None
    for kind, path in requested(tests):
        where = PurePosixPath(path)
        if not where.is_absolute() or LOGS not in where.parents:
            continue  # not the verifier's own folder: not ours to read
        local = logs / where.relative_to(LOGS)
        try:
            text = _read_regular(local, "", MAX_REPORT_BYTES)
        except (VerifierError, OSError) as e:
            return f"{path}: unreadable ({e})"
        if text is None:
            return f"test.sh asked for a {kind} report at {path}; there is none"
        problem = (_ctrf if kind == "ctrf" else _junit)(text)
        if problem:
            return f"{path}: {problem}"
    return None


def _ctrf(text: str) -> str | None:
    try:
        results = json.loads(text)["results"]
        summary, tests = results.get("summary") or {}, results.get("tests") or []
    except (ValueError, KeyError, TypeError, AttributeError):
        return "not a CTRF report"
    statuses = [str(t.get("status", "")) for t in tests if isinstance(t, dict)]
    failed = sum(s == "failed" for s in statuses) or _int(summary.get("failed"))
    passed = sum(s == "passed" for s in statuses) if statuses else _int(summary.get("passed"))
    if failed:
        return f"{failed} of {len(statuses) or _int(summary.get('tests'))} tests failed"
    if not passed:
        return f"no test passed ({len(statuses) or _int(summary.get('tests'))} reported)"
    return None


def _junit(text: str) -> str | None:
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        return f"not JUnit XML ({e})"
    cases = list(root.iter("testcase"))
    bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    ran = [c for c in cases if c.find("skipped") is None and c not in bad]
    suite_errors = sum(_int(s.get("errors")) for s in root.iter("testsuite")) if not cases \
        else 0
    if bad or suite_errors:
        return f"{len(bad) or suite_errors} of {len(cases)} tests failed or errored"
    if not ran:
        return f"no test passed ({len(cases)} reported)"
    return None


def _int(value: object) -> int:
    try:
        return int(value) if isinstance(value, (int, float, str)) else 0
    except (ValueError, OverflowError):  # "x", nan, inf
        return 0


__all__ = ["MAX_REPORT_BYTES", "contradiction", "requested"]
