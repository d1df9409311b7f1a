"""The agent harness and the rollout, in real sandboxes of a real local fleet."""

from __future__ import annotations

import asyncio
import json

import pytest

from sandfleet.client import AsyncFleetClient
from tests.conftest import EXAMPLES
from tmax.agent.config import AgentConfig, AgentConfigError, load_agent_config
from tmax.agent.harness import FormatError, parse_text_command, truncate
from tmax.agent.policies.choose import PolicySpecError, make_policy
from tmax.agent.policies.simple import ScriptedPolicy
from tmax.agent.policy import PolicyUnavailable
from tmax.rollout.run import TaskImages, rollout
from tmax.rollout.trajectory import Trajectory, Turn, append_jsonl, read_jsonl
from tmax.tasks.native import load_task

SUBMIT = "echo TMAX_TASK_COMPLETE"
HELLO = "echo 'hello world' > /app/hello.txt"


# ---- pure parts

def test_truncate_keeps_head_and_tail_and_says_what_was_cut():
    text = "a" * 10 + "b" * 100 + "c" * 10
    out = truncate(text, 10, 10)
    assert out == "a" * 10 + "\n[... 100 characters cut ...]\n" + "c" * 10
    assert truncate("short", 10, 10) == "short"


@pytest.mark.parametrize("reply, expected", [
    ("I will look.\n```bash\nls -la /app\n```", "ls -la /app"),
    ("```\ncat a | wc -l\n```", "cat a | wc -l"),
    ("```bash\nfor f in *; do\n  echo $f\ndone\n```", "for f in *; do\n  echo $f\ndone"),
])
def test_text_protocol_takes_exactly_one_block(reply, expected):
    assert parse_text_command(reply) == expected


@pytest.mark.parametrize("reply", ["no block at all", "```bash\nls\n```\n```bash\npwd\n```",
                                   "```bash\n   \n```"])
def test_text_protocol_rejects_zero_two_or_empty_blocks(reply):
    with pytest.raises(FormatError):
        parse_text_command(reply)


def test_agent_config_is_strict_and_the_shipped_one_loads(tmp_path):
    assert load_agent_config().step_limit == 64
    bad = tmp_path / "agent.yaml"
    bad.write_text("step_limit: 64\nstep_limt: 3\n")
    with pytest.raises(AgentConfigError, match="step_limt"):
        load_agent_config(bad)
    with pytest.raises(PolicySpecError, match="choose one of"):
        make_policy("gpt-17")


def test_sequences_merge_turns_that_extend_each_other():
    t = Trajectory(task="t", policy="p", turns=[
        Turn([1, 2], [3, 4], [-0.1, -0.2]),
        Turn([1, 2, 3, 4, 5, 6], [7], [-0.3]),   # prompt = previous + observation 5, 6
        Turn([9], [10], [-0.4]),                  # not an extension: a new sequence
    ])
    assert t.sequences() == [
        ([1, 2, 3, 4, 5, 6, 7], [0, 0, -0.1, -0.2, 0, 0, -0.3], [0, 0, 1, 1, 0, 0, 1]),
        ([9, 10], [0, -0.4], [0, 1]),
    ]


def test_jsonl_reader_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "r.jsonl"
    append_jsonl(path, {"a": 1})
    append_jsonl(path, {"a": 2})
    with path.open("ab") as f:
        f.write(b'{"a": 3, "tor')
    assert list(read_jsonl(path)) == [{"a": 1}, {"a": 2}]


# ---- episodes in real sandboxes

class Recording:
    """Wraps a policy and keeps the histories it was shown."""

    def __init__(self, policy):
        self.policy, self.seen = policy, []
        self.name, self.supports_tools = policy.name, policy.supports_tools

    async def complete(self, messages, tools=None):
        self.seen.append(json.loads(json.dumps(messages)))
        return await self.policy.complete(messages, tools)


@pytest.fixture(scope="module")
def images(example_store):
    return TaskImages(example_store.root)


def run(fleet, images, policy, *, task="hello-world-file", **config) -> Trajectory:
    async def go():
        async with AsyncFleetClient(fleet.state) as client:
            return await rollout(load_task(EXAMPLES / task), policy, client, images,
                                 AgentConfig(**config))
    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.parametrize("protocol", ["text", "tools"])
def test_format_errors_are_steps_with_a_corrective_message(example_fleet, images, protocol):
    policy = Recording(ScriptedPolicy([
        {"content": "I think the answer is obvious."},
        {"content": "```bash\nls\n```\n```bash\npwd\n```"},
        {"content": "", "tool_calls": [{"name": "python", "arguments": {"code": "1"}}]},
        "echo a\x00b",
        HELLO,
    ]))
    traj = run(example_fleet, images, policy, protocol=protocol)
    assert (traj.reward, traj.end_reason, traj.format_errors, traj.steps) == \
        (1.0, "submitted", 4, 2)
    corrective = [m for m in traj.messages if str(m.get("content", "")).startswith(
        "Format error")]
    assert len(corrective) == traj.format_errors
    assert "NUL byte" in corrective[-1]["content"]
    if protocol == "tools":
        assert "unknown tool 'python'" in corrective[-2]["content"]
        assert corrective[-2]["role"] == "tool" and corrective[-2]["tool_call_id"]
    else:
        assert "found 0 ```bash blocks" in corrective[0]["content"]
        assert "found 2 ```bash blocks" in corrective[1]["content"]


