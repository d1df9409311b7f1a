"""Rollout throughput through a private local fleet at several concurrency levels.

    python benchmarks/rollout_bench.py [--concurrency 1 4 16] [--episodes 48]
        [--policy oracle|hf-tiny] [--store PATH] [--tasks examples/tasks] [--out FILE.json]
        [--torch-threads 1] [--no-warmup]

Every level runs the same list of ``(task, trial)`` episodes (round-robin over the tasks
found under ``--tasks``) with ``tmax.rollout.run.rollout``, at most ``c`` at once, through
ONE private fleet sized for the largest level (``open_fleet(None, concurrency=max)``,
sandboxes of 1 CPU / 1024 MB as the example tasks ask). Before the timed levels, one
untimed episode per task at the largest level warms the node's rootfs cache
(``--no-warmup`` skips it).

Per level: valid episodes per minute of wall time, mean and p50 of each phase of
``Trajectory.timings`` (queue, start, agent, verifier; mean over the episodes that have the
phase), the share of summed episode time (``total``) spent in each phase (``other``: image
lookup, the PATH probe, the lease release), infra failures, mean reward; and throughput
relative to concurrency 1 (or the smallest level run). All figures are from one run on a
shared machine: compare the ratios, not the absolute numbers.

Queue vs start: a grant's ``queued_s`` ends when the controller finds the lease a slot, so
``timings["queue"]`` is waiting for capacity and ``timings["start"]`` the sandbox start plus
the grant's trip back to the client. The loop is TMax's (``run_event_loop``: uvloop).

Policies: ``oracle`` (runs the task's solve.sh, then submits: no model), and ``hf-tiny``
(the tiny CPU model of configs/tiny-cpu.yaml with random weights, ``max_new_tokens`` 64,
agent config configs/agent-tiny.yaml): its replies are mostly format errors, so episodes
end on the step limit without a verifier run, but the agent phase is real generation.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

from sandfleet import run_event_loop

log = logging.getLogger("rollout_bench")

REPO = Path(__file__).resolve().parents[1]
PHASES = ("queue", "start", "agent", "verifier")
TINY_AGENT_CONFIG = REPO / "configs" / "agent-tiny.yaml"



def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def episode_list(tasks: list[Any], n: int) -> list[tuple[Any, int]]:
    """``n`` episodes, round-robin over ``tasks``: episode i is task i % len, trial i // len."""
    return [(tasks[i % len(tasks)], i // len(tasks)) for i in range(n)]


def make_bench_policy(name: str, tasks_paths: list[str], seed: int = 0) -> tuple[Any, Any]:
    """``(policy, agent_config)`` for ``oracle`` or ``hf-tiny``."""
    from tmax.agent.config import load_agent_config
    from tmax.agent.policies.choose import make_policy

    if name == "oracle":
        return make_policy("oracle"), load_agent_config()
    if name == "hf-tiny":
        from tmax.agent.policies.hf import HFPolicy
        from tmax.models.tiny import build_tiny_model, build_tokenizer, corpus_texts
        from tmax.tasks import find_tasks

        agent_config = load_agent_config(TINY_AGENT_CONFIG)
        texts = corpus_texts(find_tasks(*tasks_paths))
        texts += [agent_config.system_template, agent_config.instance_template]
        tokenizer = build_tokenizer(texts, 2048)  # as configs/tiny-cpu.yaml
        model = build_tiny_model(tokenizer, n_layers=2, d_model=128, n_heads=4,
                                 max_positions=1024, seed=seed)
        return HFPolicy(model, tokenizer, temperature=1.0, max_new_tokens=64, seed=seed,
                        name="hf-tiny"), agent_config
    raise SystemExit(f"unknown --policy {name!r}; choose oracle or hf-tiny")


async def run_level(fleet, episodes: list[tuple[Any, int]], policy, images, agent_config,
                    concurrency: int, desc: str) -> tuple[list[Any], float]:
    """Run ``episodes``, at most ``concurrency`` at once; ``(trajectories, wall seconds)``."""
    from tqdm.auto import tqdm

    from tmax.rollout.run import rollout

    slots = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(episodes), desc=desc, unit="ep", leave=False)

    async def one(task, trial):
        async with slots:
            traj = await rollout(task, policy, fleet, images, agent_config, trial=trial)
        bar.update(1)
        return traj

    t0 = time.perf_counter()
    try:
        trajs = await asyncio.gather(*(one(task, trial) for task, trial in episodes))
    finally:
        bar.close()
    return list(trajs), time.perf_counter() - t0


def summarize(trajs: list[Any], wall: float, concurrency: int) -> dict[str, Any]:
    """One level's figures (see the module docstring)."""
    valid = [t for t in trajs if t.valid]
    total = sum(t.timings.get("total", 0.0) for t in trajs)
    phases: dict[str, Any] = {}
    covered = 0.0
    for phase in PHASES:
        values = [t.timings[phase] for t in trajs if phase in t.timings]
        spent = sum(values)
        covered += spent
        phases[phase] = {"n": len(values),
                         "mean_s": round(statistics.mean(values), 4) if values else None,
                         "p50_s": round(percentile(values, 50), 4) if values else None,
                         "share": round(spent / total, 4) if total else None}
    phases["other"] = {"share": round((total - covered) / total, 4) if total else None}
    infra: dict[str, int] = {}
    for t in trajs:
        if t.infra_failure is not None:
            cause = t.infra_failure.get("cause", "infra")
            infra[cause] = infra.get(cause, 0) + 1
    ends: dict[str, int] = {}
    for t in valid:
        ends[t.end_reason or "?"] = ends.get(t.end_reason or "?", 0) + 1
    return {"concurrency": concurrency, "episodes": len(trajs), "valid": len(valid),
            "wall_s": round(wall, 2), "episodes_per_min": round(len(valid) / wall * 60, 2),
            "episode_total_mean_s": round(total / len(trajs), 4) if trajs else None,
            "phases": phases, "infra_failures": sum(infra.values()), "infra_causes": infra,
            "reward_mean": round(statistics.mean(t.score for t in valid), 4) if valid else None,
            "end_reasons": ends}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from tmax.fleet import open_fleet
    from tmax.rollout.run import TaskImages
    from tmax.tasks import find_tasks, load_task

    started = machine()
    tasks = sorted((load_task(p) for p in find_tasks(*args.tasks)), key=lambda t: t.task_id)
    if not tasks:
        raise SystemExit(f"no tasks under {args.tasks}")
    episodes = episode_list(tasks, args.episodes)
    policy, agent_config = make_bench_policy(args.policy, args.tasks)
    images = TaskImages(args.store)
    levels = sorted(set(args.concurrency))
    top = levels[-1]
    results = []
    async with open_fleet(None, concurrency=top, sandbox_cpus=1,
                          sandbox_memory_mb=1024) as fleet:
        if not args.no_warmup:
            warm = episode_list(tasks, len(tasks))
            trajs, wall = await run_level(fleet, warm, policy, images, agent_config, top,
                                          "warm-up")
            log.info("warm-up: %d episodes in %.1f s (%d infra failures)", len(trajs), wall,
                     sum(1 for t in trajs if not t.valid))
        for c in levels:
            before = dict(getattr(policy, "batch_sizes", {}))
            trajs, wall = await run_level(fleet, episodes, policy, images, agent_config, c,
                                          f"concurrency {c}")
            results.append(summarize(trajs, wall, c))
            if hasattr(policy, "batch_sizes"):  # hf-tiny: how well generation batched
                sizes = {k: v - before.get(k, 0) for k, v in policy.batch_sizes.items()}
                n = sum(sizes.values())
                results[-1]["generation_batches"] = n
                results[-1]["generation_batch_mean"] = \
                    round(sum(k * v for k, v in sizes.items()) / n, 2) if n else None
            log.info("concurrency %d: %.1f episodes/min (%d infra failures)", c,
                     results[-1]["episodes_per_min"], results[-1]["infra_failures"])
    base = results[0]["episodes_per_min"]
    for r in results:
        r["throughput_vs_lowest"] = round(r["episodes_per_min"] / base, 3) if base else None
    return {"benchmark": "rollout throughput", "machine": started, "policy": args.policy,
            "tasks": len(tasks), "episodes_per_level": len(episodes),
            "fleet": f"private local fleet, 1 worker, {top} slots of 1 CPU / 1024 MB",
            "baseline_concurrency": levels[0], "levels": results}


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(report: dict[str, Any]) -> str:
    head = (f"{'conc':>4} {'ep/min':>7} {'x base':>6} {'infra':>5} {'reward':>6}  "
            + "  ".join(f"{p + ' mean/p50 s':>20}" for p in PHASES)
            + "  share q/s/a/v/other")
    lines = [head]
    for r in report["levels"]:
        ph = r["phases"]
        cells = [f"{fmt(ph[p]['mean_s']):>9}/{fmt(ph[p]['p50_s']):<10}" for p in PHASES]
        shares = "/".join(f"{(ph[p]['share'] or 0) * 100:.0f}" for p in (*PHASES, "other"))
        lines.append(f"{r['concurrency']:>4} {r['episodes_per_min']:>7.1f} "
                     f"{r['throughput_vs_lowest']:>6.2f} {r['infra_failures']:>5} "
                     f"{r['reward_mean'] if r['reward_mean'] is not None else '-':>6}  "
                     + "  ".join(f"{c:>20}" for c in cells) + f"  {shares} %")
    for r in report["levels"]:
        if r.get("generation_batch_mean") is not None:
            lines.append(f"concurrency {r['concurrency']}: {r['generation_batches']} generation "
                         f"batches, mean size {r['generation_batch_mean']}")
    return "\n".join(lines)


def main() -> None:
    from tmax.images.store import default_store

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--episodes", type=int, default=48, help="episodes per level")
    parser.add_argument("--policy", choices=["oracle", "hf-tiny"], default="oracle")
    parser.add_argument("--store", default=default_store(), help="image store")
    parser.add_argument("--tasks", nargs="+", default=[str(REPO / "examples" / "tasks")])
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the untimed episode per task before the levels")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="hf-tiny: torch CPU threads (1, as configs/tiny-cpu.yaml)")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args()
    if min(args.concurrency) < 1 or args.episodes < 1:
        parser.error("--concurrency and --episodes must be at least 1")
    if args.policy == "hf-tiny":
        import torch
        torch.set_num_threads(args.torch_threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = run_event_loop(bench(args))
    emit(report, f"{report['benchmark']}: {report['policy']}, {report['episodes_per_level']} "
          f"episodes per level over {report['tasks']} tasks; {report['machine']}", table(report), args.out)


if __name__ == "__main__":
    main()
