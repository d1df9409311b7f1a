"""The RL run, top to bottom: prepare the model, then rollout -> score -> advantage ->
update -> sync -> checkpoint, once per step.

Objective (DPPO, TMax v1.1): for each usable group, A_i = r_i - mean(valid r) over the
group's valid rollouts (infra failures dropped; groups with < 2 valid or zero std skipped,
active sampling refills). Loss = -sum_t m_t * keep_t * r_t * A / N over the step's
response tokens, r_t = pi/mu (capped), keep_t = the DPPO trust-region mask
(|pi - mu| <= delta, or the update pulls the token back in). No KL term. Deviations from
the paper: the engine is in-process transformers on CPU (vLLM behind the same interface
is not implemented yet), and the tiny run uses a larger learning rate and smaller groups.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sandfleet import run_event_loop
from tmax.agent.config import load_agent_config
from tmax.rollout.trajectory import append_jsonl
from tmax.train.config import TrainConfig, save_config
from tmax.train.model_load import context_length

log = logging.getLogger(__name__)


class TrainError(Exception):
    """The run cannot start or go on (bad tasks, no images, engine unavailable)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_agent_config(config: TrainConfig) -> Any:
    """The agent config of a run: its file with the run's overrides (those that are set)."""
    return load_agent_config(config.agent.config, **{
        k: v for k, v in {"step_limit": config.agent.step_limit,
                          "command_timeout_s": config.agent.command_timeout_s,
                          "episode_budget_s": config.agent.episode_budget_s}.items()
        if v is not None})


def load_training_tasks(config: TrainConfig,
                        difficulty: Sequence[str] | None = None) -> list[Any]:
    from tmax.tasks import find_tasks
    from tmax.tasks.native import load_task

    wanted = config.tasks.difficulty if difficulty is None else difficulty
    paths = find_tasks(*config.tasks.paths)
    tasks = [load_task(p) for p in paths]
    if wanted:
        tasks = [t for t in tasks if t.config.metadata.difficulty in wanted]
    if config.tasks.include and difficulty is None:
        missing = set(config.tasks.include) - {t.task_id for t in tasks}
        if missing:
            raise TrainError(f"tasks.include names {sorted(missing)}, not among the tasks "
                             f"of {config.tasks.paths} with difficulty {wanted or 'any'}")
        tasks = [t for t in tasks if t.task_id in config.tasks.include]
    if not tasks:
        raise TrainError(f"no tasks in {config.tasks.paths} with difficulty "
                         f"{wanted or 'any'}; check tasks.paths")
    return sorted(tasks, key=lambda t: t.task_id)


def prepare_model(config: TrainConfig, tasks: list[Any], run_dir: Path, agent_config,
                  progress: bool) -> tuple[Any, Any]:
    """The starting policy: a local HF model, or the tiny model (built from the tasks'
    texts, then warm-started by SFT on their reference solutions). Cached in run_dir/init."""
    from tmax.models.tiny import (
        build_tiny_model,
        build_tokenizer,
        corpus_texts,
        load_pretrained_dir,
        save_pretrained_dir,
    )

    init = run_dir / "init"
    if init.is_dir():
        return load_pretrained_dir(init)
    if config.model.path:
        model, tokenizer = load_pretrained_dir(config.model.path)
    else:
        m = config.model
        from tmax.tasks import find_tasks

        texts = corpus_texts(find_tasks(*config.tasks.paths))
        texts += [agent_config.system_template, agent_config.instance_template]
        tokenizer = build_tokenizer(texts, m.vocab_size)
        model = build_tiny_model(tokenizer, n_layers=m.n_layers, d_model=m.d_model,
                                 n_heads=m.n_heads, max_positions=m.max_positions,
                                 seed=config.seed)
    if config.sft.steps:
        from tmax.train.sft import sft, sft_conversation

        sft_tasks = load_training_tasks(config, config.sft.difficulty) \
            if config.sft.difficulty else tasks
        conversations = [sft_conversation(t, agent_config) for t in sft_tasks]
        losses = sft(model, tokenizer, conversations, steps=config.sft.steps,
                     lr=config.sft.lr, batch_size=config.sft.batch_size, seed=config.seed,
                     progress=progress)
        log.info("SFT: loss %.3f -> %.3f over %d steps", losses[0], losses[-1], len(losses))
        (run_dir / "sft_losses.json").write_text(json.dumps(losses))
    save_pretrained_dir(model, tokenizer, init)
    return model, tokenizer