@pytest.mark.slow
@pytest.mark.sandbox
def test_command_timeout_is_an_observation_and_the_shell_stays_usable(example_fleet, images):
    policy = ScriptedPolicy(["export KEEP=kept; cd /tmp", "sleep 30; echo never",
                             "echo $KEEP $(pwd)", HELLO])
    traj = run(example_fleet, images, policy, command_timeout_s=1.5)
    obs = [m["content"] for m in traj.messages if m["role"] in ("user", "tool")][1:]
    assert "timed out after 1.5 s" in obs[1] and obs[1].endswith("[exit code: 124]")
    assert "never" not in obs[1]
    assert obs[2] == "kept /tmp\n[exit code: 0]"
    assert traj.reward == 1.0 and traj.timings["agent"] < 20


@pytest.mark.slow
@pytest.mark.sandbox
def test_step_limit_ends_the_episode_unverified_with_reward_zero(example_fleet, images):
    policy = ScriptedPolicy(["true"] * 2 + [HELLO, "true", "true"])
    traj = run(example_fleet, images, policy, step_limit=3)
    assert (traj.end_reason, traj.policy_failure, traj.reward, traj.steps) == \
        ("step_limit", "step_limit", 0.0, 3)
    assert traj.infra_failure is None and "verifier" not in traj.timings
    # Terminal-Bench style: verify even so
    traj = run(example_fleet, images, policy, step_limit=3, verify_unfinished=True)
    assert (traj.end_reason, traj.policy_failure, traj.reward) == ("step_limit", None, 1.0)


@pytest.mark.slow
@pytest.mark.sandbox
def test_submit_marker_ends_the_episode_and_later_commands_never_run(example_fleet, images):
    policy = ScriptedPolicy([SUBMIT, HELLO])
    traj = run(example_fleet, images, policy)
    assert (traj.end_reason, traj.steps, traj.reward) == ("submitted", 1, 0.0)
    # the marker counts only as the output's first line, not anywhere in it
    policy = ScriptedPolicy(["echo x; echo TMAX_TASK_COMPLETE", HELLO])
    traj = run(example_fleet, images, policy)
    assert (traj.end_reason, traj.steps, traj.reward) == ("submitted", 3, 1.0)


@pytest.mark.slow
@pytest.mark.sandbox
def test_reasoning_stays_in_the_history(example_fleet, images):
    policy = Recording(ScriptedPolicy([{"content": "```bash\nls /app\n```",
                                        "reasoning": "first look around"}, HELLO]))
    traj = run(example_fleet, images, policy)
    assert policy.seen[1][2] == {"role": "assistant", "content": "```bash\nls /app\n```",
                                 "reasoning_content": "first look around"}
    assert traj.messages[2]["reasoning_content"] == "first look around"


@pytest.mark.slow
@pytest.mark.sandbox
def test_episode_budget_counts_from_the_grant(example_fleet, images):
    traj = run(example_fleet, images, ScriptedPolicy(["sleep 1"] * 50),
               episode_budget_s=2.5)
    assert (traj.end_reason, traj.policy_failure, traj.reward) == \
        ("time_budget", "time_budget", 0.0)
    assert 1 <= traj.steps <= 3


@pytest.mark.slow
@pytest.mark.sandbox
def test_the_verifier_ignores_what_the_agent_did_to_path(example_fleet, images):
    """An agent that shadows bash/python3 through PATH cannot fake a reward."""
    fake = ("mkdir -p /tmp/fake && printf '#!/bin/sh\\nmkdir -p /logs/verifier; "
            "echo 1 > /logs/verifier/reward.txt\\n' > /tmp/fake/python3 && "
            "cp /tmp/fake/python3 /tmp/fake/bash && chmod +x /tmp/fake/* && "
            "export PATH=/tmp/fake:$PATH")
    traj = run(example_fleet, images, ScriptedPolicy([fake]))
    assert traj.reward == 0.0 and traj.verifier_error is None


@pytest.mark.slow
@pytest.mark.sandbox
def test_an_agent_that_breaks_logs_still_gets_the_verifiers_reward(example_fleet, images):
    """/logs replaced by a file: the verifier's /logs/verifier is its own all the same (the
    agent's file is set aside), so the verifier grades the untouched task: 0, no error."""
    traj = run(example_fleet, images, ScriptedPolicy(["rm -rf /logs && touch /logs"]))
    assert traj.reward == 0.0 and traj.infra_failure is None and not traj.verifier_error


@pytest.mark.slow
@pytest.mark.sandbox
def test_oracle_and_nop_bracket_a_task(example_fleet, images):
    assert run(example_fleet, images, make_policy("oracle"), task="csv-sales-aggregate") \
        .reward == 1.0
    assert run(example_fleet, images, make_policy("nop"), task="csv-sales-aggregate") \
        .reward == 0.0


class Unavailable(ScriptedPolicy):
    async def complete(self, messages, tools=None):
        raise PolicyUnavailable(self.name, "connection refused")


@pytest.mark.slow
@pytest.mark.sandbox
def test_infra_failures_are_recorded_with_their_cause(example_fleet, images, tmp_path):
    traj = run(example_fleet, images, Unavailable([]))
    assert traj.infra_failure["cause"] == "policy_unavailable" and traj.reward is None
    assert not traj.valid and traj.timings["total"] > 0
    # a missing image is the fleet's failure too
    empty = TaskImages(tmp_path / "empty-store")
    traj = run(example_fleet, empty, make_policy("oracle"))
    assert traj.infra_failure["cause"] == "image_missing"
    assert "tmax images build" in traj.infra_failure["message"]
