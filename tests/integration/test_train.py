"""The trainer: configs, the FP32 head, checkpoint/resume, the rollout sampler against a
real fleet, and a tiny run whose reward must rise."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

from sandfleet.client import AsyncFleetClient
from tests.conftest import EXAMPLES, REPO
from tmax.agent.config import AgentConfig, load_agent_config
from tmax.agent.policies.simple import ScriptedPolicy
from tmax.agent.policy import PolicyUnavailable
from tmax.rl import GroupAdvantages
from tmax.rollout.run import TaskImages
from tmax.rollout.trajectory import Trajectory, Turn
from tmax.tasks.native import load_task
from tmax.train.config import AlgoSection, OptimSection, TrainConfigError, load_train_config
from tmax.train.rollouts import Group, GroupSampler, NoUsableGroups, RolloutsFailing
from tmax.train.trainer import Sample, Trainer, logits_of, samples_of

HELLO = "echo 'hello world' > /app/hello.txt"


# ---- configs

def test_every_shipped_config_parses(monkeypatch):
    monkeypatch.setenv("SCRATCH", "/scratch/user")  # the GPU configs' run folders
    for path in sorted((REPO / "configs").glob("*.yaml")):
        if path.name.startswith("agent"):
            load_agent_config(path)
        elif path.name == "tiny-cpu.yaml" or "qwen" in path.name:
            config = load_train_config(path)
            assert config.name


def test_config_rejects_unknown_keys_and_applies_overrides(tmp_path):
    config = load_train_config(REPO / "configs" / "tiny-cpu.yaml",
                               ["rollout.group_size=4", "optim.lr=1e-5", "name=x"])
    assert (config.rollout.group_size, config.optim.lr, config.run_dir) == \
        (4, 1e-5, Path("runs/x"))
    with pytest.raises(TrainConfigError, match="rollout.grup_size"):
        load_train_config(None, ["rollout.grup_size=4"])
    with pytest.raises(TrainConfigError, match="key=value"):
        load_train_config(None, ["steps"])
    from tmax.train.loop import TrainError, load_training_tasks

    with pytest.raises(TrainError, match="no-such-task"):
        load_training_tasks(load_train_config(None, ["tasks.include=[no-such-task]",
                                                     f"tasks.paths=[{EXAMPLES}]"]))
    bad = tmp_path / "c.yaml"
    bad.write_text("algo:\n  delta: -1\n")
    with pytest.raises(TrainConfigError, match="algo.delta"):
        load_train_config(bad)


# ---- trainer

def tiny(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def samples(seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(5):
        n = rng.randint(6, 12)
        mask = [0] * 3 + [1] * (n - 3)
        out.append(Sample([rng.randrange(50) for _ in range(n)],
                          [(-rng.random() * 3) * m for m in mask], mask,
                          rng.choice([-0.5, 0.25, 0.5])))
    return out


def make_trainer(model, steps=10):
    return Trainer(model, algo=AlgoSection(), optim=OptimSection(lr=1e-2, micro_batch_size=2),
                   total_steps=steps, temperature=1.0, fp32_head=True, pad_id=0, max_len=64)


def test_fp32_head_matches_the_model_and_upcasts_bf16():
    model = tiny()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones_like(ids)
    assert torch.allclose(logits_of(model, ids, mask, fp32_head=True),
                          model(input_ids=ids).logits, atol=1e-5)
    half = tiny().to(torch.bfloat16)
    assert logits_of(half, ids, mask, fp32_head=True).dtype == torch.float32
    assert logits_of(half, ids, mask, fp32_head=False).dtype == torch.bfloat16


def test_micro_batching_does_not_change_the_update():
    a, b = tiny(), tiny()
    ta = Trainer(a, algo=AlgoSection(), optim=OptimSection(lr=1e-2, micro_batch_size=1),
                 total_steps=1, temperature=1.0, fp32_head=True, pad_id=0, max_len=64)
    tb = Trainer(b, algo=AlgoSection(), optim=OptimSection(lr=1e-2, micro_batch_size=8),
                 total_steps=1, temperature=1.0, fp32_head=True, pad_id=0, max_len=64)
    ma, mb = ta.step(samples(1)), tb.step(samples(1))
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-5)  # summation order differs: ~1e-6 seen


def test_checkpoint_then_resume_gives_the_same_next_step(tmp_path):
    model = tiny()
    trainer = make_trainer(model)
    trainer.step(samples(1))
    trainer.save(tmp_path / "ckpt")
    trainer.step(samples(2))
    expected = [p.detach().clone() for p in model.parameters()]

    resumed_model = tiny(seed=99)  # different init: everything must come from the checkpoint
    resumed = make_trainer(resumed_model)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step_count == 1
    resumed.step(samples(2))
    for p, q in zip(resumed_model.parameters(), expected, strict=True):
        assert torch.equal(p.detach(), q)
    assert not (tmp_path / ".ckpt.tmp").exists()


def test_resume_drops_metrics_of_steps_after_the_checkpoint(tmp_path):
    from tmax.train.loop import keep_metrics_until

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(1, 8))
                    + '{"step": 8, "lo')  # torn by the crash
    keep_metrics_until(path, 5)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == \
        [1, 2, 3, 4, 5]


def test_dropped_rollouts_never_reach_the_loss():
    def traj(tokens):
        return Trajectory(task="t", policy="p", turns=[Turn(tokens[:2], tokens[2:],
                                                            [-1.0] * (len(tokens) - 2))])
    group = Group("t", [traj([1, 2, 3]), traj([4, 5, 6]), traj([7, 8, 9])],
                  GroupAdvantages((0.5, None, -0.5), True, "ok", 2), 0, 0.0)
    got = samples_of([group], 64)
    assert [(s.tokens, s.advantage) for s in got] == [([1, 2, 3], 0.5), ([7, 8, 9], -0.5)]


# ---- the sampler against a real fleet

class Coin(ScriptedPolicy):
    """Solves hello-world-file with probability p (else does nothing), then submits."""

    def __init__(self, p: float, seed: int = 0):
        super().__init__([], name=f"coin-{p}")
        self.p, self.rng, self.version = p, random.Random(seed), 0

    async def complete(self, messages, tools=None):
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns == 0:
            self.replies = [HELLO if self.rng.random() < self.p else "true"]
        return await ScriptedPolicy([self.replies[0]]).complete(messages, tools)


class Down(ScriptedPolicy):
    version = 0

    async def complete(self, messages, tools=None):
        raise PolicyUnavailable(self.name, "connection refused")


def sample_groups(fleet, store, policy, calls, **kw):
    async def go():
        async with AsyncFleetClient(fleet.state) as client:
            sampler = GroupSampler([load_task(EXAMPLES / "hello-world-file")], policy, client,
                                   TaskImages(store.root), AgentConfig(),
                                   **{"group_size": 2, "groups_per_step": 2, "concurrency": 4,
                                      "async_steps": 1, "abort_after_infra": 6, **kw})
            sampler.start()
            try:
                return [await call(sampler) for call in calls], sampler
            finally:
                await sampler.stop()
    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.sandbox
def test_active_sampling_fills_the_batch_when_most_groups_are_filtered(example_fleet,
                                                                       example_store):
    # p = 0.15 with groups of 2: a group is usable (one pass, one fail) with prob 0.255
    (batch,), sampler = sample_groups(example_fleet, example_store, Coin(0.15, seed=3),
                                      [lambda s: s.next_batch(3, 0)])
    assert len(batch) == 3
    for group in batch:
        assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]
        assert sorted(group.advantages.advantages) == [-0.5, 0.5]
    stats = sampler.stats
    assert sum(stats.groups_filtered.values()) >= 1
    assert set(stats.groups_filtered) <= {"zero_std"}


@pytest.mark.slow
@pytest.mark.sandbox
def test_stale_groups_are_dropped(example_fleet, example_store):
    policy = Coin(0.5, seed=1)

    async def first(sampler):
        await asyncio.sleep(0)
        while len(sampler.ready) < 2:  # noqa: ASYNC110 - let version-0 groups pile up
            await asyncio.sleep(0.05)
        policy.version = 5               # the trainer moved on by 5 steps
        return await sampler.next_batch(2, 5)

    (batch,), sampler = sample_groups(example_fleet, example_store, policy, [first])
    assert sampler.stats.groups_stale >= 2
    assert all(g.version == 5 for g in batch)


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_fleet_that_keeps_failing_stops_the_run(example_fleet, example_store):
    with pytest.raises(RolloutsFailing, match="policy_unavailable x"):
        sample_groups(example_fleet, example_store, Down([]), [lambda s: s.next_batch(1, 0)])


@pytest.mark.slow
@pytest.mark.sandbox
def test_tasks_without_learning_signal_stop_the_run(example_fleet, example_store):
    # the oracle solves every rollout: every group has zero std, none is usable
    from tmax.agent.policies.simple import OraclePolicy

    oracle = OraclePolicy()
    oracle.version = 0
    with pytest.raises(NoUsableGroups, match="zero_std x3"):
        sample_groups(example_fleet, example_store, oracle, [lambda s: s.next_batch(1, 0)],
                      give_up_after_groups=3)


# ---- the tiny run

@pytest.mark.slow
@pytest.mark.sandbox
def test_tiny_run_learns(example_fleet, example_store, tmp_path):
    """SFT warm start, then DPPO against real sandboxes: reward must rise by a margin a
    broken loss (wrong sign, no mask, no update) does not reach."""
    from tmax.train.loop import read_metrics, train

    config = load_train_config(REPO / "configs" / "tiny-cpu.yaml", [
        f"out_dir={tmp_path / 'run'}", f"fleet.state_dir={example_fleet.state}",
        f"tasks.image_store={example_store.root}", "fleet.concurrency=4",
        f"tasks.paths=[{EXAMPLES}]"])
    run_dir = train(config, progress=False)
    rows = read_metrics(run_dir)
    assert len(rows) == config.steps
    rewards = [r["reward_mean"] for r in rows]
    k = max(2, len(rows) // 4)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    # each window holds ~12 steps x 24 rollouts: a no-op update stays within ~0.04 of the
    # start, a sign-flipped loss falls
    assert last > first + 0.1, f"reward did not rise: {rewards}"
    assert (run_dir / "reward.png").stat().st_size > 0
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == \
        config.steps
