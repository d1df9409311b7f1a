"""Harbor's multi-step tasks (``[[steps]]``): one sandbox, the steps' instructions in order,
each graded by its own verifier over the task's tests/ merged with the step's; early stops
on ``min_reward``; the task's reward by ``multi_step_reward_strategy``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sandfleet.client import AsyncFleetClient
from tests.conftest import checked_build, passing_checks_log
from tests.unit.test_tasks import make_task
from tmax.tasks import load_task, validate_task
from tmax.tasks.model import Task
from tmax.tasks.steps import StepError, merged_tests, multi_step_reward, parse_steps
from tmax.tasks.validate import parse_task_toml

TOML = """\
schema_version = "1.1"
multi_step_reward_strategy = "mean"

[metadata]
difficulty = "easy"
domain = "file-operations"

[agent]
timeout_sec = 120.0

[environment]
allow_internet = false

[verifier]
timeout_sec = 60.0

[[steps]]
name = "create"
min_reward = 1.0

[[steps]]
name = "count"
min_reward = { exact = 1 }
[steps.verifier]
timeout_sec = 30.0
[steps.verifier.env]
WANT = "3"
[steps.healthcheck]
command = "test -f /app/words.txt"
interval_sec = 0
retries = 1
"""
HELPERS = ("reward() { mkdir -p /logs/verifier; echo \"$1\" > /logs/verifier/reward.txt; "
           "printf '{\"exact\": %s}' \"$1\" > /logs/verifier/reward.json; exit 0; }\n")
FILES = {
    "task.toml": TOML,
    "instruction.md": None,
    "tests/test.sh": None,
    "solution/solve.sh": None,
    "tests/helpers.sh": HELPERS,
    "steps/create/instruction.md": "Write the words alpha and beta, one per line, to "
                                   "/app/words.txt.\n",
    "steps/create/tests/test.sh": "#!/bin/bash\nsource /tests/helpers.sh\n"
                                  "[ \"$(cat /app/words.txt)\" = $'alpha\\nbeta' ] && reward 1\n"
                                  "reward 0\n",
    "steps/create/solution/solve.sh": "#!/bin/bash\nprintf 'alpha\\nbeta\\n' > /app/words.txt\n",
    "steps/count/instruction.md": "Append the word in /app/extra.txt to /app/words.txt, then "
                                  "write the number of lines of /app/words.txt to "
                                  "/app/count.txt.\n",
    "steps/count/workdir/extra.txt": "gamma  \n",
    "steps/count/workdir/setup.sh": "#!/bin/bash\nset -e\ntr -d ' ' < extra.txt > e && "
                                    "mv e extra.txt\nrm -- \"$0\"\n",
    "steps/count/tests/test.sh": "#!/bin/bash\nsource /tests/helpers.sh\n"
                                 "[ \"$(cat /app/count.txt)\" = \"$WANT\" ] && "
                                 "[ ! -e /app/setup.sh ] && reward 1\nreward 0\n",
    "steps/count/solution/solve.sh": "#!/bin/bash\ncat /app/extra.txt >> /app/words.txt\n"
                                     "wc -l < /app/words.txt | tr -d ' ' > /app/count.txt\n",
}


def steps_task(root: Path, name: str = "steps", **overrides) -> Path:
    return make_task(root, name, **(FILES | overrides))


# --------------------------------------------------------------------------- reading


def test_the_reward_of_the_steps_by_strategy():
    assert multi_step_reward([1.0, 0.5, 0.0], 3, "mean") == 0.5
    assert multi_step_reward([1.0, 0.5], 4, None) == 0.375  # mean is the default; 2 not run
    assert multi_step_reward([0.25, 1.0], 2, "final") == 1.0
    assert multi_step_reward([1.0], 2, "final") == 0.0  # the final step never ran
    with pytest.raises(ValueError):
        multi_step_reward([], 0, "mean")


def test_steps_are_read_with_their_settings_and_files(tmp_path):
    task = load_task(steps_task(tmp_path))
    create, count = task.steps
    assert (create.name, create.index, count.name) == ("create", 0, "count")
    assert task.instruction == create.instruction  # the first step's (no top-level one)
    assert (create.agent_timeout_sec, create.verifier_timeout_sec) == (120.0, 60.0)
    assert (count.verifier_timeout_sec, count.verifier_env) == (30.0, {"WANT": "3"})
    assert create.passes(1.0, {}) and not create.passes(0.99, {})
    assert count.passes(0.0, {"exact": 1.0}) and not count.passes(1.0, {})  # on the key
    assert count.healthcheck["command"] == "test -f /app/words.txt"
    merged = merged_tests(task, count, tmp_path / "merged")
    assert sorted(p.name for p in merged.iterdir()) == ["helpers.sh", "test.sh"]
    assert (merged / "test.sh").read_text() == FILES["steps/count/tests/test.sh"]
    assert [p.severity for p in validate_task(task.root)] == []


@pytest.mark.parametrize("override, field, message", [
    ({"task.toml": TOML.replace('name = "count"', 'name = "create"')}, "steps[1].name",
     "two steps are named 'create'"),
    ({"steps/count/instruction.md": "  \n"}, "steps[1].name", "instruction.md is missing"),
    ({"task.toml": TOML.replace("min_reward = 1.0", 'min_reward = "high"')},
     "steps[0].min_reward", "expected a number"),
])
def test_a_step_that_cannot_run_is_an_error_naming_it(tmp_path, override, field, message):
    root = steps_task(tmp_path, **override)
    errors = [p for p in validate_task(root) if p.severity == "error"]
    assert len(errors) == 1 and errors[0].field == field and message in errors[0].message
    config = parse_task_toml((root / "task.toml").read_text(), "steps")
    with pytest.raises(StepError, match=message):
        parse_steps(Task("steps", root, "", config))


def test_a_step_without_a_verifier_or_a_reward_is_an_error(tmp_path):
    root = steps_task(tmp_path, **{"steps/count/tests/test.sh": None})
    assert [(p.file, p.message) for p in validate_task(root) if p.severity == "error"] == \
        [("steps/count/tests/test.sh", "no verifier")]
    helpers = steps_task(tmp_path / "h", **{"tests/helpers.sh": "# none\n"})
    assert {p.message for p in validate_task(helpers) if p.severity == "error"} == \
        {"the test script writes no reward"}


def test_every_steps_verifier_is_prepared_in_the_one_image(tmp_path):
    from tmax.images.build import verifier_plan

    uvx = ("#!/bin/bash\ncurl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh\n"
           "uvx --with pytest==8.4.1 pytest /tests/t.py\necho 1 > /logs/verifier/reward.txt\n")
    task = load_task(steps_task(tmp_path, **{
        "steps/count/tests/test.sh": uvx.replace("8.4.1", "8.3.3")}))
    tools = verifier_plan(task)
    assert tools.uv == "0.9.7" and set(tools.packages) == {"pytest==8.3.3", "pytest"}


# --------------------------------------------------------------------------- running


@pytest.fixture(scope="module")
def steps_store(tmp_path_factory, base_store):
    return checked_build(tmp_path_factory.mktemp("steps"), base_store, steps_task)


@pytest.mark.sandbox
def test_the_checks_run_each_steps_solution_and_verifier_in_one_sandbox(steps_store):
    log = passing_checks_log(*steps_store)
    assert "step create: 0.0 is below min_reward; no more steps" in log  # nop stops early
    assert "## step count" in log and "bash ./setup.sh" in log


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_rollout_goes_through_the_steps_in_one_conversation(steps_store, example_fleet):
    from tmax.agent.config import AgentConfig
    from tmax.agent.policies.simple import SUBMIT_MARKER, ScriptedPolicy
    from tmax.rollout.run import TaskImages, rollout

    store, task, result = steps_store
    assert result.status == "built", result.error
    images = TaskImages(store.root)
    submit = f"echo {SUBMIT_MARKER}"
    create = FILES["steps/create/solution/solve.sh"].splitlines()[1]
    count = FILES["steps/count/solution/solve.sh"].splitlines()[1:]

    def run(replies):
        async def go():
            async with AsyncFleetClient(example_fleet.state) as client:
                return await rollout(task, ScriptedPolicy(replies), client, images,
                                     AgentConfig())
        return asyncio.run(go())

    solved = run([create, submit, *count])
    assert (solved.reward, solved.verifier_error, solved.infra_failure) == (1.0, None, None), \
        solved.verifier_output
    assert solved.reward_metrics == {"step:create": 1.0, "step:count": 1.0}
    users = [m["content"] for m in solved.messages if m["role"] == "user"]
    assert any("/app/extra.txt" in u for u in users)  # step 2's instruction, same history
    half = run([create, submit, "echo 2 > /app/count.txt"])
    assert (half.reward, half.reward_metrics) == (0.5, {"step:create": 1.0, "step:count": 0.0})
    # an agent that breaks what step 2's setup.sh needs loses step 2; it cannot turn that
    # into a verifier error (masked, not 0)
    sabotaged = run([create, "cp /bin/false /usr/bin/rm", submit, *count])
    assert (sabotaged.reward, sabotaged.verifier_error, sabotaged.reward_metrics) == \
        (0.5, None, {"step:create": 1.0})
    stopped = run(["true"])  # step 1 fails its min_reward: step 2 never runs
    assert (stopped.reward, stopped.reward_metrics) == (0.0, {"step:create": 0.0})
    # a reply whose first tool call submits: the second gets an answer too, so the history
    # the next step goes on from is one a chat endpoint accepts
    two_calls = {"content": "", "tool_calls": [
        {"name": "bash", "arguments": {"command": submit}},
        {"name": "bash", "arguments": {"command": "rm -f /app/words.txt"}}]}
    both = run([create, two_calls, *count])
    assert both.reward == 1.0, both.verifier_output
    asked = [c["id"] for m in both.messages if m["role"] == "assistant"
             for c in m.get("tool_calls", [])]
    answered = [m["tool_call_id"] for m in both.messages if m["role"] == "tool"]
    assert sorted(asked) == sorted(answered) and len(asked) == len(set(asked))
    assert "[not run: the episode ended first]" in [m["content"] for m in both.messages]


@pytest.mark.slow
@pytest.mark.sandbox
def test_the_oracle_runs_each_steps_solution_as_the_checks_do(steps_store, example_fleet,
                                                               tmp_path):
    """No task-level solution/ (only one per step): the oracle's episode scores what the
    checks' oracle scored, in evaluation too, and nop what their nop scored."""
    from tmax.agent.config import load_agent_config
    from tmax.agent.policies.choose import make_policy
    from tmax.eval.runner import run_eval
    from tmax.eval.summary import summarize
    from tmax.rollout.run import TaskImages

    store, task, result = steps_store
    assert not task.has_solution and result.status == "built", result.error
    checks = store.read().tasks[task.task_id].checks

    def evaluate(policy):
        async def go():
            async with AsyncFleetClient(example_fleet.state) as client:
                return await run_eval([task], make_policy(policy), client,
                                      TaskImages(store.root), load_agent_config(), trials=1,
                                      concurrency=1, results_path=tmp_path / f"{policy}.jsonl",
                                      progress=False)
        return asyncio.run(go())

    (oracle,) = evaluate("oracle")
    assert (oracle.reward, oracle.outcome) == (checks.oracle_reward, "scored") == (1.0, "scored"), \
        (oracle.internal_error, oracle.verifier_output)
    assert oracle.reward_metrics == {"step:create": 1.0, "step:count": 1.0}
    (nop,) = evaluate("nop")
    assert (nop.reward, nop.reward_metrics) == (checks.nop_reward, {"step:create": 0.0}) == \
        (0.0, {"step:create": 0.0})
    assert summarize([nop])["outcomes"] == summarize([oracle])["outcomes"] == {"scored": 1}


def test_a_multi_step_task_round_trips_through_harbors_layout(tmp_path):
    """No top-level instruction.md appears (the steps hold the instructions), and one the
    task has is kept as one of its files."""
    from tests.harbor_cases import files_of
    from tmax.tasks import read_any, write_task

    src = steps_task(tmp_path / "src")
    harbor = write_task(read_any(src), tmp_path / "harbor", layout="harbor")
    back = write_task(read_any(harbor.root), tmp_path / "back")
    assert files_of(back.root) == files_of(src) and not (back.root / "instruction.md").exists()
    assert back.config == load_task(src).config
    assert [s.name for s in back.steps] == ["create", "count"]
    with_own = steps_task(tmp_path / "own", **{"instruction.md": "Three steps follow.\n"})
    again = write_task(read_any(with_own), tmp_path / "again")
    assert (again.root / "instruction.md").read_text() == "Three steps follow.\n"
