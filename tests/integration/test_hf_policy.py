"""The tiny local model, the transformers policy (token in / token out) and SFT warm-start.

Everything runs on a real (tiny, random or SFT-trained) model on the CPU; nothing is
downloaded."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
import torch

from tests.conftest import EXAMPLES
from tmax.agent.config import AgentConfig, load_agent_config
from tmax.agent.harness import Agent, parse_text_command
from tmax.agent.policies.choose import make_policy
from tmax.agent.policies.hf import HFPolicy, render_messages
from tmax.agent.policy import ContextLimit, PolicyError, PolicyUnavailable
from tmax.models.tiny import (
    IM_END,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tokenizer,
    corpus_texts,
    load_pretrained_dir,
    save_pretrained_dir,
)
from tmax.rollout.trajectory import Trajectory, Turn
from tmax.tasks import find_tasks, load_task
from tmax.train.sft import encode_conversation, sft, sft_conversation, solution_command

SFT_TASKS = ("hello-world-file", "make-script-executable", "sha256-digest")
CHAT = [
    {"role": "system", "content": "You run commands."},
    {"role": "user", "content": "Task:\n\nList /app.\n\nYou have at most 8 commands."},
    {"role": "assistant", "content": "Look first.\n```bash\nls -la /app\n```"},
    {"role": "user", "content": "total 0\n[exit code: 0]"},
    {"role": "tool", "content": "ünïcode ✓ \t tabs\n"},
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest single-threaded on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(corpus_texts(find_tasks(EXAMPLES)))


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(tokenizer, n_layers=2, d_model=64, n_heads=4, seed=0)


def teacher_forced(model, prompt_ids, completion_ids, temperature):
    """log_softmax(logits / T) at the completion ids, one unbatched forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1:-1] / temperature, -1)
    return logp.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


# -- tokenizer and chat format -------------------------------------------------------------

def test_tokenizer_is_local_deterministic_and_round_trips(tokenizer):
    texts = corpus_texts(find_tasks(EXAMPLES))
    again = build_tokenizer(texts)
    assert again.get_vocab() == tokenizer.get_vocab()
    assert 1000 < len(tokenizer) <= 2048
    for token in SPECIAL_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(token)
        assert tokenizer.encode(token, add_special_tokens=False) == [tid]
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == IM_END
    for solve in sorted(EXAMPLES.glob("*/solution/solve.sh")):
        text = solve.read_text()
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text, solve
    odd = "naïve ✓ 日本 \x00\x7f\t  trailing  \r\n"
    assert tokenizer.decode(tokenizer.encode(odd, add_special_tokens=False)) == odd
    # the corpus makes the prompts cheap: far fewer tokens than characters
    system = load_agent_config().system_template
    assert len(tokenizer.encode(system, add_special_tokens=False)) < len(system) / 3


def test_chat_rendering_is_per_message_and_masks_assistant_content(tokenizer):
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    per_message = "".join(
        tokenizer.apply_chat_template([m], tokenize=False) for m in CHAT)
    assert text == per_message + "<|im_start|>assistant\n"
    assert per_message.startswith("<|im_start|>system\nYou run commands.<|im_end|>\n")

    ids, mask = render_messages(tokenizer, CHAT, add_generation_prompt=True)
    assert len(ids) == len(mask)
    assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text
    learned = [t for t, m in zip(ids, mask) if m]
    assert tokenizer.decode(learned) == CHAT[2]["content"] + IM_END
    # the SFT encoder is the very same rendering (without the generation prompt)
    sft_ids, sft_mask = encode_conversation(tokenizer, CHAT)
    assert (sft_ids, sft_mask) == render_messages(tokenizer, CHAT)
    assert ids[:len(sft_ids)] == sft_ids


# -- the policy ------------------------------------------------------------------------------

def test_logprobs_match_teacher_forcing_single_and_batched(model, tokenizer):
    policy = HFPolicy(model, tokenizer, temperature=0.7, max_new_tokens=24, seed=1)
    histories = [CHAT[:2], CHAT[:4], [{"role": "user", "content": "hi"}]]

    async def episodes():
        return await asyncio.gather(*(policy.complete(h) for h in histories))

    completions = asyncio.run(episodes())
    assert policy.batch_sizes == {3: 1}  # generated together, left-padded to one batch
    single = asyncio.run(policy.complete(CHAT[:4]))
    assert policy.batch_sizes == {3: 1, 1: 1}
    for history, c in zip([*histories, CHAT[:4]], [*completions, single]):
        assert c.prompt_ids == policy.render(history)
        assert len(c.completion_ids) == len(c.logprobs) == c.completion_tokens
        assert c.prompt_tokens == len(c.prompt_ids) and c.policy_version == 0
        expected = teacher_forced(model, c.prompt_ids, c.completion_ids, 0.7)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
        stopped = c.completion_ids[-1] == tokenizer.convert_tokens_to_ids(IM_END)
        assert c.finish_reason == ("stop" if stopped else "length")
        assert c.content == tokenizer.decode(c.completion_ids, skip_special_tokens=True)


