"""Plots of an evaluation (PNG, matplotlib's Agg backend, imported only here):

- ``reward_by_domain.png``: mean reward per domain with its standard error, and overall;
- ``pass_at_k.png``: pass@k for k = 1..K;
- ``phase_times.png``: mean seconds per phase (queue, start, agent, verifier) per task.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tmax.eval.summary import final_records
from tmax.rollout.trajectory import Trajectory

PHASE_COLORS = {"queue": "#bbbbbb", "start": "#8da0cb", "agent": "#66c2a5",
                "verifier": "#fc8d62"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def write_plots(summary: Mapping[str, Any], records: Iterable[Trajectory | Mapping[str, Any]],
                out_dir: str | Path) -> list[Path]:
    """Write the plots into ``out_dir``; the paths written."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trajs = [r if isinstance(r, Trajectory) else Trajectory.from_dict(dict(r)) for r in records]
    title = ", ".join(summary["policies"]) or "eval"
    written = []
    for name, draw in (("reward_by_domain.png", _reward_by_domain),
                       ("pass_at_k.png", _pass_at_k), ("phase_times.png", _phase_times)):
        fig = draw(plt, summary, trajs, title)
        path = out / name
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _reward_by_domain(plt, summary, _records, title):
    rows = {**summary["by_domain"], "ALL": {k: summary[k] for k in (
        "mean_reward", "reward_se", "n_tasks")}}
    names = list(rows)
    means = [rows[n]["mean_reward"] or 0.0 for n in names]
    errs = [rows[n]["reward_se"] or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(names) + 2), 4))
    colors = ["#66c2a5"] * (len(names) - 1) + ["#444444"]
    ax.bar(range(len(names)), means, yerr=errs, capsize=4, color=colors)
    ax.set_xticks(range(len(names)),
                  [f"{n}\n(n={rows[n]['n_tasks']})" for n in names], rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("mean reward (± SE)")
    ax.set_title(f"{title}: reward by domain")
    return fig


def _pass_at_k(plt, summary, _records, title):
    points = sorted((int(k), v) for k, v in summary["pass_at_k"].items() if v is not None)
    fig, ax = plt.subplots(figsize=(5, 4))
    if points:
        ks, vs = zip(*points)
        ax.plot(ks, vs, marker="o")
        ax.set_xticks(ks)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("k (trials)")
    ax.set_ylabel("pass@k")
    ax.set_title(f"{title}: pass@k")
    ax.grid(alpha=0.3)
    return fig


def _phase_times(plt, _summary, records, title):
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for (task, _), r in sorted(final_records(records).items()):
        by_task[task].append(r)
    tasks = sorted(by_task)
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.28 * len(tasks) + 1.5)))
    left = [0.0] * len(tasks)
    for phase, color in PHASE_COLORS.items():
        widths = [sum(r.timings.get(phase, 0.0) for r in by_task[t]) / len(by_task[t])
                  for t in tasks]
        ax.barh(range(len(tasks)), widths, left=left, color=color, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(tasks)), tasks, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("mean seconds per episode")
    ax.set_title(f"{title}: time per phase")
    ax.legend(fontsize=8, loc="lower right")
    return fig


__all__ = ["write_plots"]