def make_engine(config: TrainConfig, model, tokenizer):
    """The inference engine the rollouts sample from (a Policy with ``version`` and
    ``update_weights``)."""
    if config.engine == "vllm":
        raise TrainError("engine=vllm is not implemented yet; use engine=transformers")
    from tmax.agent.policies.hf import HFPolicy

    return HFPolicy(copy.deepcopy(model), tokenizer, temperature=config.rollout.temperature,
                    max_new_tokens=config.rollout.max_new_tokens, seed=config.seed,
                    name=f"{config.name}")


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"),
                   key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def train(config: TrainConfig, *, progress: bool = True) -> Path:
    """Run (or resume) the training run described by ``config``; returns the run dir."""
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml", launcher="embedded")
    seed_everything(config.seed)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    agent_config = run_agent_config(config)
    tasks = load_training_tasks(config)
    model, tokenizer = prepare_model(config, tasks, run_dir, agent_config, progress)
    if config.model.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    # The torch backend trains ``model`` in place; another backend may take its parameters
    # over (ZeRO-3 partitions them), so the engine and the final save use a whole copy.
    whole = model if config.trainer.backend == "torch" else copy.deepcopy(model)
    final = run_event_loop(_rl(config, run_dir, tasks, model, whole, tokenizer, agent_config,
                               progress))
    from tmax.models.tiny import save_pretrained_dir

    if whole is not model:
        whole.load_state_dict(final)
    save_pretrained_dir(whole, tokenizer, run_dir / "final")  # for `tmax eval --policy hf:...`
    return run_dir


def run_fleet(config: TrainConfig, run_dir: Path):
    """The run's fleet (an async context): the running one of ``fleet.state_dir``, or a
    private one of ``fleet.config`` (a Slurm one keeps its state in RUN/fleet, where its
    worker jobs read it)."""
    from tmax.fleet import open_fleet

    f = config.fleet
    if f.state_dir:
        return open_fleet(Path(f.state_dir))
    root = None
    if f.private_provider() == "slurm":
        root = run_dir / "fleet"
        # for `tmax gc`: the private fleet to stop when the launcher is gone
        record = run_dir / "fleet.json"
        tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"state_dir": str(root / "state"), "private": True}) + "\n")
        os.replace(tmp, record)
    return open_fleet(None, config=f.config, concurrency=f.concurrency, root=root)


async def _rl(config: TrainConfig, run_dir: Path, tasks, model, whole, tokenizer,
              agent_config, progress: bool) -> dict[str, torch.Tensor]:
    """The RL steps; returns the final weights. ``model`` goes to the trainer backend,
    ``whole`` (``model`` itself with the torch backend) seeds the inference engine."""
    from tqdm.auto import tqdm

    from tmax.images.store import default_store
    from tmax.rollout.run import TaskImages
    from tmax.train.backends.choose import make_trainer
    from tmax.train.rollouts import GroupSampler
    from tmax.train.tracking import open_trackers
    from tmax.train.trainer import samples_of

    trainer = make_trainer(config, model, pad_id=tokenizer.pad_token_id or 0,
                           max_len=context_length(model.config))
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        trainer.load(ckpt)
        log.info("resumed from %s (step %d)", ckpt, trainer.step_count)
        keep_metrics_until(run_dir / "metrics.jsonl", trainer.step_count)
    engine = make_engine(config, whole, tokenizer)
    engine.update_weights(trainer.export_weights(), trainer.step_count)
    images = TaskImages(config.tasks.image_store or default_store())
    rollouts_path, metrics_path = run_dir / "rollouts.jsonl", run_dir / "metrics.jsonl"
    step0 = trainer.step_count

    def record(traj):
        append_jsonl(rollouts_path, {**traj.to_dict(), "trainer_step": trainer.step_count})

    async with run_fleet(config, run_dir) as fleet:
        sampler = GroupSampler.from_config(config, tasks, engine, fleet, images, agent_config,
                                           seed=config.seed + step0, on_rollout=record)
        sampler.start()
        bar = tqdm(total=config.steps, initial=step0, desc="train", disable=not progress)
        t_run = time.monotonic()
        trackers = open_trackers(config.tracking, run_dir, config.model_dump(mode="json"))
        try:
            while trainer.step_count < config.steps:
                step = trainer.step_count
                t0 = time.monotonic()
                groups = await sampler.next_batch(config.rollout.groups_per_step, step)
                waited = time.monotonic() - t0
                samples = samples_of(groups, trainer.max_len)
                if not samples:
                    raise TrainError("the step's rollouts carry no token ids: the inference "
                                     "engine must report them (engine=transformers does)")
                metrics = await asyncio.to_thread(trainer.step, samples)
                await asyncio.to_thread(engine.update_weights, trainer.export_weights(),
                                        trainer.step_count)
                metrics.update(step_metrics(sampler.take_stats(), groups, step))
                metrics.update(step=trainer.step_count, wait_seconds=waited,
                               elapsed=time.monotonic() - t_run)
                append_jsonl(metrics_path, metrics)
                trackers.log(metrics, trainer.step_count)
                if trainer.step_count % config.checkpoint_every == 0 \
                        or trainer.step_count == config.steps:
                    save_checkpoint(trainer, run_dir, config.keep_checkpoints)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}",
                                kept=f"{metrics.get('kept_fraction', 1):.2f}")
        finally:
            bar.close()
            trackers.close()
            await sampler.stop()
    write_plots(run_dir)
    return trainer.export_weights()


