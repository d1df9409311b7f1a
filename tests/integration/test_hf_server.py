"""hf-server (``tmax serve``) driven by the one HTTP engine client, on the tiny real model.

Each server is real (aiohttp on a free loopback port, in a thread or as a `tmax serve`
subprocess) and stopped by its fixture; the reference numbers come from a plain forward
pass of the same weights in this process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tests.conftest import EXAMPLES
from tmax.agent.config import load_agent_config
from tmax.agent.harness import Agent
from tmax.agent.policies.hf import HFPolicy, render_messages
from tmax.agent.policy import PolicyError, PolicyUnavailable
from tmax.inference import InferenceEngine, WeightSyncError, write_weights
from tmax.inference.hf_server import HFServer
from tmax.inference.http import HttpEngine
from tmax.inference.inprocess import InProcessEngine
from tmax.inference.process import ServerProcess, free_port, hf_server_command
from tmax.models.tiny import (
    build_tiny_model,
    build_tokenizer,
    corpus_texts,
    load_pretrained_dir,
    save_pretrained_dir,
)
from tmax.tasks import find_tasks

CHAT = [{"role": "system", "content": "You run commands."},
        {"role": "user", "content": "Task:\n\nList /app.\n\nYou have at most 8 commands."}]
MODEL = "tiny"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(corpus_texts(find_tasks(EXAMPLES)))


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    model = build_tiny_model(tokenizer, n_layers=2, d_model=64, n_heads=4, seed=0)
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture
def server(model_dir):
    policy = HFPolicy.from_pretrained(model_dir, max_new_tokens=12, temperature=0.8, seed=1,
                                      max_batch=8)
    with HFServer(policy, model_name=MODEL) as s:
        yield s


def run(coro):
    return asyncio.run(coro)


async def using(engine, coro_fn):
    try:
        return await coro_fn(engine)
    finally:
        await engine.aclose()


def teacher_forced(model, prompt_ids, completion_ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1:-1] / temperature, -1)
    return logp.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


def engine_for(server, **options) -> HttpEngine:
    return HttpEngine(server.url, MODEL, temperature=0.8, backoff_s=0.05, **options)


def test_served_token_ids_and_logprobs_match_a_forward_pass(server, model_dir, tokenizer):
    engine = engine_for(server)
    assert isinstance(engine, InferenceEngine)
    completion = run(using(engine, lambda e: e.complete(CHAT)))
    assert completion.prompt_ids == render_messages(tokenizer, CHAT,
                                                    add_generation_prompt=True)[0]
    assert 1 <= len(completion.completion_ids) <= 12
    assert completion.policy_version == 0
    reference, _ = load_pretrained_dir(model_dir)
    expected = teacher_forced(reference, completion.prompt_ids, completion.completion_ids, 0.8)
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
    assert completion.content == tokenizer.decode(completion.completion_ids,
                                                  skip_special_tokens=True)


def test_the_wire_is_vllms_shape(server):
    body = {"model": MODEL, "messages": CHAT, "logprobs": True, "return_token_ids": True,
            "max_tokens": 3}
    data = httpx.post(server.url + "/chat/completions", json=body, timeout=60).json()
    choice = data["choices"][0]
    assert data["object"] == "chat.completion" and data["model"] == MODEL
    assert isinstance(data["prompt_token_ids"], list) and len(choice["token_ids"]) <= 3
    assert [e["logprob"] for e in choice["logprobs"]["content"]] and \
        len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert set(choice["logprobs"]["content"][0]) == {"token", "logprob", "bytes",
                                                      "top_logprobs"}
    assert data["usage"]["completion_tokens"] == len(choice["token_ids"])
    if len(choice["token_ids"]) == 3:
        assert choice["finish_reason"] == "length"
    plain = httpx.post(server.url + "/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": CHAT}).json()
    assert "token_ids" not in plain["choices"][0] and plain["prompt_token_ids"] is None
    assert plain["choices"][0]["logprobs"] is None
    models = httpx.get(server.url + "/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    health = httpx.get(server.root_url + "/health")
    assert health.status_code == 200 and health.content == b""


def test_filesystem_weight_update_changes_logprobs_and_version(server, tokenizer, tmp_path):
    new = build_tiny_model(tokenizer, n_layers=2, d_model=64, n_heads=4, seed=7)
    folder = write_weights(new, tmp_path / "weights", 3)
    engine = engine_for(server)

    async def go(e):
        before = await e.complete(CHAT)
        await e.update_weights_from_path(folder, 3)
        after = await e.complete(CHAT)
        return before, after, await e.refresh_version(), await e.is_paused()

    before, after, served, paused = run(using(engine, go))
    assert (before.policy_version, after.policy_version, engine.version, served) == (0, 3, 3, 3)
    assert not paused
    expected = teacher_forced(new, after.prompt_ids, after.completion_ids, 0.8)
    assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-4)
    old, _ = load_pretrained_dir(server.policy.name.removeprefix("hf:"))
    stale = teacher_forced(old, after.prompt_ids, after.completion_ids, 0.8)
    assert not torch.allclose(stale, expected, atol=1e-2)
    assert httpx.get(server.root_url + "/weight_info").json() == {"weight_version": "3"}


def test_an_incomplete_weights_folder_is_refused_and_the_server_keeps_serving(
        server, tokenizer, tmp_path):
    folder = write_weights(build_tiny_model(tokenizer, n_layers=2, d_model=64, n_heads=4,
                                            seed=3), tmp_path / "w", 1)
    (folder / "tmax-weights.json").unlink()
    engine = engine_for(server)
    with pytest.raises(WeightSyncError) as info:
        run(using(engine, lambda e: e.update_weights_from_path(folder, 1)))
    assert info.value.version == 1 and "tmax-weights.json" in info.value.reason
    # a folder that is complete but not a model of this shape: refused by the server
    bad = tmp_path / "bad"
    write_weights(build_tiny_model(tokenizer, n_layers=1, d_model=32, n_heads=2), bad, 2)
    with pytest.raises(WeightSyncError, match="do not fit|shape"):
        run(using(engine_for(server), lambda e: e.update_weights_from_path(bad / "v00000002",
                                                                            2)))
    stats = httpx.get(server.root_url + "/tmax/stats").json()
    assert stats["weight_version"] == "0" and stats["is_paused"] is False
    assert run(using(engine_for(server), lambda e: e.complete(CHAT))).policy_version == 0


def test_pause_holds_new_requests_until_resume(server):
    engine = engine_for(server)

    async def go(e):
        await e.pause()
        assert await e.is_paused()
        task = asyncio.ensure_future(e.complete(CHAT))
        await asyncio.sleep(1.5)
        held = not task.done()
        await e.resume()
        completion = await asyncio.wait_for(task, 60)
        return held, completion, await e.is_paused()

    held, completion, paused = run(using(engine, go))
    assert held and completion.completion_ids and not paused


def test_concurrent_requests_are_batched(server):
    engine = engine_for(server)

    async def go(e):
        chats = [[*CHAT, {"role": "user", "content": f"go {i}"}] for i in range(6)]
        return await asyncio.gather(*(e.complete(c) for c in chats))

    results = run(using(engine, go))
    assert len(results) == 6 and all(r.completion_ids for r in results)
    sizes = {int(k): v for k, v in httpx.get(server.root_url + "/tmax/stats").json()
             ["batch_sizes"].items()}
    assert sum(k * v for k, v in sizes.items()) == 6
    assert max(sizes) > 1, sizes


def test_requests_the_server_cannot_honour_are_policy_errors(server):
    with pytest.raises(PolicyError, match="temperature"):
        run(using(HttpEngine(server.url, MODEL, temperature=0.3), lambda e: e.complete(CHAT)))
    with pytest.raises(PolicyError, match="text protocol"):
        run(using(engine_for(server), lambda e: e.complete(
            CHAT, [{"type": "function", "function": {"name": "bash"}}])))
    with pytest.raises(PolicyUnavailable, match="does not exist"):
        run(using(HttpEngine(server.url, "other", temperature=0.8),
                  lambda e: e.complete(CHAT)))


def test_in_process_engine_has_the_same_protocol(model_dir, tokenizer, tmp_path):
    engine = InProcessEngine(HFPolicy.from_pretrained(model_dir, max_new_tokens=8, seed=0))
    assert isinstance(engine, InferenceEngine)
    new = build_tiny_model(tokenizer, n_layers=2, d_model=64, n_heads=4, seed=5)
    folder = write_weights(new, tmp_path, 2)

    async def go(e):
        await e.pause()
        task = asyncio.ensure_future(e.complete(CHAT))
        await asyncio.sleep(0.3)
        held = not task.done()
        await e.update_weights_from_path(folder, 2)
        await e.resume()
        return held, await task

    held, completion = run(go(engine))
    assert held and completion.policy_version == 2 and engine.version == 2
    expected = teacher_forced(new, completion.prompt_ids, completion.completion_ids, 1.0)
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
    with pytest.raises(WeightSyncError, match="holds version 2"):
        run(engine.update_weights_from_path(folder, 9))


class NoShell:
    """The episode is killed in its first turn: no command may run."""

    async def run(self, command: str, timeout: float):
        raise AssertionError(f"no command should run, got {command!r}")


class KillDuringFirstTurn:
    """The engine as the agent's policy; its first turn's request is sent, then the server
    is SIGKILLed (whether the tiny model would end the episode on its own in time or not)."""

    def __init__(self, engine, pid: int):
        self.engine, self.pid, self.turns = engine, pid, 0
        self.name, self.supports_tools = engine.name, engine.supports_tools

    @property
    def version(self) -> int:
        return self.engine.version

    async def complete(self, messages, tools=None):
        self.turns += 1
        turn = asyncio.ensure_future(self.engine.complete(messages, tools))
        if self.turns == 1:
            await asyncio.sleep(0.05)  # the request is on its way (or in generation)
            os.killpg(self.pid, signal.SIGKILL)
        return await turn


@pytest.mark.slow  # a `tmax serve` subprocess: 11 s idle, 30 s on a loaded 2-core box
def test_killing_the_server_mid_episode_is_policy_unavailable(model_dir, tmp_path):
    port = free_port()
    argv = hf_server_command(model_dir, port=port, max_tokens=1000, served_model_name=MODEL)
    server = ServerProcess(argv, url=f"http://127.0.0.1:{port}", log_path=tmp_path / "log",
                           name="hf-server", start_timeout_s=120)
    engine = HttpEngine(f"http://127.0.0.1:{port}/v1", MODEL, max_retries=1, backoff_s=0.05)

    async def go():
        async with server:
            assert await engine.health()
            async with httpx.AsyncClient(timeout=60) as client:
                warm = (await client.post(engine.root + "/v1/chat/completions", json={
                    "messages": CHAT, "max_tokens": 2, "return_token_ids": True})).json()
            agent = Agent(KillDuringFirstTurn(engine, server.pid), NoShell(),
                          load_agent_config())
            try:
                await agent.run("List /app.", time.time() + 120)
            except PolicyUnavailable as e:
                return warm, e, await engine.health()
            finally:
                await engine.aclose()
            raise AssertionError("the episode ended normally after the server was killed")

    warm, error, healthy = run(go())
    assert warm["choices"][0]["token_ids"] and error.cause == "policy_unavailable"
    assert not healthy and not server.alive()


def test_serve_names_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    result = subprocess.run(
        [sys.executable, "-c", "from tmax.cli import main; main(prog_name='tmax')", "serve",
         str(tmp_path / "empty"), "--port", "0"],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert f"{tmp_path / 'empty'}: not a transformers model folder" in result.stderr
    assert "Traceback" not in result.stderr


# A chat template that is not ChatML (its own role headers, a BOS-like first token, a blank
# line after each turn): the prompt must be what the template renders, as vLLM's is.
OWN_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|endoftext|>' if loop.first else '' -}}"
    "{{- '### ' + m['role'] + ':\\n' + m['content'] + '<|im_end|>\\n\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '### assistant:\\n' -}}{%- endif -%}")


def test_the_prompt_is_the_tokenizers_own_chat_template(tokenizer, tmp_path):
    import copy

    own = copy.deepcopy(tokenizer)
    own.chat_template = OWN_TEMPLATE
    model = build_tiny_model(own, n_layers=2, d_model=64, n_heads=4, seed=0)
    folder = save_pretrained_dir(model, own, tmp_path / "own")
    policy = HFPolicy.from_pretrained(folder, max_new_tokens=6, temperature=1.0, seed=2)
    with HFServer(policy, model_name=MODEL) as s:
        engine = HttpEngine(s.url, MODEL, backoff_s=0.05)
        first = run(using(engine, lambda e: e.complete(CHAT)))
    text = own.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|endoftext|>### system:\nYou run commands.<|im_end|>\n\n")
    assert first.prompt_ids == own.encode(text, add_special_tokens=False)
    expected = teacher_forced(model, first.prompt_ids, first.completion_ids, 1.0)
    assert torch.allclose(torch.tensor(first.logprobs), expected, atol=1e-4)
    # the next turn extends the first (the sampled ids are kept) and is the template's text
    messages = [*CHAT, first.message(), {"role": "user", "content": "[exit code: 0]"}]
    second = run(policy.complete(messages))
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == \
        first.prompt_ids + first.completion_ids
    assert own.decode(second.prompt_ids) == own.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    # SFT's mask: the assistant's content and its end-of-turn token, nothing else
    ids, mask = render_messages(own, [*CHAT, {"role": "assistant", "content": "ls /app"}])
    assert own.decode([t for t, m in zip(ids, mask) if m]) == "ls /app<|im_end|>"


def test_a_tokenizer_without_a_chat_template_is_refused_by_name(tokenizer, tmp_path):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    model = build_tiny_model(bare, n_layers=1, d_model=32, n_heads=2, seed=0)
    with pytest.raises(ValueError, match="no chat template"):
        HFPolicy(model, bare)
