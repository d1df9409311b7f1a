"""One grading decision (``tmax.tasks.grading.decide``) for build-time checks, evaluation,
training rollouts and the audit: a verifier that wrote a reward has graded; only one that
wrote none, or whose test runner never started, is a verifier error.

The outputs are the Harbor / Terminal-Bench 2.0 boilerplate's lines as it runs offline
(apt-get and the uv installer fail, the prepared uvx runs the tests); the sandbox tests at
the end run the unmodified boilerplate of examples/harbor in its built image."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.test_harbor_examples import harbor_store  # noqa: F401 - a fixture used here
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


def test_a_long_output_is_read_as_a_fleets_verify_reply_keeps_it(tmp_path):
    """Checks read the runtime's output, rollouts the fleet's reply (head and tail within
    64 KiB): both are read through the same window, so they grade alike."""
    from sandfleet.runtime.base import cap_output
    from sandfleet.worker import VERIFY_OUTPUT_BYTES

    middle = "E   AssertionError: a long traceback line of a failing test\n" * 4000
    full = OFFLINE_SETUP + FAILING.replace("=" * 30 + " FAILURES", middle + "= FAILURES")
    reply = cap_output(full.encode(), VERIFY_OUTPUT_BYTES)
    assert len(reply) < len(full) and "bytes cut" in reply
    direct, fleet = grade(tmp_path, full, "0"), grade(tmp_path, reply, "0")
    assert direct == fleet and direct.reward == 0.0
    assert direct.note.startswith(f"the output shows: {NEEDS_NETWORK}: ")  # from the head


def test_what_shows_a_runner_ran():
    assert runner_ran(FAILING) and runner_ran(PASSING)
    assert runner_ran("....\n----------------------------------------------------------"
                      "------------\nRan 4 tests in 0.002s\n\nOK\n")
    assert runner_ran("=================== no tests ran in 0.01s ===================")
    assert not runner_ran(OFFLINE_SETUP + UNPREPARED)
    assert not runner_ran("echo collected 3 items is not at the start of the line: "
                          "x collected 3 items")


# ---- a reward of 1 the verifier's own report contradicts


BOILERPLATE = """#!/bin/bash
uvx \\
  --with pytest==8.4.1 \\
  --with pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def ctrf(*statuses: str) -> str:
    tests = [{"name": f"test_{i}", "status": s, "duration": 1} for i, s in enumerate(statuses)]
    summary = {"tests": len(statuses), **{k: statuses.count(k) for k in
                                          ("passed", "failed", "skipped", "pending", "other")}}
    return json.dumps({"results": {"tool": {"name": "pytest"}, "summary": summary,
                                   "tests": tests}})


def junit(*cases: str) -> str:
    body = "".join(f'<testcase classname="t" name="c{i}">{c}</testcase>'
                   for i, c in enumerate(cases))
    return (f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
            f'tests="{len(cases)}">{body}</testsuite></testsuites>')


def make_tests(tmp_path: Path, script: str) -> Path:
    d = tmp_path / "tests"
    d.mkdir(exist_ok=True)
    (d / "test.sh").write_text(script)
    return d


def graded(tmp_path, script, reward, reports: dict[str, str]):
    d = logs(tmp_path, reward)
    for name, text in reports.items():
        (d / name).write_text(text)
    return decide("t", output=PASSING, exit_code=0, timed_out=False, timeout_s=60, logs=d,
                  network=False, tests=make_tests(tmp_path, script))


def test_which_reports_test_sh_asks_for(tmp_path):
    from tmax.tasks.reports import requested

    script = BOILERPLATE + ("# pytest --ctrf /logs/verifier/commented.json\n"
                            "python3 -m pytest --junitxml=/logs/verifier/junit.xml -q x\n"
                            "pytest --junit-xml '/logs/verifier/b c.xml'\n"
                            "pytest --ctrf report.json\n")
    assert requested(make_tests(tmp_path, script)) == [
        ("ctrf", "/logs/verifier/ctrf.json"), ("junit", "/logs/verifier/junit.xml"),
        ("junit", "/logs/verifier/b c.xml"), ("ctrf", "report.json")]


