"""One grading decision (``tmax.tasks.grading.decide``) for build-time checks, evaluation,
training rollouts and the audit: a verifier that wrote a reward has graded; only one that
wrote none, or whose test runner never started, is a verifier error.

The outputs are the Harbor / Terminal-Bench 2.0 boilerplate's lines as it runs offline
(apt-get and the uv installer fail, the prepared uvx runs the tests); the sandbox tests at
the end run the unmodified boilerplate of examples/harbor in its built image."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tmax.tasks.grading import COULD_NOT_RUN, NEEDS_NETWORK, decide, runner_ran

OFFLINE_SETUP = """\
Ign:1 http://deb.debian.org/debian bookworm InRelease
Err:1 http://deb.debian.org/debian bookworm InRelease
  Temporary failure resolving 'deb.debian.org'
W: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease  Temporary failure resolving 'deb.debian.org'
E: Unable to locate package curl
curl: (6) Could not resolve host: astral.sh
/tests/test.sh: line 8: /root/.local/bin/env: No such file or directory
"""
FAILING = """\
============================= test session starts ==============================
platform linux -- Python 3.13.5, pytest-8.4.1, pluggy-1.6.0
rootdir: /tests
plugins: json-ctrf-0.3.5
collected 3 items

../tests/test_outputs.py F..                                             [100%]

=================================== FAILURES ===================================
FAILED ../tests/test_outputs.py::test_report_exists - AssertionError
========================= 1 failed, 2 passed in 0.05s ==========================
"""
PASSING = FAILING.replace("F..", "...").replace(
    "========================= 1 failed, 2 passed in 0.05s ==========================",
    "============================== 3 passed in 0.04s ===============================")
UNPREPARED = """\
  × No solution found when resolving tool dependencies:
  ╰─▶ Because pytest-timeout was not found in the cache and you require
      pytest-timeout==2.3.1, we can conclude that your requirements are unsatisfiable.

      hint: Packages were unavailable because the network was disabled. When the network
      is disabled, registry packages may only be read from the cache.
"""


def logs(tmp_path: Path, reward: str | None, *extra: str) -> Path:
    d = tmp_path / "verifier"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    if reward is not None:
        (d / "reward.txt").write_text(reward + "\n")
    for name in extra:
        (d / name).write_text("{}")
    return d


def grade(tmp_path, output, reward, *extra, exit_code=0, timed_out=False, network=False):
    return decide("t", output=output, exit_code=exit_code, timed_out=timed_out,
                  timeout_s=60, logs=logs(tmp_path, reward, *extra), network=network)


def test_the_boilerplate_offline_with_failing_tests_scores_0(tmp_path):
    g = grade(tmp_path, OFFLINE_SETUP + FAILING, "0", "ctrf.json")
    assert (g.reward, g.error, g.timed_out) == (0.0, "", False)
    # the apt / curl lines did not decide it, and the grade says what they were
    assert g.note == (f"the output shows: {NEEDS_NETWORK}: Temporary failure resolving "
                      "'deb.debian.org'; the reward the verifier wrote stands")


def test_the_boilerplate_offline_with_passing_tests_scores_1(tmp_path):
    g = grade(tmp_path, OFFLINE_SETUP + PASSING, "1", "ctrf.json")
    assert (g.reward, g.error, g.note) == (1.0, "", "")


def test_a_uvx_line_needing_a_package_nobody_prepared_is_a_verifier_error(tmp_path):
    g = grade(tmp_path, OFFLINE_SETUP + UNPREPARED, "0")
    assert g.reward is None
    assert g.error == (f"{NEEDS_NETWORK}: × No solution found when resolving tool "
                       "dependencies:; the 0 it wrote is not the tests'")
    # with the network the task asked for, the same is still no verdict of the tests
    g = grade(tmp_path, UNPREPARED, "0", network=True)
    assert g.reward is None and g.error.startswith(f"{COULD_NOT_RUN}: ")


def test_a_runner_that_was_not_found_is_a_verifier_error_unless_another_ran(tmp_path):
    missing = OFFLINE_SETUP + "/tests/test.sh: line 11: uvx: command not found\n"
    g = grade(tmp_path, missing, "0")
    assert g.reward is None
    assert g.error.startswith(f"{COULD_NOT_RUN}: /tests/test.sh: line 11: uvx: command")
    # a fallback runner that ran (its session, or a report it left): the 0 is the tests'
    assert grade(tmp_path, missing + FAILING, "0").reward == 0.0
    assert grade(tmp_path, missing, "0", "ctrf.json").reward == 0.0
    assert grade(tmp_path, "/usr/bin/python3: No module named pytest\n", "0").reward is None


def test_no_reward_is_an_error_that_says_why_where_the_output_does(tmp_path):
    g = grade(tmp_path, OFFLINE_SETUP, None, exit_code=127)
    assert g.reward is None and g.error == (
        f"{NEEDS_NETWORK}: Temporary failure resolving 'deb.debian.org'; wrote no "
        "reward.txt or reward.json (test.sh exited 127)")
    assert grade(tmp_path, PASSING, None).error == "wrote no reward.txt or reward.json"


def test_an_ambiguous_0_stands_with_a_note(tmp_path):
    """A test whose own lookup failed, no runner that could not start: the 0 stands (the
    build-time checks make sure the reference solution scores 1 the same way)."""
    out = "urllib.error.URLError: <urlopen error [Errno -3] Temporary failure in name " \
          "resolution>\n"
    g = grade(tmp_path, out, "0")
    assert g.reward == 0.0 and g.error == ""
    assert g.note.startswith(f"the output shows: {NEEDS_NETWORK}: urllib.error.URLError")
    # a partial reward is the tests' too
    assert grade(tmp_path, OFFLINE_SETUP + UNPREPARED, "0.5").reward == 0.5


def test_a_timeout_scores_0_whatever_the_output_shows(tmp_path):
    """What the agent left can hang the tests on purpose: never a masked error."""
    g = grade(tmp_path, OFFLINE_SETUP, None, exit_code=124, timed_out=True)
    assert (g.reward, g.timed_out, g.error) == (0.0, True, "test.sh timed out after 60 s")
    assert g.note.startswith(f"the output shows: {NEEDS_NETWORK}: Temporary failure")


def test_what_shows_a_runner_ran():
    assert runner_ran(FAILING) and runner_ran(PASSING)
    assert runner_ran("....\n----------------------------------------------------------"
                      "------------\nRan 4 tests in 0.002s\n\nOK\n")
    assert runner_ran("=================== no tests ran in 0.01s ===================")
    assert not runner_ran(OFFLINE_SETUP + UNPREPARED)
    assert not runner_ran("echo collected 3 items is not at the start of the line: "
                          "x collected 3 items")
