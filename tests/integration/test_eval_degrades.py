"""Evaluation that degrades gracefully: tasks that cannot run are skipped with their reasons
(``--strict`` refuses instead), and a verifier that could not grade (it wrote no reward)
is a ``verifier_error`` (a task problem: not scored in evaluation, masked in training),
never a reward of 0; a reward it wrote stands (``tmax.tasks.grading``).

The task folders are copies of example tasks under their own names, so they use the example
store's images (a task image does not depend on tests/ or task.toml); a store of this test's
own holds hard links to those images, with the manifest entries a case needs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import EXAMPLES
from tmax.agent.config import AgentConfig, load_agent_config
from tmax.agent.policies.simple import OraclePolicy
from tmax.eval.cli import eval_cmd, report_cmd
from tmax.eval.runner import read_skipped, run_eval, skipped_path
from tmax.eval.summary import format_tables, summarize
from tmax.fleet import open_fleet
from tmax.images.store import ImageStore
from tmax.rollout.run import (
    NEEDS_NETWORK,
    VERIFIER_TIMEOUT,
    ImageMissing,
    TaskImages,
    grade_problem,
)
from tmax.rollout.trajectory import Trajectory, read_jsonl
from tmax.tasks import load_task

UNMAPPED = "FROM registry.example.invalid/no-such-image:1\nWORKDIR /app\n"


def copy_task(src: str, dest: Path, *, test_sh: str | None = None,
              toml_extra: str = "", dockerfile: str | None = None) -> Path:
    """An example task copied to ``dest`` (its name is the task id), with changes."""
    shutil.copytree(EXAMPLES / src, dest)
    if test_sh is not None:
        (dest / "tests" / "test.sh").write_text(test_sh)
    if toml_extra:
        with (dest / "task.toml").open("a") as f:
            f.write(toml_extra)
    if dockerfile is not None:
        (dest / "environment" / "Dockerfile").write_text(dockerfile)
    return dest


def store_with(root: Path, example_store: ImageStore, entries: dict[str, dict]) -> ImageStore:
    """A store holding the example images of ``entries`` (task id -> manifest changes)."""
    store = ImageStore(root)
    manifest = example_store.read()
    chosen = {}
    for task_id, change in entries.items():
        entry = manifest.tasks[task_id]
        target = store.path(entry.sif)
        if not target.exists():
            os.link(example_store.path(entry.sif), target)
        data = entry.model_dump()
        for key, value in change.items():
            data[key] = {**(data[key] or {}), **value} if isinstance(value, dict) else value
        chosen[task_id] = type(entry).model_validate(data)
    store.update(lambda m: m.tasks.update(chosen))
    return store


def invoke(*args: str):
    out = CliRunner().invoke(eval_cmd, [*args, "--no-progress"])
    assert "Traceback" not in out.output, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception
    return out


# ---- reading a verifier's output (real lines from real tasks' verifiers, offline)


APT = """Ign:1 http://deb.debian.org/debian bookworm InRelease
Err:1 http://deb.debian.org/debian bookworm InRelease
  Temporary failure resolving 'deb.debian.org'
