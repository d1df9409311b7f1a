"""TMax's own errors are a third outcome (``internal_error``): neither the policy's failure
nor the infrastructure's, kept with their traceback, never re-run as if a node had failed,
counted in eval summaries and training metrics, and a few of them stop a run."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import EXAMPLES
from tmax.agent.config import AgentConfig, load_agent_config
from tmax.agent.policies.simple import NopPolicy
from tmax.eval.summary import format_tables, summarize
from tmax.rollout.trajectory import Trajectory, internal_error, read_jsonl
from tmax.tasks import load_task


def bug() -> dict:
    try:
        {}["missing"]
    except KeyError as e:
        return internal_error(e)
    raise AssertionError


def test_an_internal_error_is_its_own_outcome_and_keeps_its_traceback():
    t = Trajectory("t", "p", internal_error=bug())
    assert t.internal_error["error"] == "KeyError"
    assert t.internal_error["message"] == "KeyError: 'missing'"
    assert 'in bug\n    {}["missing"]' in t.internal_error["traceback"]
    assert t.valid and not t.scored and t.outcome == "internal_error"
    with pytest.raises(ValueError, match="internal error"):
        _ = t.score
    again = Trajectory.from_dict(t.to_dict())  # it survives the results file
    assert again.internal_error == t.internal_error


def test_the_summary_counts_each_outcome_class_apart():
    records = [Trajectory("a", "p", trial=0, reward=1.0),
               Trajectory("a", "p", trial=1, reward=0.0, policy_failure="step_limit"),
               Trajectory("b", "p", trial=0, verifier_error="wrote no reward.txt or reward.json"),
               Trajectory("b", "p", trial=1, internal_error=bug()),
               Trajectory("c", "p", trial=0, infra_failure={"cause": "sandbox_lost"}),
               Trajectory("c", "p", trial=0, attempt=1, reward=0.0,
                          grading_note="the output shows: needs network at grade time: x")]
    s = summarize(records)
    assert s["outcomes"] == {"scored": 2, "policy_failure": 1, "verifier_error": 1,
                             "internal_error": 1, "infra_failure": 1}
    assert s["internal_errors"] == 1 and s["internal_error_types"] == {"KeyError": 1}
    assert s["internal_error_episodes"] == ["b#1: KeyError: 'missing'"]
    assert s["verifier_errors"] == 1 and s["infra_failures"] == 1
    assert s["scored_episodes"] == 3 and s["graded_with_notes"] == 1
    assert s["mean_reward"] == pytest.approx((0.5 + 0.0) / 2)  # b has no scored episode
    assert "internal errors 1/5 episodes (TMax's own, not scored): KeyError 1" \
        in format_tables(s)


def test_internal_errors_stop_training_and_are_not_infra_failures(monkeypatch):
    from tmax.train import rollouts
    from tmax.train.loop import step_metrics

    async def fake_rollout(task, policy, fleet, images, config, *, trial):
        if trial < 2:
            return Trajectory(task=task.task_id, policy="p", trial=trial, reward=float(trial))
        return Trajectory(task=task.task_id, policy="p", trial=trial, internal_error=bug())

    monkeypatch.setattr(rollouts, "rollout", fake_rollout)

    class Task:
        task_id = "t"

    async def go():
        sampler = rollouts.GroupSampler([Task()], NopPolicy(), None, None, AgentConfig(),
                                        group_size=4, groups_per_step=1, concurrency=4,
                                        async_steps=0, abort_after_infra=2,
                                        max_internal_errors=2)
        sampler.infra_streak = 1
        await sampler._group(Task(), 0)
        with pytest.raises(rollouts.InternalErrors, match=r"2 rollouts ended in an internal "
                                                          r"error .*KeyError: 'missing'"):
            await sampler.next_batch(1, 0)
        return sampler

    sampler = asyncio.run(go())
    assert sampler.infra_streak == 0  # the fleet worked
    (group,) = sampler.ready
    assert group.advantages.advantages == (-0.5, 0.5, None, None)  # masked, as errors are
    metrics = step_metrics(sampler.stats, [group], 0)
    assert metrics["internal_error_rate"] == 0.5
    assert metrics["infra_failure_rate"] == 0.0 and metrics["verifier_error_rate"] == 0.0
    assert metrics["contradicted_reward_rate"] == 0.0
    sampler.stats.rollouts[0].contradicted_reward = "ctrf.json: 1 of 2 tests failed"
    assert step_metrics(sampler.stats, [group], 0)["contradicted_reward_rate"] == 0.5


# ---- through the real rollout boundary and evaluation


class Buggy(NopPolicy):
    """A policy hook that hits a bug, as TMax code in the rollout would."""

    async def start_episode(self, episode):
        raise KeyError("missing")


@pytest.mark.slow
@pytest.mark.sandbox
def test_eval_records_internal_errors_never_reruns_them_and_stops(example_store,
                                                                  example_fleet, tmp_path):
    from tmax.eval.runner import InternalErrors, run_eval
    from tmax.fleet import open_fleet
    from tmax.rollout.run import TaskImages

    names = ["hello-world-file", "count-log-lines", "sha256-digest", "sqlite-count-rows"]
    tasks = [load_task(EXAMPLES / n) for n in names]
    path = tmp_path / "r.jsonl"

    async def go():
        async with open_fleet(example_fleet.state) as client:
            return await run_eval(tasks, Buggy(), client, TaskImages(example_store.root),
                                  load_agent_config(), trials=1, concurrency=1,
                                  results_path=path, progress=False, max_infra_retries=3,
                                  max_internal_errors=2)

    with pytest.raises(InternalErrors, match="stopped after 2 internal errors") as info:
        asyncio.run(go())
    assert "KeyError: 'missing'" in str(info.value) and str(path) in str(info.value)
    records = [Trajectory.from_dict(r) for r in read_jsonl(path)]
    assert len(records) == 2 and [r.attempt for r in records] == [0, 0]  # not re-run
    for r in records:
        assert r.infra_failure is None and r.reward is None
        assert r.internal_error["error"] == "KeyError"
        assert "raise KeyError(\"missing\")" in r.internal_error["traceback"]
    assert summarize(records)["outcomes"] == {"internal_error": 2}
