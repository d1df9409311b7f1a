"""Dataset statistics: counts by axis, balance scores, instruction and verifier lengths.

Balance of a categorical axis = exp(entropy) / number of categories (the paper's "fraction
of uniform"): 1.0 when every category is equally common, 1/K when one holds everything.
Categories are those observed unless the caller names the full list (then unseen ones
count, and lower the score).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tmax.tasks import TaskError, find_tasks, load_task

AXES = ("domain", "skill_type", "difficulty", "verifier_kind", "fixture_kind", "language",
        "task_complexity", "command_complexity")
"""The axes counted, from ``metadata`` (domain, difficulty) and ``metadata.axes``."""


def balance(counts: dict[str, int], categories: Iterable[str] | None = None) -> float:
    """exp(H) / K with H the entropy (natural log) of the counts' distribution."""
    keys = list(categories) if categories is not None else [k for k, v in counts.items() if v]
    total = sum(counts.get(k, 0) for k in keys)
    if not keys or total == 0:
        return 0.0
    h = -sum(c / total * math.log(c / total) for k in keys if (c := counts.get(k, 0)))
    return math.exp(h) / len(keys)


def _length(values: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "max": 0}
    return {"mean": round(statistics.fmean(values), 1),
            "median": float(statistics.median(values)), "max": max(values)}


def dataset_stats(folder: str | Path) -> dict[str, Any]:
    """Counts by axis, balance per axis, instruction words and verifier lines of the native
    tasks under ``folder`` (tasks that do not load are counted as ``invalid``)."""
    counts: dict[str, Counter[str]] = {axis: Counter() for axis in AXES}
    words, verifier_lines, invalid, n = [], [], 0, 0
    for path in find_tasks(folder):
        try:
            task = load_task(path)
        except TaskError:
            invalid += 1
            continue
        n += 1
        meta = task.config.metadata
        values = {**meta.axes, "domain": meta.domain or "-", "difficulty": meta.difficulty}
        for axis in AXES:
            if axis in values:
                counts[axis][values[axis]] += 1
        words.append(len(task.instruction.split()))
        test = task.tests_dir / "test.sh"
        verifier_lines.append(len(test.read_text(errors="replace").splitlines())
                              if test.is_file() else 0)
    return {"folder": str(folder), "tasks": n, "invalid": invalid,
            "counts": {a: dict(sorted(c.items())) for a, c in counts.items() if c},
            "balance": {a: round(balance(c), 4) for a, c in counts.items() if c},
            "instruction_words": _length(words), "verifier_lines": _length(verifier_lines)}


def format_stats(all_stats: list[dict[str, Any]]) -> str:
    """The datasets side by side: one column per folder."""
    names = [Path(s["folder"]).name or s["folder"] for s in all_stats]
    if len(set(names)) < len(names):  # e.g. two runs' tasks/ folders
        names = ["/".join(Path(s["folder"]).parts[-2:]) for s in all_stats]
    rows: list[tuple[str, list[str]]] = [("tasks", [str(s["tasks"]) for s in all_stats]),
                                         ("invalid", [str(s["invalid"]) for s in all_stats])]
    axes = [a for a in AXES if any(a in s["counts"] for s in all_stats)]
    for axis in axes:
        rows.append((f"balance {axis}", [f"{s['balance'][axis]:.3f}" if axis in s["balance"]
                                         else "-" for s in all_stats]))
        values = sorted({v for s in all_stats for v in s["counts"].get(axis, {})})
        rows += [(f"  {axis}={v}", [str(s["counts"].get(axis, {}).get(v, 0))
                                    for s in all_stats]) for v in values]
    for key in ("instruction_words", "verifier_lines"):
        rows.append((f"{key} mean/median", [f"{s[key]['mean']}/{s[key]['median']}"
                                            for s in all_stats]))
    width = max(len(r[0]) for r in rows)
    cols = [max(len(n), *(len(r[1][i]) for r in rows)) for i, n in enumerate(names)]
    lines = [" " * width + "  " + "  ".join(f"{n:>{c}}" for n, c in zip(names, cols,
                                                                         strict=True))]
    lines += [f"{label:{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(vals, cols,
                                                                            strict=True))
              for label, vals in rows]
    return "\n".join(lines)