Reading package lists...
W: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease  Temporary failure resolving 'deb.debian.org'
E: Unable to locate package curl
/tests/test.sh: line 6: curl: command not found
/tests/test.sh: line 8: /root/.local/bin/env: No such file or directory
/tests/test.sh: line 11: uvx: command not found"""
UV = """error: Request failed after 3 retries
  Caused by: error sending request for url (https://pypi.org/simple/pytest/)
  Caused by: client error (Connect)
  Caused by: dns error: failed to lookup address information: Temporary failure in name resolution"""
PIP = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) "
       "after connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection."
       "HTTPSConnection object at 0x7f2b>: Failed to establish a new connection: [Errno 101] "
       "Network is unreachable')': /simple/pytest/\n"
       "ERROR: Could not find a version that satisfies the requirement pytest")


def test_a_verifier_that_needed_the_network_is_recognised_from_its_output():
    assert grade_problem(APT, network=False) == \
        f"{NEEDS_NETWORK}: Temporary failure resolving 'deb.debian.org'"
    assert grade_problem("curl: (6) Could not resolve host: astral.sh", network=False) == \
        f"{NEEDS_NETWORK}: curl: (6) Could not resolve host: astral.sh"
    assert grade_problem(UV, network=False).startswith(f"{NEEDS_NETWORK}: Caused by: dns error")
    gradle = ('Exception in thread "main" java.net.UnknownHostException: services.gradle.org'
              "\n\tat org.gradle.wrapper.Install.forceFetch(SourceFile:2)")  # a real task's
    assert grade_problem(gradle, network=False) == f"{NEEDS_NETWORK}: " \
        'Exception in thread "main" java.net.UnknownHostException: services.gradle.org'
    pip = grade_problem(PIP, network=False)
    assert pip.startswith(f"{NEEDS_NETWORK}: ...") and "Network is unreachable" in pip
    assert len(pip) < 220
    # the task has network: a lookup that failed is not "needs network"; a missing runner is
    assert grade_problem(APT, network=True) == \
        "verifier could not run: /tests/test.sh: line 11: uvx: command not found"
    assert grade_problem("sh: 1: python: not found", network=False) == \
        "verifier could not run: sh: 1: python: not found"
    # what an agent's unfinished work looks like is not a verifier problem
    for agents_fault in ("curl: (7) Failed to connect to localhost port 8080: Connection refused",
                         "curl: (6) Could not resolve host: api",  # a name set up in the task
                         "FAILED test_outputs.py::test_hello - AssertionError", ""):
        assert grade_problem(agents_fault, network=False) is None, agents_fault


# ---- skipping tasks that cannot run, without a fleet


def test_strict_refuses_before_running_and_lists_every_reason(tmp_path):
    tasks = tmp_path / "tasks"
    copy_task("hello-world-file", tasks / "hello-world-file")  # not built in this store
    copy_task("hello-world-file", tasks / "odd-base", dockerfile=UNMAPPED)
    copy_task("hello-world-file", tasks / "bad-toml", toml_extra="memory_mbb = 1\n")
    common = ["--tasks", str(tasks), "--policy", "oracle", "--store", str(tmp_path / "store"),
              "--fleet", str(tmp_path / "no-fleet")]  # never reached
    out = invoke(*common, "--strict", "--out", str(tmp_path / "strict"))
    assert out.exit_code != 0 and "3 of 3 tasks cannot run (--strict" in out.output
    assert "bad-toml [invalid_task]" in out.output and "memory_mbb" in out.output
    assert "odd-base [unmapped_base]: no local base for image" in out.output
    assert "hello-world-file [image_missing]" in out.output
    assert "tmax tasks validate" in out.output and "tmax images build" in out.output
    assert not (tmp_path / "strict").exists()
    out = invoke(*common, "--out", str(tmp_path / "lenient"))
    assert out.exit_code != 0 and "no task can run; all were skipped" in out.output
    assert not (tmp_path / "lenient").exists()


def test_an_unmapped_base_in_a_rollout_is_a_missing_image_not_a_crash(tmp_path):
    task = load_task(copy_task("hello-world-file", tmp_path / "odd-base", dockerfile=UNMAPPED))
    with pytest.raises(ImageMissing, match="no image can be planned: no local base"):
        TaskImages(tmp_path / "store").resolve(task)


# ---- through a real fleet


@pytest.mark.slow
@pytest.mark.sandbox
def test_eval_skips_what_cannot_run_and_runs_the_rest(example_store, example_fleet, tmp_path):
    tasks = tmp_path / "tasks"
    for name in ("hello-world-file", "count-log-lines", "sha256-digest", "sqlite-count-rows"):
        copy_task(name, tasks / name)
    copy_task("hello-world-file", tasks / "odd-base", dockerfile=UNMAPPED)
    copy_task("hello-world-file", tasks / "bad-toml", toml_extra="memory_mbb = 1\n")
    failed = {"ok": False, "reason": "the reference solution scores 0.0, not 1"}
    store = store_with(tmp_path / "store", example_store, {
        "hello-world-file": {}, "count-log-lines": {},
        "sha256-digest": {"checks": failed}})  # sqlite-count-rows: not built here
    out_dir = tmp_path / "run"
    common = ["--tasks", str(tasks), "--policy", "oracle", "--fleet", str(example_fleet.state),
              "--store", str(store.root)]

    strict = invoke(*common, "--strict", "--out", str(out_dir))
    assert strict.exit_code != 0 and "4 of 6 tasks cannot run (--strict" in strict.output
    assert not out_dir.exists()

    out = invoke(*common, "--out", str(out_dir))
    assert out.exit_code == 0, out.output
    assert "skipping 4 of 6 tasks" in out.output
    assert "SKIPPED 4 tasks: checks_failed 1, image_missing 1, invalid_task 1, " \
           "unmapped_base 1" in out.output
    assert "sha256-digest [checks_failed]: build-time checks failed: the reference " \
           "solution scores 0.0, not 1" in out.output
    assert "mean reward  1.000" in out.output
    records = list(read_jsonl(out_dir / "results.jsonl"))
    assert sorted((r["task"], r["reward"]) for r in records) == \
        [("count-log-lines", 1.0), ("hello-world-file", 1.0)]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["n_tasks"] == 2 and summary["mean_reward"] == 1.0
    assert {(s["task"], s["kind"]) for s in summary["skipped"]} == {
        ("bad-toml", "invalid_task"), ("odd-base", "unmapped_base"),
        ("sqlite-count-rows", "image_missing"), ("sha256-digest", "checks_failed")}
    assert all(s["reason"] for s in summary["skipped"])
    assert [s.task for s in read_skipped(out_dir / "results.jsonl")] == \
        [s["task"] for s in json.loads(skipped_path(out_dir / "results.jsonl").read_text())
         ["skipped"]]

    # the missing image built and the checks fixed: the same --out resumes and runs them
    store_with(store.root, example_store, {"sqlite-count-rows": {},
                                           "sha256-digest": {"checks": {"ok": True,
                                                                        "reason": ""}}})
    again = invoke(*common, "--out", str(out_dir))
    assert again.exit_code == 0, again.output
    assert "skipping 2 of 6 tasks" in again.output
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["n_tasks"] == 4 and summary["skipped_kinds"] == {"invalid_task": 1,
                                                                   "unmapped_base": 1}
    report = CliRunner().invoke(report_cmd, [str(out_dir)])
    assert report.exit_code == 0 and "SKIPPED 2 tasks" in report.output, report.output


NEEDS_CURL = """#!/bin/bash
# The verifier boilerplate, offline: uv's installer cannot be fetched, uvx is not there, and
# the script ends before it writes a reward.
echo "curl: (6) Could not resolve host: astral.sh" >&2
echo "/tests/test.sh: line 8: uvx: command not found" >&2
exit 127
echo 1 > /logs/verifier/reward.txt
"""
REAL_LOOKUP = """#!/bin/bash
# A real lookup of a package index from the sandbox (it has no network), then the
# boilerplate's "0 unless the tests passed".
mkdir -p /logs/verifier
python3 -c "import urllib.request; urllib.request.urlopen('https://pypi.org/simple/', timeout=10)"
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
NO_REWARD = """#!/bin/bash
echo 'ran the tests'
[ -e /nowhere ] && echo 1 > /logs/verifier/reward.txt
exit 0
"""


def evaluate(tasks, store, fleet, path, *, trials):
    async def go():
        async with open_fleet(fleet.state) as client:
            return await run_eval(tasks, OraclePolicy(), client, TaskImages(store.root),
                                  load_agent_config(), trials=trials, concurrency=4,
                                  results_path=path, progress=False)

    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_verifier_that_could_not_grade_is_a_verifier_error_not_a_failure(
        example_store, example_fleet, tmp_path):
    root = tmp_path / "tasks"
    tasks = [load_task(copy_task("hello-world-file", root / "hello-world-file",
                                 test_sh=NEEDS_CURL)),
             load_task(copy_task("count-log-lines", root / "count-log-lines",
                                 test_sh=REAL_LOOKUP)),
             load_task(copy_task("sha256-digest", root / "sha256-digest", test_sh=NO_REWARD)),
             load_task(copy_task("sqlite-count-rows", root / "sqlite-count-rows"))]
    records = evaluate(tasks, example_store, example_fleet, tmp_path / "r.jsonl", trials=2)
    by_task = {}
    for r in records:
        by_task.setdefault(r.task, []).append(r)
    assert sorted(by_task) == sorted(t.task_id for t in tasks)
    assert all(len(v) == 2 for v in by_task.values())  # nothing was re-run
    for r in records:
        assert r.infra_failure is None, (r.task, r.infra_failure)
    for r in by_task["hello-world-file"]:
        assert r.reward is None and r.verifier_error == (
            f"{NEEDS_NETWORK}: curl: (6) Could not resolve host: astral.sh; wrote no "
            "reward.txt or reward.json (test.sh exited 127)")
    for r in by_task["count-log-lines"]:  # it wrote 0, no runner failed to start: it stands
        assert (r.reward, r.verifier_error) == (0.0, None), r.verifier_output
        assert r.grading_note.startswith(f"the output shows: {NEEDS_NETWORK}: "), \
            r.grading_note
    for r in by_task["sha256-digest"]:
        assert r.reward is None
        assert r.verifier_error == "wrote no reward.txt or reward.json"
    assert [r.reward for r in by_task["sqlite-count-rows"]] == [1.0, 1.0]

    s = summarize(records)
    assert s["pass_at_k"] == {1: 0.5, 2: 0.5} and s["mean_reward"] == 0.5
    assert s["n_tasks"] == 2 and s["episodes"] == 8 and s["scored_episodes"] == 4
    assert s["verifier_errors"] == 4 and s["verifier_error_causes"] == {
        NEEDS_NETWORK: 2, "wrote no reward.txt or reward.json": 2}
    assert s["unscored"] == [] and s["infra_failures"] == 0
    assert s["outcomes"] == {"scored": 4, "verifier_error": 4} and s["graded_with_notes"] == 2
    assert f"verifier errors 4/8 episodes (task problems, not scored): {NEEDS_NETWORK} 2" \
        in format_tables(s)


HANGS = """#!/bin/bash
# What the agent left never returns under the tests (a real task's tests hung like this
# when the agent's program was missing).
mkdir -p /logs/verifier
sleep 60
echo 1 > /logs/verifier/reward.txt
"""
HANGS_OFFLINE = """#!/bin/bash
echo "curl: (6) Could not resolve host: astral.sh" >&2
sleep 60
echo 0 > /logs/verifier/reward.txt
"""


def with_verifier_timeout(task_dir: Path, seconds: int) -> Path:
    toml = task_dir / "task.toml"
    text = toml.read_text()
    assert "[verifier]\ntimeout_sec = 60.0\n" in text
    toml.write_text(text.replace("[verifier]\ntimeout_sec = 60.0\n",
                                 f"[verifier]\ntimeout_sec = {seconds}\n"))
    return task_dir


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_verifier_timeout_scores_0_even_where_the_output_shows_no_network(
        example_store, example_fleet, tmp_path):
    """An agent can make the tests hang on purpose: a timeout is its 0 (never a masked
    error); a lookup that failed offline goes into the grading note."""
    root = tmp_path / "tasks"
    tasks = [load_task(with_verifier_timeout(copy_task("hello-world-file",
                                                       root / "hello-world-file",
                                                       test_sh=HANGS), 2)),
             load_task(with_verifier_timeout(copy_task("count-log-lines",
                                                       root / "count-log-lines",
                                                       test_sh=HANGS_OFFLINE), 2))]
    by_task = {r.task: r for r in evaluate(tasks, example_store, example_fleet,
                                           tmp_path / "r.jsonl", trials=1)}
    hung, offline = by_task["hello-world-file"], by_task["count-log-lines"]
    assert (hung.reward, hung.policy_failure, hung.verifier_error, hung.scored) == \
        (0.0, VERIFIER_TIMEOUT, None, True)
    assert (offline.reward, offline.policy_failure, offline.verifier_error) == \
        (0.0, VERIFIER_TIMEOUT, None)
    assert offline.grading_note == (f"the output shows: {NEEDS_NETWORK}: curl: (6) Could not "
                                    "resolve host: astral.sh; a timeout scores 0")
    s = summarize(list(by_task.values()))
    assert s["scored_episodes"] == 2 and s["mean_reward"] == 0.0
    assert s["policy_failures"] == {VERIFIER_TIMEOUT: 2} and s["verifier_errors"] == 0


# ---- training: a verifier error carries no advantage


def test_a_verifier_error_is_masked_in_training(monkeypatch):
    from tmax.train import rollouts

    outcomes = iter([{"reward": 1.0}, {"reward": 0.0},
                     {"reward": None, "verifier_error": f"{NEEDS_NETWORK}: x"}])

    async def fake_rollout(task, policy, fleet, images, config, *, trial):
        return Trajectory(task=task.task_id, policy="p", trial=trial, **next(outcomes))

    monkeypatch.setattr(rollouts, "rollout", fake_rollout)

    class Task:
        task_id = "t"

    async def go():
        sampler = rollouts.GroupSampler([Task()], OraclePolicy(), None, None, AgentConfig(),
                                        group_size=3, groups_per_step=1, concurrency=3,
                                        async_steps=0, abort_after_infra=2)
        sampler.infra_streak = 1
        await sampler._group(Task(), 0)
        return sampler

    sampler = asyncio.run(go())
    assert sampler.error is None
    (group,) = sampler.ready
    assert group.advantages.advantages == (0.5, -0.5, None)
    assert group.advantages.n_valid == 2 and group.advantages.kept
    assert sampler.infra_streak == 0  # the fleet worked: not an infrastructure failure
