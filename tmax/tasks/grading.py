"""The grading decision: what a verifier's run gave, read one way everywhere.

Build-time checks (``tmax.images.checks``), ``tmax eval``, training rollouts and the audit's
probes all run test.sh through a runtime's ``verify`` and hand what came back (its output,
exit status, whether it timed out, the /logs/verifier it left) to ``decide``; nothing else
turns a verifier's run into a reward or an error, so they cannot disagree.

The rules, in order:

1. **Timed out**: reward 0 (``timed_out``; a rollout's ``policy_failure`` is
   ``verifier_timeout``). What the agent left can hang the tests on purpose, and an error
   would be masked in training where a 0 is not. When the output also shows a lookup that
   failed offline, that goes into ``note``; a verifier that times out on the reference
   solution fails the task's build-time checks instead.
2. **No reward** (no reward.txt / reward.json, a malformed one): an ``error``. Its cause is
   read from the output where it says why (``grade_problem``: ``needs network at grade
   time: <line>``, ``verifier could not run: <line>``), else it is the reader's reason.
3. **A reward the verifier wrote stands.** Whatever else in test.sh failed (the standard
   Harbor / Terminal-Bench 2.0 boilerplate runs ``apt-get install curl`` and the uv
   installer first, which fail offline, harmlessly: the prepared ``uvx`` then runs the
   tests), a reward of 1 or anything above 0 is the tests' verdict.
4. A reward of **0 with evidence that the test runner never started** is an ``error``: the
   runner was not found (``uvx: command not found``, ``No module named pytest``), or the
   tool it needed could not be resolved (uv's ``No solution found when resolving`` or
   ``network was disabled``, pip's ``No matching distribution found``), and nothing shows
   a runner that ran (a pytest session, a unittest summary, a report in /logs/verifier).
   The 0 is the script's fallback, not the tests' verdict.
5. **A reward of 1 that the verifier's own test report contradicts** (test.sh asked pytest
   for ``--ctrf`` / ``--junitxml`` under /logs/verifier, and the report is missing, shows
   no test that passed, or a test that failed: ``tmax.tasks.reports``) scores 0, with
   ``contradicted`` saying why (a rollout's ``policy_failure`` is ``contradicted_reward``):
   an exit status can be forged, the report is the tests' own account.
6. **Ambiguous**: a 0 whose output shows the network missing (an apt or curl line, a test
   whose own lookup failed) but no runner that could not start: the 0 stands and ``note``
   says what the output showed. The build-time checks guard this: a verifier that cannot
   grade offline scores the reference solution 0 there, and such a task is not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from sandfleet import cap_output
from tmax.tasks.reports import contradiction
from tmax.tasks.reward import VerifierError, read_metrics, read_reward

NEEDS_NETWORK = "needs network at grade time"
COULD_NOT_RUN = "verifier could not run"
VERIFIER_TIMEOUT = "verifier_timeout"
"""``policy_failure`` of a rollout whose test.sh ran past its timeout (reward 0)."""
CONTRADICTED = "contradicted_reward"
"""``policy_failure`` of a rollout whose reward of 1 its test report contradicts (scored 0)."""
OUTPUT_TAIL = 4000
GRADE_WINDOW = 65536
"""What of test.sh's output is read: its head and tail within this many bytes, as a fleet's
verify reply keeps it (``sandfleet.worker``), so a check that reads the runtime's output
directly reads the same evidence as a rollout through the fleet."""


@dataclass
class Grade:
    """What a verifier run gave: a reward, or why there is none (``error``)."""

    reward: float | None
    error: str = ""
    output: str = ""
    """The last 4,000 characters of test.sh's output."""
    metrics: dict[str, float] = field(default_factory=dict)
    """reward.json's numbers, when it wrote one."""
    timed_out: bool = False
    """test.sh ran past its timeout: the reward is 0 (``VERIFIER_TIMEOUT``)."""
    contradicted: str = ""
    """Why the verifier's own test report contradicts the reward of 1 it wrote (rule 5):
    the grade is 0."""
    note: str = ""
    """Evidence that did not decide the grade (rule 6), e.g. ``the output shows: needs
    network at grade time: ...; the reward the verifier wrote stands``."""


_OFFLINE_SIGNS = re.compile(
    r"Could not resolve host:? '?(?P<curl>[^\s',]+)"     # curl, git
    r"|Temporary failure resolving '(?P<apt>[^']+)'"     # apt
    r"|Could not resolve '(?P<apt_old>[^']+)'"           # older apt
    r"|unable to resolve host address '(?P<wget>[^']+)'"  # wget
    r"|getaddrinfo (?:EAI_AGAIN|ENOTFOUND) (?P<node>[^\s:]+)"  # npm, node
    r"|Temporary failure in name resolution"             # glibc: python, pip, uv, wget
    r"|dns error"                                        # uv
    r"|java\.net\.UnknownHostException: (?P<java>[^\s:]+)"  # Java: gradle, maven
    r"|Network is unreachable",                          # any client, no route out
    re.IGNORECASE)
_RUNNER_MISSING = re.compile(r"\b(?:uvx|uv|pytest|pip3?|python3?): (?:command )?not found\b"
                             r"|No module named '?pytest\b")