def test_two_turns_extend_one_sequence(model, tokenizer):
    policy = HFPolicy(model, tokenizer, temperature=1.0, max_new_tokens=40, seed=3)
    messages = list(CHAT[:2])
    turns = []
    for k in range(3):
        c = asyncio.run(policy.complete(messages))
        if turns:
            prev = turns[-1]
            assert c.prompt_ids[:len(prev.prompt_ids) + len(prev.completion_ids)] == (
                prev.prompt_ids + prev.completion_ids)
        turns.append(Turn(c.prompt_ids, c.completion_ids, c.logprobs, c.policy_version))
        messages += [c.message(), {"role": "user", "content": f"[exit code: {k}]"}]
    # sampled ids rarely survive decode + re-encode (here: not once); the cache keeps them
    def retokenised(t):
        text = tokenizer.decode(t.completion_ids, skip_special_tokens=True)
        return tokenizer.encode(text, add_special_tokens=False)

    assert any(retokenised(t) != t.completion_ids[:len(retokenised(t))] for t in turns)
    [(tokens, logps, mask)] = Trajectory("t", "hf", turns=turns).sequences()
    assert tokens[:len(turns[-1].prompt_ids)] == turns[-1].prompt_ids
    expected = [0] * len(tokens)
    for t in turns:
        start = len(t.prompt_ids)
        expected[start:start + len(t.completion_ids)] = [1] * len(t.completion_ids)
        assert tokens[start:start + len(t.completion_ids)] == t.completion_ids
        assert logps[start:start + len(t.completion_ids)] == t.logprobs
    assert mask == expected


def test_length_finish_and_context_limit(model, tokenizer):
    policy = HFPolicy(model, tokenizer, max_new_tokens=5, seed=0)
    c = asyncio.run(policy.complete(CHAT[:2]))
    assert c.finish_reason == "length" and len(c.completion_ids) == 5
    nxt = policy.render([*CHAT[:2], c.message()])  # a cut-off turn is closed by the renderer
    assert nxt[:len(c.prompt_ids) + 5] == c.prompt_ids + c.completion_ids

    n = len(policy.render(CHAT[:2]))
    tight = HFPolicy(model, tokenizer, max_new_tokens=50, max_context=n + 3, seed=0)
    c = asyncio.run(tight.complete(CHAT[:2]))
    assert len(c.completion_ids) <= 3
    with pytest.raises(ContextLimit):
        asyncio.run(HFPolicy(model, tokenizer, max_context=n).complete(CHAT[:2]))
    long_history = [CHAT[0]] + [{"role": "user", "content": "ls -la /app " * 200}]
    with pytest.raises(ContextLimit):  # default: the model's 1024 positions
        asyncio.run(HFPolicy(model, tokenizer).complete(long_history))


def test_engine_failure_is_unavailable_not_a_policy_outcome(model, tokenizer):
    policy = HFPolicy(model, tokenizer, max_new_tokens=4)

    def broken(prompts):
        raise RuntimeError("CUDA error: device lost")

    policy._generate = broken
    with pytest.raises(PolicyUnavailable, match="device lost"):
        asyncio.run(policy.complete(CHAT[:2]))
    with pytest.raises(PolicyError, match="text protocol"):
        asyncio.run(policy.complete(CHAT[:2], tools=[{"type": "function"}]))


def test_update_weights_changes_outputs_and_version(model, tokenizer):
    engine = build_tiny_model(tokenizer, n_layers=2, d_model=64, n_heads=4, seed=0)
    policy = HFPolicy(engine, tokenizer, temperature=0, max_new_tokens=12)
    before = asyncio.run(policy.complete(CHAT[:2]))
    trainer = build_tiny_model(tokenizer, n_layers=2, d_model=64, n_heads=4, seed=7)
    policy.update_weights(trainer.state_dict(), version=5)
    after = asyncio.run(policy.complete(CHAT[:2]))
    assert policy.version == 5 and after.policy_version == 5 and before.policy_version == 0
    assert (after.completion_ids, after.logprobs) != (before.completion_ids, before.logprobs)
    torch.testing.assert_close(torch.tensor(after.logprobs),
                               teacher_forced(trainer, after.prompt_ids,
                                              after.completion_ids, 1.0), atol=1e-4, rtol=0)
    with torch.no_grad():  # the engine holds a copy, not the trainer's tensors
        trainer.model.embed_tokens.weight.add_(1.0)
    assert not torch.equal(engine.model.embed_tokens.weight, trainer.model.embed_tokens.weight)


