"""Evaluation: statistics against hand-computed values; `run_eval` through a real local fleet
(oracle and nop on every example task, a sandbox killed under its lease, an interrupted and
resumed run); `tmax eval` and `tmax report` from the command line."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import EXAMPLES
from tmax.agent.config import load_agent_config
from tmax.agent.policies.simple import NopPolicy, OraclePolicy
from tmax.eval.cli import eval_cmd, report_cmd
from tmax.eval.report import write_plots
from tmax.eval.runner import EvalError, eval_meta, meta_path, open_results, run_eval
from tmax.eval.summary import format_tables, pass_at_k, summarize
from tmax.fleet import FleetUnavailable, open_fleet
from tmax.rollout.run import TaskImages
from tmax.rollout.trajectory import Trajectory, append_jsonl, read_jsonl
from tmax.tasks import find_tasks, load_task

HELLO = EXAMPLES / "hello-world-file"

# ---- pure statistics


def test_pass_at_k_matches_the_binomial_formula():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(3, 1, 2) == pytest.approx(1 - 1 / 3)  # 1 - C(2,2)/C(3,2)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c/n
    assert pass_at_k(4, 0, 3) == 0.0
    assert pass_at_k(4, 2, 3) == 1.0  # fewer than k failures: some draw always passes
    assert pass_at_k(200, 7, 50) == pytest.approx(1 - math.comb(193, 50) / math.comb(200, 50))
    for bad in ((3, 4, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def rec(task, trial, reward, *, attempt=0, domain="dx", difficulty="hard", infra=None,
        verifier_error=None, policy_failure=None, timings=None, started_at=1000.0):
    return Trajectory(task=task, policy="p", trial=trial, attempt=attempt, reward=reward,
                      domain=domain, difficulty=difficulty, infra_failure=infra,
                      verifier_error=verifier_error, policy_failure=policy_failure,
                      timings=timings or {"queue": 1.0, "agent": 2.0, "total": 4.0},
                      started_at=started_at)


LOST = {"error": "SandboxLost", "cause": "sandbox_lost", "message": "sandbox s1: died"}
RECORDS = [
    rec("a", 0, 1.0, difficulty="easy"),
    rec("a", 1, None, difficulty="easy", infra=LOST, started_at=1001.0),  # re-run below
    rec("a", 1, 0.0, difficulty="easy", attempt=1, started_at=1010.0),
    rec("b", 0, 0.5),
    rec("b", 1, 1.0, timings={"queue": 3.0, "agent": 4.0, "verifier": 1.0, "total": 9.0}),
    rec("c", 0, None, domain="dy", verifier_error="wrote no reward.txt or reward.json"),
    rec("c", 1, 0.0, domain="dy", policy_failure="step_limit"),
]


def test_summarize_against_hand_computed_values():
    s = summarize(RECORDS)
    # scored rewards a: 1, 0; b: 0.5, 1; c: -, 0 (its verifier error is not scored).
    # Task means 0.5, 0.75, 0 -> 5/12. Per-trial means (1 + 0.5)/2 = 0.75 and 1/3.
    assert s["mean_reward"] == pytest.approx(5 / 12)
    # SE over K=2 trials: sample std of (3/4, 1/3) = (5/12)/sqrt(2), over sqrt(2) -> 5/24
    assert s["reward_se"] == pytest.approx(5 / 24) and s["se_over"] == "trials"
    # passes per trial: (1 + 0)/2 and (0 + 1 + 0)/3 -> SE (1/6)/2 = 1/12; per task 1/3
    assert s["pass_rate"] == pytest.approx(1 / 3) and s["pass_se"] == pytest.approx(1 / 12)
    # pass@1 = (1/2 + 1/2 + 0)/3; pass@2 over a and b only (c has one scored trial)
    assert s["pass_at_k"] == pytest.approx({1: 1 / 3, 2: 1.0})
    assert s["trials"] == 2 and s["n_tasks"] == 3 and s["episodes"] == 6
    assert s["scored_episodes"] == 5
    assert s["attempts"] == 7 and s["infra_failures"] == 1
    assert s["infra_failure_rate"] == pytest.approx(1 / 7)
    assert s["infra_causes"] == {"sandbox_lost": 1}
    assert s["verifier_errors"] == 1 and s["policy_failures"] == {"step_limit": 1}
    assert s["verifier_error_causes"] == {"wrote no reward.txt or reward.json": 1}
    assert s["unscored"] == [] and s["skipped"] == []
    dx, dy = s["by_domain"]["dx"], s["by_domain"]["dy"]
    assert (dx["n_tasks"], dx["mean_reward"], dx["pass_rate"]) == (2, 0.625, 0.5)
    # dx per-trial means (1+0.5)/2 = 0.75 and (0+1)/2 = 0.5 -> SE (0.25/sqrt2)/sqrt2 = 0.125
    assert dx["reward_se"] == pytest.approx(0.125)
    assert (dy["n_tasks"], dy["mean_reward"], dy["pass_rate"]) == (1, 0.0, 0.0)
    easy, hard = s["by_difficulty"]["easy"], s["by_difficulty"]["hard"]
    assert (easy["n_tasks"], easy["mean_reward"], easy["pass_rate"]) == (1, 0.5, 0.5)
    assert (hard["n_tasks"], hard["mean_reward"], hard["pass_rate"]) == (2, 0.375, 0.25)
    # phase means over the 6 scored episodes: queue (5*1 + 3)/6, verifier only where timed
    assert s["timings"]["queue"] == pytest.approx(8 / 6)
    assert s["timings"]["verifier"] == pytest.approx(1.0)
    assert s["timings"]["start"] is None
    assert s["wall_s"] == pytest.approx(1010.0 + 4.0 - 1000.0)
    text = format_tables(s)
    assert "0.417 ± 0.208" in text and "1/7 attempts" in text and "sandbox_lost 1" in text
    assert "step_limit 1" in text and "DOMAIN" in text and "DIFFICULTY" in text
    assert "verifier errors 1/6 episodes" in text


def test_one_trial_uses_the_standard_error_over_tasks_and_dicts_work_too():
    s = summarize([rec("a", 0, 1.0).to_dict(), rec("b", 0, 0.0).to_dict(),
                   rec("c", 0, 0.5).to_dict()])
    assert s["mean_reward"] == pytest.approx(0.5) and s["se_over"] == "tasks"
    assert s["reward_se"] == pytest.approx(0.5 / math.sqrt(3))  # std(1, 0, .5) = 0.5
    assert s["pass_at_k"] == pytest.approx({1: 1 / 3})


def test_the_latest_valid_attempt_counts_and_only_infra_failures_leave_a_pair_unscored():
    s = summarize([rec("a", 0, 0.0), rec("a", 0, 1.0, attempt=2),
                   rec("b", 0, None, infra=LOST), rec("b", 0, None, infra=LOST, attempt=1)])
    assert s["mean_reward"] == 1.0 and s["episodes"] == 1 and s["unscored"] == ["b#0"]
    assert s["infra_failure_rate"] == 0.5
    assert s["pass_at_k"] == {1: 1.0}
    assert summarize([rec("a", 0, 0.7)], threshold=0.5)["pass_rate"] == 1.0


def test_plots_are_written(tmp_path):
    paths = write_plots(summarize(RECORDS), RECORDS, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["pass_at_k.png", "phase_times.png",
                                             "reward_by_domain.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


# ---- the results file: metadata, resume, torn tail


def test_a_results_file_of_another_evaluation_is_refused(tmp_path):
    tasks = [load_task(HELLO)]
    config = load_agent_config()
    path = tmp_path / "results.jsonl"
    meta = eval_meta(tasks, OraclePolicy(), config, 2)
    assert open_results(path, meta) == [] and json.loads(meta_path(path).read_text()) == meta
    append_jsonl(path, rec("hello-world-file", 0, 1.0).to_dict())
    assert len(open_results(path, meta)) == 1  # the same evaluation resumes
    with pytest.raises(EvalError, match="policy: \"oracle\" there, \"nop\" now"):
        open_results(path, eval_meta(tasks, NopPolicy(), config, 2))
    with pytest.raises(EvalError, match="agent_config"):
        open_results(path, eval_meta(tasks, OraclePolicy(),
                                     load_agent_config(None, step_limit=3), 2))
    with pytest.raises(EvalError, match="trials"):
        open_results(path, eval_meta(tasks, OraclePolicy(), config, 3))
    meta_path(path).unlink()
    with pytest.raises(EvalError, match="no results.jsonl.meta.json"):
        open_results(path, meta)


def test_a_torn_last_line_is_cut_before_appending(tmp_path):
    path = tmp_path / "results.jsonl"
    meta = {"version": 1, "policy": "p"}
    open_results(path, meta)
    append_jsonl(path, rec("a", 0, 1.0).to_dict())
    with path.open("ab") as f:
        f.write(b'{"task": "b", "tri')
    assert [r.task for r in open_results(path, meta)] == ["a"]
    append_jsonl(path, rec("c", 0, 1.0).to_dict())
    assert [r["task"] for r in read_jsonl(path)] == ["a", "c"]


# ---- command-line errors that need no fleet


def test_eval_explains_bad_input(tmp_path):
    runner = CliRunner()
    out = runner.invoke(eval_cmd, ["--tasks", str(tmp_path / "nothing-*"), "--policy", "oracle"])
    assert out.exit_code != 0 and "no path matches it as a glob" in out.output
    out = runner.invoke(eval_cmd, ["--tasks", str(tmp_path), "--policy", "oracle"])
    assert out.exit_code != 0 and "no task folders there" in out.output
    out = runner.invoke(eval_cmd, ["--tasks", str(HELLO), "--policy", "gpt5"])
    assert out.exit_code != 0 and "unknown policy 'gpt5'" in out.output
    out = runner.invoke(eval_cmd, ["--tasks", str(EXAMPLES / "hello-*"), "--policy", "oracle",
                                   "--store", str(tmp_path / "empty-store"),
                                   "--out", str(tmp_path / "run")])
    assert out.exit_code != 0 and "no task can run" in out.output
    assert "hello-world-file [image_missing]: task hello-world-file: no image" in out.output
    assert "tmax images build" in out.output and "Traceback" not in out.output


def test_a_state_dir_without_a_controller_is_a_clear_error(tmp_path):
    async def go():
        async with open_fleet(tmp_path / "no-fleet"):
            pass

    with pytest.raises(FleetUnavailable, match=f"{tmp_path / 'no-fleet'}.*sandfleet up"):
        asyncio.run(go())


# ---- through a real fleet


def evaluate(policy, tasks, store, fleet, path, *, trials=1, concurrency=4, **kw):
    async def go():
        async with open_fleet(fleet.state) as client:
            return await run_eval(tasks, policy, client, TaskImages(store.root),
                                  load_agent_config(), trials=trials, concurrency=concurrency,
                                  results_path=path, progress=False, **kw)

    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.parametrize("policy,reward", [(OraclePolicy(), 1.0), (NopPolicy(), 0.0)],
                         ids=["oracle", "nop"])
def test_oracle_scores_one_and_nop_zero_on_every_example_task(
        policy, reward, example_store, example_fleet, tmp_path):
    tasks = [load_task(p) for p in find_tasks(EXAMPLES)]
    start = time.monotonic()
    records = evaluate(policy, tasks, example_store, example_fleet, tmp_path / "r.jsonl")
    print(f"{policy.name}: {len(tasks)} tasks at concurrency 4 in "
          f"{time.monotonic() - start:.1f}s")
    assert sorted(r.task for r in records) == sorted(t.task_id for t in tasks)
    wrong = {r.task: (r.reward, r.infra_failure, r.verifier_error, r.verifier_output[-300:])
             for r in records if r.reward != reward}
    assert not wrong
    s = summarize(records)
    assert s["mean_reward"] == reward and s["pass_rate"] == reward
    assert s["infra_failure_rate"] == 0.0 and s["verifier_errors"] == 0
    assert set(s["by_domain"]) == {t.config.metadata.domain for t in tasks}


class KillsOneSandbox:
    """The oracle, except that the first episode of ``victim`` loses its sandbox: its init
    process is SIGKILLed from the host once the lease is granted (a crashed sandbox)."""

    supports_tools = True

    def __init__(self, victim: str, work: Path):
        self.inner, self.name = OraclePolicy(), "oracle"
        self.victim, self.work, self.killed = victim, work, []

    async def complete(self, messages, tools=None):
        return await self.inner.complete(messages, tools)

    async def start_episode(self, episode):
        if episode.task.task_id == self.victim and not self.killed:
            lease = episode.sandbox.lease
            record = next(self.work.glob(f"*/*/runtime/sandboxes/*-{lease.lease_id}"))
            pid = json.loads((record / "sandbox.json").read_text())["init"][0]
            os.kill(pid, signal.SIGKILL)
            self.killed.append(lease.lease_id)
            for _ in range(200):  # its pid namespace is torn down asynchronously
                if not Path(f"/proc/{pid}").exists():  # noqa: ASYNC240 - procfs
                    break
                await asyncio.sleep(0.05)
        await self.inner.start_episode(episode)


@pytest.mark.slow
@pytest.mark.sandbox
def test_an_infrastructure_failure_is_recorded_and_run_again(example_store, example_fleet,
                                                             tmp_path):
    tasks = [load_task(EXAMPLES / n) for n in ("hello-world-file", "count-log-lines")]
    policy = KillsOneSandbox("hello-world-file", example_fleet.work)
    path = tmp_path / "results.jsonl"
    evaluate(policy, tasks, example_store, example_fleet, path)
    assert policy.killed
    hello = [r for r in read_jsonl(path) if r["task"] == "hello-world-file"]
    assert [r["attempt"] for r in hello] == [0, 1]
    assert hello[0]["infra_failure"]["cause"] == "sandbox_lost", hello[0]
    assert hello[0]["reward"] is None
    assert hello[1]["infra_failure"] is None and hello[1]["reward"] == 1.0
    s = summarize(read_jsonl(path))
    assert s["mean_reward"] == 1.0 and s["episodes"] == 2 and s["attempts"] == 3
    assert s["infra_failure_rate"] == pytest.approx(1 / 3)
    assert s["infra_causes"] == {"sandbox_lost": 1}


class SolvesHalf:
    """The oracle on (task index + trial) even, a wrong answer otherwise (no solution is
    copied in, so `bash /solution/solve.sh` fails); counts its episodes."""

    supports_tools = True

    def __init__(self, task_ids: list[str]):
        self.inner, self.name, self.ids, self.episodes = OraclePolicy(), "half", task_ids, []

    async def complete(self, messages, tools=None):
        return await self.inner.complete(messages, tools)

    async def start_episode(self, episode):
        self.episodes.append((episode.task.task_id, episode.trial))
        if (self.ids.index(episode.task.task_id) + episode.trial) % 2 == 0:
            await self.inner.start_episode(episode)


@pytest.mark.slow
@pytest.mark.sandbox
def test_an_interrupted_eval_resumes_to_the_same_summary(example_store, example_fleet,
                                                         tmp_path):
    names = ["hello-world-file", "count-log-lines", "sha256-digest"]
    tasks = [load_task(EXAMPLES / n) for n in names]
    full = tmp_path / "full.jsonl"
    first = SolvesHalf(names)
    expected = summarize(evaluate(first, tasks, example_store, example_fleet, full, trials=2))
    assert len(first.episodes) == 6
    # solved: trial 0 tasks 0 and 2, trial 1 task 1 -> per-trial means 2/3 and 1/3
    assert expected["mean_reward"] == pytest.approx(0.5)
    assert expected["reward_se"] == pytest.approx(1 / 6)
    assert expected["pass_at_k"] == pytest.approx({1: 0.5, 2: 1.0})

    part = tmp_path / "part.jsonl"
    lines = full.read_bytes().splitlines(keepends=True)
    part.write_bytes(b"".join(lines[:2]) + lines[2][:40])  # killed mid-write of record 3
    meta_path(part).write_text(meta_path(full).read_text())
    kept = {(r["task"], r["trial"]) for r in map(json.loads, lines[:2])}
    second = SolvesHalf(names)
    records = evaluate(second, tasks, example_store, example_fleet, part, trials=2)
    assert len(second.episodes) == 4 and not kept & set(second.episodes)
    assert len(records) == 6 and len({(r.task, r.trial) for r in records}) == 6
    got = summarize(records)
    for key in ("mean_reward", "reward_se", "pass_rate", "pass_se", "pass_at_k", "by_domain",
                "by_difficulty", "episodes", "attempts", "infra_failure_rate"):
        assert got[key] == pytest.approx(expected[key]) if isinstance(got[key], float) \
            else got[key] == expected[key], key


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_private_fleet_is_stopped_even_when_the_block_fails(example_store, example_fleet,
                                                              tmp_path):
    from sandfleet import controller_alive, read_controller_info
    from tmax.rollout.run import rollout

    seen = {}

    async def go():
        config = {"cache_dir": str(example_fleet.root / "cache"),
                  "work_dir": str(tmp_path / "work"), "heartbeat_s": 0.3,
                  "lost_after_s": 1.2, "scale_interval_s": 0.3}
        async with open_fleet(None, concurrency=1, config=config) as client:
            seen["state"] = client.state_dir
            seen["info"] = read_controller_info(client.state_dir)
            seen["traj"] = await rollout(load_task(HELLO), OraclePolicy(), client,
                                         TaskImages(example_store.root), load_agent_config())
            raise RuntimeError("the caller fails")

    with pytest.raises(RuntimeError, match="the caller fails"):
        asyncio.run(go())
    assert seen["traj"].reward == 1.0, seen["traj"]
    assert controller_alive(seen["info"]) is False
    assert not seen["state"].exists()
    assert not list((tmp_path / "work").glob("*/*/runtime/sandboxes/*"))


@pytest.mark.slow
@pytest.mark.sandbox
def test_tmax_eval_and_report_from_the_command_line(example_store, example_fleet, tmp_path):
    runner = CliRunner()
    out_dir = tmp_path / "run"
    args = ["--tasks", str(HELLO), "--policy", "oracle", "--fleet", str(example_fleet.state),
            "--store", str(example_store.root), "--out", str(out_dir), "--no-progress"]
    out = runner.invoke(eval_cmd, args)
    assert out.exit_code == 0, out.output
    assert "mean reward  1.000" in out.output and "DOMAIN" in out.output
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["mean_reward"] == 1.0 and summary["episodes"] == 1
    assert json.loads((out_dir / "agent_config.json").read_text())["step_limit"] >= 1
    again = runner.invoke(eval_cmd, args)  # everything done: resumes with nothing to run
    assert again.exit_code == 0, again.output
    assert len((out_dir / "results.jsonl").read_text().splitlines()) == 1
    other = runner.invoke(eval_cmd, [*args[:2], "--policy", "nop", *args[4:]])
    assert other.exit_code != 0 and "holds another evaluation" in other.output

    out = runner.invoke(report_cmd, [str(out_dir / "results.jsonl")])
    assert out.exit_code == 0, out.output
    assert "pass@k       @1 1.000" in out.output
    for name in ("reward_by_domain.png", "pass_at_k.png", "phase_times.png"):
        assert (out_dir / name).read_bytes()[:4] == b"\x89PNG"
