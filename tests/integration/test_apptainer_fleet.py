"""A fleet whose workers run sandboxes on the real Apptainer (``runtime: apptainer``), and
an evaluation of every shipped example task through it: the oracle scores 1 and nop 0,
with no infrastructure failure and no verifier error (the verifier in a fresh container of
each task's SIF, tests/integration/test_apptainer_real.py tests it at the runtime)."""

from __future__ import annotations

import pytest

from tests.conftest import EXAMPLES
from tests.fleet_harness import Fleet
from tests.integration.test_eval import evaluate
from tmax.agent.policies.simple import NopPolicy, OraclePolicy
from tmax.eval.summary import summarize
from tmax.tasks import find_tasks, load_task

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def apptainer_fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("apptainer-fleet")
    # heartbeats as a real fleet sets them: every apptainer call is a process tree of its
    # own (nsenter, apptainer's starter), and a 2-core machine shared with other jobs can
    # stall a worker for more than tests/fleet_harness.FAST's 1.2 s
    with Fleet(root, root / "cache", runtime="apptainer", apptainer_allow_root=True, min_nodes=1, cpus_per_node=8,
               memory_mb_per_node=16384, heartbeat_s=2.0, lost_after_s=30.0,
               lease_ttl_s=120, acquire_wait_s=120).running() as fleet:
        yield fleet


@pytest.mark.parametrize("policy,reward", [(OraclePolicy(), 1.0), (NopPolicy(), 0.0)],
                         ids=["oracle", "nop"])
def test_every_example_task_scores_through_an_apptainer_fleet(
        policy, reward, example_store, apptainer_fleet, tmp_path):
    tasks = [load_task(p) for p in find_tasks(EXAMPLES)]
    records = evaluate(policy, tasks, example_store, apptainer_fleet, tmp_path / "r.jsonl",
                       concurrency=4)
    assert sorted(r.task for r in records) == sorted(t.task_id for t in tasks)
    wrong = {r.task: (r.reward, r.infra_failure, r.verifier_error, r.verifier_output[-300:])
             for r in records if r.reward != reward}
    assert not wrong
    s = summarize(records)
    assert s["mean_reward"] == reward
    assert s["infra_failure_rate"] == 0.0 and s["verifier_errors"] == 0
    # nor did the fleet see any (a lease whose instance was down for its verify was
    # reported sandbox_lost, though the episode scored)
    status = apptainer_fleet.status()
    assert status["failures"] == {}, status["recent_failures"]