def test_save_load_and_make_policy(model, tokenizer, tmp_path):
    path = save_pretrained_dir(model, tokenizer, tmp_path / "tiny")
    save_pretrained_dir(model, tokenizer, path)  # replacing an existing folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
    loaded, tok = load_pretrained_dir(path)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    assert render_messages(tok, CHAT) == render_messages(tokenizer, CHAT)
    policy = make_policy(f"hf:{path}", temperature=0.5, seed=0)
    assert isinstance(policy, HFPolicy) and not policy.supports_tools
    assert policy.name == f"hf:{path}" and policy.temperature == 0.5


# -- SFT warm-start -------------------------------------------------------------------------

def test_solution_command_drops_header_but_keeps_heredocs():
    assert solution_command("#!/bin/bash\n# why\nset -euo pipefail\nls /app\n") == "ls /app"
    assert solution_command("set -o errexit\nset +x\nset -x\n") == "set +x\nset -x"
    script = (EXAMPLES / "log-rotation-script/solution/solve.sh").read_text()
    command = solution_command(script)
    assert not command.startswith("#!")
    assert "# Rotate *.log files" in command  # inside a here-document: file content
    assert "# m h dom mon dow user command" in command
    assert "set -e" not in solution_command(
        (EXAMPLES / "makefile-build-fix/solution/solve.sh").read_text())


def test_sft_conversation_is_what_the_harness_produces():
    config = load_agent_config()
    task = load_task(EXAMPLES / "hello-world-file")
    messages = sft_conversation(task, config)
    policy = make_policy("nop")
    policy.supports_tools = False
    assert messages[:2] == Agent(policy, None, config).initial_messages(task.instruction)
    assert "```bash" in messages[0]["content"]  # the text protocol is in the system prompt
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == "```bash\necho 'hello world' > /app/hello.txt\n```"
    assert messages[3]["content"] == "[no output]\n[exit code: 0]"
    assert parse_text_command(messages[4]["content"]) == "echo TMAX_TASK_COMPLETE"
    with pytest.raises(ValueError):
        sft_conversation(task, AgentConfig(protocol="tools"))


@dataclass
class _Ran:
    output: str
    exit_code: int = 0
    timed_out: bool = False
    oom: bool = False


class _EchoShell:
    """Answers like bash would for the commands these tasks need."""

    def __init__(self):
        self.commands = []

    async def run(self, command, timeout):
        self.commands.append(command)
        return _Ran(command[5:] + "\n" if command.startswith("echo ") and ">" not in command
                    else "")


@pytest.mark.slow
def test_sft_learns_the_reference_commands(tokenizer):
    config = load_agent_config()
    tasks = [load_task(EXAMPLES / name) for name in SFT_TASKS]
    conversations = [sft_conversation(t, config) for t in tasks]
    model = build_tiny_model(tokenizer, n_layers=2, d_model=64, n_heads=4, seed=0)
    losses = sft(model, tokenizer, conversations, steps=100, lr=3e-3, batch_size=3,
                 progress=False)
    assert len(losses) == 100
    assert losses[0] > 5.0 and max(losses[-5:]) < losses[0] / 100

    policy = HFPolicy(model, tokenizer, temperature=0, max_new_tokens=48)
    first = asyncio.run(policy.complete(conversations[2][:2]))
    assert first.content == conversations[2][2]["content"]
    assert parse_text_command(first.content) == solution_command(
        (tasks[2].solution_dir / "solve.sh").read_text())
    assert first.finish_reason == "stop"

    # the whole harness: the trained policy solves and submits in one token sequence
    shell = _EchoShell()
    episode = asyncio.run(Agent(policy, shell, config).run(tasks[0].instruction,
                                                           time.time() + 60))
    assert episode.end_reason == "submitted"
    assert shell.commands == ["echo 'hello world' > /app/hello.txt", "echo TMAX_TASK_COMPLETE"]
    turns = [Turn(c.prompt_ids, c.completion_ids, c.logprobs) for c in episode.completions]
    assert len(Trajectory("hello-world-file", "hf", turns=turns).sequences()) == 1