def step_metrics(stats, groups, step: int) -> dict[str, float]:
    """Rollout-side metrics of one step: every rollout finished since the last step (the
    learning curve), and the groups the step trained on."""
    from tmax.rl import batch_metrics

    rollouts = stats.rollouts
    valid = [t for t in rollouts if t.valid]
    scored = [t for t in valid if t.scored]  # a verifier error measures nothing: left out
    out = {"rollouts": len(rollouts),
           "reward_mean": (sum(t.score for t in scored) / len(scored)) if scored else float("nan"),
           "infra_failure_rate": (1 - len(valid) / len(rollouts)) if rollouts else 0.0,
           "verifier_error_rate": (sum(t.verifier_error is not None for t in valid)
                                   / len(valid)) if valid else 0.0,
           "internal_error_rate": (sum(t.internal_error is not None for t in rollouts)
                                   / len(rollouts)) if rollouts else 0.0,
           "contradicted_reward_rate": (sum(bool(t.contradicted_reward) for t in scored)
                                        / len(scored)) if scored else 0.0,
           "groups_done": stats.groups_done,
           "groups_filtered": sum(stats.groups_filtered.values()),
           "groups_stale": stats.groups_stale,
           "filtered_group_rate": (sum(stats.groups_filtered.values()) / stats.groups_done
                                   if stats.groups_done else 0.0)}
    trained = [t for g in groups for t in g.trajectories]
    out.update({f"batch_{k}": v for k, v in batch_metrics(
        [t.score if t.scored else None for t in trained], [t.scored for t in trained],
        [g.advantages for g in groups]).items() if isinstance(v, (int, float))})
    out["staleness_mean"] = sum(step - g.version for g in groups) / len(groups)
    for phase in ("queue", "start", "agent", "verifier"):
        vals = [t.timings.get(phase, 0.0) for t in rollouts]
        out[f"{phase}_seconds_mean"] = sum(vals) / len(vals) if vals else 0.0
    return out


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the metrics of steps after ``step`` (done before a crash, redone on resume)."""
    from tmax.rollout.trajectory import read_jsonl

    if not path.exists():
        return
    rows = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    os.replace(tmp, path)


def save_checkpoint(trainer, run_dir: Path, keep: int) -> Path:
    path = trainer.save(run_dir / "checkpoints" / f"step-{trainer.step_count}")
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"),
                   key=lambda p: int(p.name.split("-")[1]))
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    from tmax.rollout.trajectory import read_jsonl

    return list(read_jsonl(run_dir / "metrics.jsonl"))


def write_plots(run_dir: Path) -> list[Path]:
    """reward.png (mean reward per step) and train.png (loss, kept fraction, wait time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        return []
    steps = [r["step"] for r in rows]
    out = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rewards = [r["reward_mean"] for r in rows]
    ax.plot(steps, rewards, marker="o", alpha=0.5, label="per step")
    window = 5
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
              for i in range(len(rewards))]
    ax.plot(steps, smooth, linewidth=2, label=f"mean of last {window} steps")
    ax.legend(loc="lower right")
    ax.set(xlabel="trainer step", ylabel="mean reward (rollouts)", ylim=(-0.02, 1.02),
           title=run_dir.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "reward.png", dpi=100)
    plt.close(fig)
    out.append(run_dir / "reward.png")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, key in zip(axes, ("loss", "kept_fraction", "wait_seconds"), strict=True):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows])
        ax.set(title=key, xlabel="step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "train.png", dpi=100)
    plt.close(fig)
    out.append(run_dir / "train.png")
    return out
