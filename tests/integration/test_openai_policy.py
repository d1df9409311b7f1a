"""OpenAIPolicy against the real ScriptedServer on a free loopback port; the harness with
real bash; one rollout through a real fleet sandbox."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tmax.agent.config import SUBMIT_MARKER, load_agent_config
from tmax.agent.harness import BASH_TOOL, Agent
from tmax.agent.policies.choose import make_policy
from tmax.agent.policies.openai import OpenAIPolicy
from tmax.agent.policy import ContextLimit, PolicyError, PolicyUnavailable
from tmax.agent.scripted_server import ScriptedServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"
LOOPBACK = "127.0.0.1"
CONTEXT_ERROR = {"error": {"message": "This model's maximum context length is 4096 tokens. "
                                      "However, you requested 5000 tokens.",
                           "type": "BadRequestError", "code": 400}}


def policy_for(server: ScriptedServer, **options) -> OpenAIPolicy:
    options = {"backoff_s": 0.01, "max_retries": 2, "timeout_s": 10, **options}
    return OpenAIPolicy(server.url, "test-model", **options)


def ask(policy: OpenAIPolicy, messages: list[dict], tools: list[dict] | None = None):
    async def go():
        try:
            return await policy.complete(messages, tools)
        finally:
            await policy.aclose()
    return asyncio.run(go())


HELLO = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "list the files please"}]


# ---- parsing and the request sent


def test_text_reply_parses_with_reasoning_and_usage():
    reply = {"content": "Listing.\n```bash\nls -la\n```", "reasoning": "the user wants files"}
    with ScriptedServer([reply]) as server:
        assert server.host == LOOPBACK
        c = ask(policy_for(server, temperature=0.7, max_tokens=64), HELLO)
    assert c.content == reply["content"]
    assert c.reasoning == "the user wants files"
    assert c.tool_calls == [] and c.finish_reason == "stop"
    assert c.prompt_tokens == 7  # "You are terse." + "list the files please"
    assert c.completion_tokens == 4 + 5  # reasoning words + content words
    assert c.prompt_ids is None and c.completion_ids is None and c.logprobs is None
    (body,) = server.requests
    assert body["model"] == "test-model" and body["messages"] == HELLO
    assert body["temperature"] == 0.7 and body["max_tokens"] == 64
    assert "tools" not in body and "logprobs" not in body


def test_tool_call_reply_and_the_history_sent():
    history = [*HELLO,
               {"role": "assistant", "content": "", "reasoning_content": "ls first",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "bash",
                                             "arguments": '{"command": "ls"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\n[exit code: 0]"}]
    reply = {"reasoning": "now read it",
             "tool_calls": [{"id": "call_2", "name": "bash",
                             "arguments": {"command": "cat a.txt"}}]}
    with ScriptedServer([reply]) as server:
        c = ask(policy_for(server, extra_body={"top_k": 20}), history, [BASH_TOOL])
    (call,) = c.tool_calls
    assert (call.id, call.name) == ("call_2", "bash")
    assert json.loads(call.arguments) == {"command": "cat a.txt"} == call.args()
    assert c.reasoning == "now read it" and c.content == ""
    assert c.finish_reason == "tool_calls"
    assert c.completion_tokens == 3 + 3  # "now read it" + '{"command": "cat a.txt"}'
    assert c.message()["reasoning_content"] == "now read it"
    (body,) = server.requests
    assert body["tools"] == [BASH_TOOL]
    assert body["top_k"] == 20
    assert body["messages"] == history  # reasoning_content, tool_calls, tool_call_id kept


def test_tokens_and_logprobs_when_asked():
    with ScriptedServer(["ls"]) as server:
        c = ask(policy_for(server, return_tokens=True), HELLO, [BASH_TOOL])
    body = server.requests[0]
    assert body["logprobs"] is True and body["return_token_ids"] is True
    assert c.prompt_ids is not None and len(c.prompt_ids) == c.prompt_tokens == 7
    assert c.completion_ids is not None and len(c.completion_ids) == c.completion_tokens == 2
    assert c.logprobs == [-0.5, -0.5]


def test_exhausted_script_submits_in_both_protocols():
    with ScriptedServer([]) as server:
        tool = ask(policy_for(server), HELLO, [BASH_TOOL])
        text = ask(policy_for(server), HELLO)
    assert tool.tool_calls[0].args() == {"command": f"echo {SUBMIT_MARKER}"}
    assert text.content == f"```bash\necho {SUBMIT_MARKER}\n```" and not text.tool_calls


# ---- errors


def test_503_twice_then_success(caplog):
    script = [{"status": 503}, {"status": 503}, {"content": "ok"}]
    with ScriptedServer(script) as server, caplog.at_level(logging.WARNING):
        c = ask(policy_for(server, max_retries=5), HELLO)
    assert c.content == "ok" and len(server.requests) == 3
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 2 and "HTTP 503" in retries[0].getMessage()


def test_always_500_is_unavailable_after_max_retries():
    with (ScriptedServer([{"status": 500}] * 10) as server,
          pytest.raises(PolicyUnavailable) as err):
        ask(policy_for(server, max_retries=3), HELLO)
    assert len(server.requests) == 4  # the first attempt and 3 retries
    assert "HTTP 500" in err.value.reason and "scripted HTTP 500" in err.value.reason
    assert err.value.to_dict()["cause"] == "policy_unavailable"


def test_context_too_long_is_context_limit():
    with (ScriptedServer([{"status": 400, "body": CONTEXT_ERROR}]) as server,
          pytest.raises(ContextLimit) as err):
        ask(policy_for(server), HELLO)
    assert "maximum context length is 4096" in err.value.reason
    assert len(server.requests) == 1  # not retried


def test_other_400_is_policy_error_with_the_server_message():
    body = {"error": {"message": "tool_choice must be one of ...", "code": 400}}
    with (ScriptedServer([{"status": 400, "body": body}]) as server,
          pytest.raises(PolicyError) as err):
        ask(policy_for(server), HELLO)
    assert type(err.value) is PolicyError
    assert "HTTP 400: tool_choice must be one of" in err.value.reason
    assert len(server.requests) == 1


def test_wrong_model_or_key_is_unavailable_without_retries():
    with (ScriptedServer([{"status": 404, "body": {"message": "model nope not found"}}]) as s,
          pytest.raises(PolicyUnavailable, match="model nope not found")):
        ask(policy_for(s), HELLO)
    assert len(s.requests) == 1


@pytest.mark.parametrize("body", [{"choices": []}, {"id": "x"}, "this is not json",
                                  {"choices": [{"message": {"tool_calls": [{"id": "c"}]}}]}])
def test_malformed_200_is_policy_error(body):
    with (ScriptedServer([{"status": 200, "body": body}]) as server,
          pytest.raises(PolicyError) as err):
        ask(policy_for(server), HELLO)
    assert type(err.value) is PolicyError


def test_read_timeout_is_retried_then_unavailable():
    script = [{"delay_s": 3.0, "content": "too late"}] * 2 + [{"content": "never asked"}]
    with ScriptedServer(script) as server:
        t0 = time.monotonic()
        with pytest.raises(PolicyUnavailable, match="ReadTimeout"):
            ask(policy_for(server, timeout_s=0.3, max_retries=1), HELLO)
        took = time.monotonic() - t0
    assert len(server.requests) == 2
    assert 0.6 <= took < 2.5


def test_unreachable_endpoint_is_unavailable():
    with ScriptedServer([]) as server:
        url = server.url
    policy = OpenAIPolicy(url, "m", max_retries=1, backoff_s=0.01, timeout_s=5)
    with pytest.raises(PolicyUnavailable, match="ConnectError"):
        ask(policy, HELLO)


def test_concurrency_limit_is_honoured():
    with ScriptedServer([{"delay_s": 0.3, "content": str(i)} for i in range(6)]) as server:
        policy = policy_for(server, concurrency=2)

        async def go():
            try:
                return await asyncio.gather(*(policy.complete(HELLO) for _ in range(6)))
            finally:
                await policy.aclose()
        replies = asyncio.run(go())
    assert sorted(c.content for c in replies) == [str(i) for i in range(6)]
    assert server.max_in_flight == 2


# ---- the server itself


def test_server_from_yaml_file_and_models(tmp_path):
    script = tmp_path / "script.yaml"
    script.write_text("model: tiny\nresponses:\n  - ls /\n  - content: done\n")
    with ScriptedServer.from_file(script) as server:
        models = httpx.get(f"{server.url}/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert httpx.get(f"{server.url}/nope", timeout=5).status_code == 404
        first = ask(make_policy(f"openai:tiny@{server.url}", backoff_s=0.01), HELLO)
        second = ask(policy_for(server), HELLO)
    assert first.content == "```bash\nls /\n```" and second.content == "done"
    assert server.requests[0]["model"] == "tiny"


def test_serve_scripted_command(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"content": "hi"}]))
    code = "import sys; from tmax.agent.cli import serve_scripted; serve_scripted()"
    proc = subprocess.Popen([sys.executable, "-c", code, str(script), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith(f"http://{LOOPBACK}:") and url.endswith("/v1")
        assert ask(OpenAIPolicy(url, "m", timeout_s=5), HELLO).content == "hi"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read()


# ---- the harness with a real bash


@dataclass
class Result:
    output: str
    exit_code: int | None
    timed_out: bool = False
    oom: bool = False


class BashShell:
    """Each command in a fresh real ``bash -c`` in ``cwd`` (its own process group)."""

    def __init__(self, cwd: Path):
        self.cwd = cwd

    async def run(self, command: str, timeout: float) -> Result:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=self.cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return Result("", None, timed_out=True)
        return Result(out.decode(errors="replace"), proc.returncode)


@pytest.mark.parametrize("tools", [True, False], ids=["tools", "text"])
def test_harness_drives_openai_policy_with_real_bash(tmp_path, tools):
    command = "echo hello > note.txt && cat note.txt && ls"
    first = ({"reasoning": "write it", "tool_calls": [
        {"id": "call_w", "name": "bash", "arguments": {"command": command}}]}
        if tools else {"content": f"Writing.\n```bash\n{command}\n```", "reasoning": "write"})
    with ScriptedServer([first]) as server:
        policy = policy_for(server, supports_tools=tools)

        async def go():
            try:
                agent = Agent(policy, BashShell(tmp_path), load_agent_config())
                return await agent.run("Write hello to note.txt.", time.time() + 60)
            finally:
                await policy.aclose()
        episode = asyncio.run(go())
    assert (tmp_path / "note.txt").read_text() == "hello\n"
    assert episode.end_reason == "submitted"
    assert [s.command for s in episode.steps] == [command, f"echo {SUBMIT_MARKER}"]
    assert len(server.requests) == 2
    second = server.requests[1]
    sent = second["messages"]
    assert sent[-2]["role"] == "assistant" and sent[-2]["reasoning_content"]
    observation = sent[-1]
    assert "hello\nnote.txt" in observation["content"]
    assert observation["content"].endswith("[exit code: 0]")
    if tools:
        assert second["tools"] == [BASH_TOOL]
        assert sent[-2]["tool_calls"][0]["id"] == "call_w"
        assert observation["role"] == "tool" and observation["tool_call_id"] == "call_w"
        assert episode.completions[-1].tool_calls[0].args() == {
            "command": f"echo {SUBMIT_MARKER}"}
    else:
        assert "tools" not in second
        assert observation["role"] == "user" and "tool_call_id" not in observation
    assert sum(c.prompt_tokens for c in episode.completions) > 0


# ---- a rollout through a real fleet sandbox


def _rollout(server: ScriptedServer, fleet_state: Path, store_root: Path, **options):
    from sandfleet.client import AsyncFleetClient
    from tmax.rollout.run import TaskImages, rollout
    from tmax.tasks.native import load_task

    task = load_task(EXAMPLES / "hello-world-file")
    policy = policy_for(server, **options)

    async def go():
        try:
            async with AsyncFleetClient(fleet_state) as fleet:
                return await rollout(task, policy, fleet, TaskImages(store_root),
                                     load_agent_config())
        finally:
            await policy.aclose()
    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.sandbox
def test_rollout_in_a_sandbox_scores_the_scripted_solution(example_store, example_fleet):
    write = {"tool_calls": [{"name": "bash",
                             "arguments": {"command": "echo 'hello world' > /app/hello.txt"}}]}
    with ScriptedServer([write]) as server:
        traj = _rollout(server, example_fleet.state, example_store.root, return_tokens=True)
    assert traj.infra_failure is None, traj.infra_failure
    assert traj.end_reason == "submitted" and traj.steps == 2
    assert traj.reward == 1.0, traj.verifier_output
    assert traj.policy == "openai:test-model"
    assert traj.prompt_tokens > 0 and len(traj.turns) == 2
    assert traj.messages[3]["role"] == "tool"


@pytest.mark.slow
@pytest.mark.sandbox
def test_rollout_records_an_unavailable_endpoint_as_infra(example_store, example_fleet):
    with ScriptedServer([{"status": 503}] * 5) as server:
        traj = _rollout(server, example_fleet.state, example_store.root, max_retries=1)
    assert traj.reward is None and not traj.valid
    assert traj.infra_failure["cause"] == "policy_unavailable"
    assert "HTTP 503" in traj.infra_failure["message"]