def test_a_reward_of_1_stands_where_the_report_agrees(tmp_path):
    g = graded(tmp_path, BOILERPLATE, "1", {"ctrf.json": ctrf("passed", "passed", "skipped")})
    assert (g.reward, g.contradicted) == (1.0, "")
    script = "pytest --junitxml=/logs/verifier/junit.xml\n"
    assert graded(tmp_path, script, "1", {"junit.xml": junit("", "<skipped/>")}).reward == 1.0
    # no report asked for, or one outside the verifier's folder: the exit status stands
    assert graded(tmp_path, "pytest /tests\n", "1", {}).reward == 1.0
    assert graded(tmp_path, "pytest --ctrf /tmp/ctrf.json\n", "1", {}).reward == 1.0


@pytest.mark.parametrize("reports,why", [
    ({}, "test.sh asked for a ctrf report at /logs/verifier/ctrf.json; there is none"),
    ({"ctrf.json": ctrf("passed", "failed")}, "/logs/verifier/ctrf.json: 1 of 2 tests failed"),
    ({"ctrf.json": ctrf("skipped", "skipped")},
     "/logs/verifier/ctrf.json: no test passed (2 reported)"),
    ({"ctrf.json": ctrf()}, "/logs/verifier/ctrf.json: no test passed (0 reported)"),
    ({"ctrf.json": "{}"}, "/logs/verifier/ctrf.json: not a CTRF report"),
], ids=["missing", "failed", "all-skipped", "none-collected", "not-ctrf"])
def test_a_reward_of_1_the_ctrf_report_contradicts_scores_0(tmp_path, reports, why):
    g = graded(tmp_path, BOILERPLATE, "1", reports)
    assert (g.reward, g.error, g.contradicted) == (0.0, "", why)


def test_junit_reports_are_read_too(tmp_path):
    script = "python3 -m pytest --junitxml=/logs/verifier/junit.xml /tests\n"
    g = graded(tmp_path, script, "1", {"junit.xml": junit("", '<failure message="x"/>')})
    assert (g.reward, g.contradicted) == \
        (0.0, "/logs/verifier/junit.xml: 1 of 2 tests failed or errored")
    g = graded(tmp_path, script, "1", {"junit.xml": junit("<skipped/>")})
    assert g.contradicted == "/logs/verifier/junit.xml: no test passed (1 reported)"
    assert graded(tmp_path, script, "1", {"junit.xml": "<oops"}).contradicted.startswith(
        "/logs/verifier/junit.xml: not JUnit XML")