# The tool a test runner needed could not be had: uv (offline, or a registry it could not
# reach) and pip. Lines of the runner's own setup, never of a test.
_RUNNER_UNRESOLVED = re.compile(
    r"No solution found when resolving"
    r"|Packages were unavailable because the network was disabled"
    r"|was not found in the cache"
    r"|error: Failed to (?:fetch|download)"
    r"|error: Request failed after \d+ retries"
    r"|Caused by: dns error"
    r"|No matching distribution found for"
    r"|Could not find a version that satisfies the requirement")
# A test runner that ran: pytest's session header and summary, unittest's summary.
_RUNNER_RAN = re.compile(
    r"^=+ test session starts =+$"
    r"|^collected \d+ items?"
    r"|^=+ .*\b(?:passed|failed|errors?|skipped|xfailed|xpassed|no tests ran)\b.* in "
    r"[\d.]+s(?: \([\d:]+\))? =+$"
    r"|^Ran \d+ tests? in [\d.]+s$",
    re.MULTILINE)
REPORTS = ("ctrf.json", "junit.xml", "results.xml", "report.xml", "test-results.xml")


def decide(task_id: str, *, output: str, exit_code: int, timed_out: bool, timeout_s: float,
           logs: Path, network: bool, tests: Path | None = None) -> Grade:
    """The grade of one verifier run (the module doc's rules): test.sh's ``output``,
    ``exit_code`` and ``timed_out`` (after ``timeout_s``), the host copy of the
    /logs/verifier it left (``logs``), whether the task has the network, and the tests/
    it ran (``tests``: where test.sh says which reports it asked for)."""
    if len(output.encode()) > GRADE_WINDOW + 64:  # a capped reply is left as it is
        output = cap_output(output.encode(), GRADE_WINDOW)
    tail = output[-OUTPUT_TAIL:]
    if timed_out:
        note = grade_problem(output, network=network)
        return Grade(0.0, f"test.sh timed out after {timeout_s:g} s", tail, timed_out=True,
                     note=f"the output shows: {note}; a timeout scores 0" if note else "")
    try:
        reward = read_reward(logs, task_id)
    except VerifierError as e:
        error = e.reason + (f" (test.sh exited {exit_code})" if exit_code else "")
        problem = grade_problem(output, network=network)
        return Grade(None, f"{problem}; {error}" if problem else error, tail)
    metrics = read_metrics(logs, task_id)
    if reward >= 1.0 and (why := contradiction(tests, logs)):
        return Grade(0.0, "", tail, metrics, contradicted=why)
    if reward > 0:
        return Grade(reward, "", tail, metrics)
    if not runner_ran(output, logs) and (failed := runner_failed(output, network=network)):
        return Grade(None, f"{failed}; the {reward:g} it wrote is not the tests'", tail)
    problem = grade_problem(output, network=network)
    note = f"the output shows: {problem}; the reward the verifier wrote stands" \
        if problem else ""
    return Grade(reward, "", tail, metrics, note=note)


def runner_ran(output: str, logs: Path | None = None) -> bool:
    """Whether the output (or a test report in ``logs``) shows a test runner that ran."""
    if _RUNNER_RAN.search(output):
        return True
    return logs is not None and any((logs / name).is_file() for name in REPORTS)


def runner_failed(output: str, *, network: bool) -> str | None:
    """Why the test runner could not start, from the output; None when nothing says so.
    ``verifier could not run: <line>`` for a runner not found; for one whose tools could
    not be resolved, ``needs network at grade time: <line>`` (the task has none) or
    ``verifier could not run: <line>``."""
    for line in output.splitlines():
        if missing := _RUNNER_MISSING.search(line):
            return f"{COULD_NOT_RUN}: {_evidence(line, missing)}"
        if unresolved := _RUNNER_UNRESOLVED.search(line):
            return f"{COULD_NOT_RUN if network else NEEDS_NETWORK}: " \
                   f"{_evidence(line, unresolved)}"
    return None


def grade_problem(output: str, *, network: bool) -> str | None:
    """What the output says about a verifier that could not do its job; None when
    nothing in it says so.

    - ``needs network at grade time: <line>`` when the task has no network and a line shows
      a name lookup of a non-local host failing, or no route out (the usual verifier
      boilerplate fetches curl, uv and pytest first). A host without a dot, or localhost,
      does not count: it may be a name the agent was meant to set up.
    - ``verifier could not run: <line>`` when the shell found no uv, uvx, pytest, pip or
      python to run the tests with.
    """
    runner = None
    for line in output.splitlines():
        if not network:
            for sign in _OFFLINE_SIGNS.finditer(line):
                host = next((h for h in sign.groups() if h), None)
                if host is None or _remote(host):
                    return f"{NEEDS_NETWORK}: {_evidence(line, sign)}"
        if runner is None and (missing := _RUNNER_MISSING.search(line)):
            runner = f"{COULD_NOT_RUN}: {_evidence(line, missing)}"
    return runner


def _remote(host: str) -> bool:
    host = host.strip("'\".,;:[]()").lower()
    return "." in host and host != "localhost" and not host.endswith(".localhost")


def _evidence(line: str, match: re.Match) -> str:
    """The line, or ~160 characters of it around ``match`` when it is long."""
    if len(line.strip()) <= 160:
        return " ".join(line.split())
    start, end = max(0, match.start() - 80), match.end() + 40
    return ("..." if start else "") + " ".join(line[start:end].split()) + \
        ("..." if end < len(line) else "")


__all__ = ["CONTRADICTED", "COULD_NOT_RUN", "NEEDS_NETWORK", "VERIFIER_TIMEOUT", "Grade", "decide",
           "grade_problem", "runner_failed", "runner_ran"]