def test_every_report_of_several_is_read_and_a_link_is_not_followed(tmp_path):
    script = ("pytest --ctrf /logs/verifier/ctrf_core.json /tests/test_core.py\n"
              "pytest --ctrf /logs/verifier/ctrf_more.json /tests/test_more.py\n")
    g = graded(tmp_path, script, "1", {"ctrf_core.json": ctrf("passed"),
                                       "ctrf_more.json": ctrf("passed", "failed")})
    assert g.contradicted == "/logs/verifier/ctrf_more.json: 1 of 2 tests failed"
    d = logs(tmp_path, "1")
    (d / "ctrf.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(ctrf("passed"))
    g = decide("t", output="", exit_code=0, timed_out=False, timeout_s=60, logs=d,
               network=False, tests=make_tests(tmp_path, BOILERPLATE))
    assert g.reward == 0.0 and "symlink" in g.contradicted


def test_a_partial_or_zero_reward_is_not_checked_against_the_report(tmp_path):
    assert graded(tmp_path, BOILERPLATE, "0.5", {}).reward == 0.5
    assert graded(tmp_path, BOILERPLATE, "0", {}).reward == 0.0


# ---- in real sandboxes: the unmodified boilerplate of examples/harbor, offline


@pytest.fixture(scope="module")
def harbor(harbor_store):  # noqa: F811
    """(store, tasks) of the built examples/harbor images (their checks passed)."""
    from tests.integration.test_harbor_examples import HARBOR, TASKS
    from tmax.tasks import load_task

    store, results = harbor_store
    failed = {n: r.error for n, r in results.items() if r.status == "failed"}
    assert not failed, failed
    return store, [load_task(HARBOR / n) for n in TASKS]


def grade_in_sandbox(fleet, store, task, tests: Path | None = None, before: str = ""):
    """test.sh (``tests``: another tests/ folder) graded in a fresh sandbox of the task's
    image, after ``before`` ran there as the agent, by the rollouts' own ``grade``."""
    import asyncio

    from sandfleet.client import AsyncFleetClient
    from tmax.rollout.run import DEFAULT_PATH, LeaseShell, TaskImages, grade
    from tmax.tasks.environment import PROBE, parse_probe

    images = TaskImages(store.root)
    sif, workdir = images.resolve(task)
    env = task.config.environment

    async def go():
        async with AsyncFleetClient(fleet.state) as client, client.lease(
                sif, cpus=env.cpus, memory_mb=env.memory_mb, storage_mb=env.storage_mb,
                network=env.network, workdir=workdir, user=images.user(task)) as lease:
            shell = LeaseShell(lease, images.verifier_user(task))
            image_env = parse_probe((await shell.run(PROBE, 30)).output)
            if before:
                await shell.run(before, 60)
            return await grade(task, shell, workdir, image_env.get("PATH") or DEFAULT_PATH,
                               tests, image_env)

    return asyncio.run(go())


def changed_tests(task, tmp_path: Path, old: str, new: str) -> Path:
    dest = tmp_path / "tests"
    shutil.copytree(task.tests_dir, dest)
    script = (dest / "test.sh").read_text()
    assert old in script
    (dest / "test.sh").write_text(script.replace(old, new))
    return dest


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.timeout(3600)
def test_check_and_eval_agree_on_the_boilerplate_offline(harbor, example_fleet, tmp_path):
    """nop's failing tests score 0 (not "needs network"), the oracle's passing tests 1,
    in evaluation as in the build-time checks."""
    import asyncio

    from sandfleet.client import AsyncFleetClient
    from tmax.agent.config import load_agent_config
    from tmax.agent.policies.choose import make_policy
    from tmax.eval.runner import run_eval
    from tmax.eval.summary import summarize
    from tmax.rollout.run import TaskImages

    store, tasks = harbor
    manifest = store.read().tasks
    for policy in ("nop", "oracle"):
        async def go(policy=policy):
            async with AsyncFleetClient(example_fleet.state) as client:
                return await run_eval(tasks, make_policy(policy), client,
                                      TaskImages(store.root), load_agent_config(), trials=1,
                                      concurrency=3, results_path=tmp_path / f"{policy}.jsonl",
                                      progress=False)

        records = asyncio.run(go())
        for r in records:
            checked = getattr(manifest[r.task].checks, f"{policy}_reward")
            assert (r.reward, r.outcome) == (checked, "scored"), \
                (policy, r.task, r.verifier_error, r.verifier_output[-1500:])
            if policy == "nop" and r.task == "fix-order-report":  # its apt said so; the
                # 0 stands (it was "needs network at grade time" before)
                assert r.grading_note == (f"the output shows: {NEEDS_NETWORK}: Temporary "
                                          "failure resolving 'archive.ubuntu.com'; the reward "
                                          "the verifier wrote stands"), r.verifier_output
        s = summarize(records)
        assert s["outcomes"] == {"scored": 3} and s["verifier_errors"] == 0
        assert s["mean_reward"] == (1.0 if policy == "oracle" else 0.0)


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_uvx_line_nobody_prepared_is_a_verifier_error_in_the_sandbox(harbor, example_fleet,
                                                                         tmp_path):
    store, tasks = harbor
    task = next(t for t in tasks if t.task_id == "prune-backups")
    tests = changed_tests(task, tmp_path, "--with pytest==8.4.1",
                          "--with pytest==8.4.1 --with pytest-timeout==2.3.1")
    g = grade_in_sandbox(example_fleet, store, task, tests)
    assert g.reward is None, g.output
    assert g.error.startswith(f"{NEEDS_NETWORK}: ") and "the 0 it wrote is not the tests'" \
        in g.error, g.error


@pytest.mark.slow
@pytest.mark.sandbox
def test_an_exit_status_the_report_contradicts_scores_0_in_the_sandbox(harbor, example_fleet,
                                                                        tmp_path):
    """The effect of a forged uvx (a shell function that returns 0): the
    boilerplate writes 1, pytest never wrote its report."""
    store, tasks = harbor
    task = next(t for t in tasks if t.task_id == "prune-backups")
    tests = changed_tests(task, tmp_path, "uvx \\\n", "uvx() { return 0; }\nuvx \\\n")
    g = grade_in_sandbox(example_fleet, store, task, tests)
    assert (g.reward, g.error) == (0.0, ""), g.output
    assert g.contradicted == ("test.sh asked for a ctrf report at /logs/verifier/ctrf.json; "
                              "there is none")
