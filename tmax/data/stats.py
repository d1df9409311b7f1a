"""Dataset statistics: counts by axis, balance scores, instruction and verifier lengths,
the yield of a ``tmax gen`` run, pass@k from a ``tmax eval``, PNG plots.

Balance of a categorical axis = exp(entropy) / number of categories (the paper's "fraction
of uniform"): 1.0 when every category is equally common, 1/K when one holds everything.
Categories are those observed unless the caller names the full list (then unseen ones
count, and lower the score).

A folder is a task folder, or a ``tmax gen`` run folder (it has ``records*.jsonl``; its
tasks are in ``RUN/tasks``), or the ``tasks`` folder of one: for a run, the stats add its
yield per stage (``gen.yield_table`` over the latest record of each seed, all shards) and
its drop reasons (``gen.drop_reasons``).

pass@k from an evaluation's ``results.jsonl`` (``tmax eval --out``): the episodes are the
summary's (``summary.final_records``: latest valid attempt of each (task, trial); verifier
errors are not scored), joined to the dataset's tasks by task id; a task is grouped by the
dataset's domain and difficulty, not the record's. pass@k (``summary.pass_at_k``, the
unbiased estimator) is the mean over the tasks with at least k scored trials, for k = 1, 2,
4, ... up to the most trials of a task (that number included). Eval tasks that are not in
the dataset are counted (``unmatched_tasks``) and left out of every score.

Counting, formatting and plotting are separate: ``dataset_stats`` returns plain data,
``format_stats`` and ``write_plots`` take a list of them (the datasets side by side).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tmax.data.gen import drop_reasons, format_yield, latest_records, yield_table
from tmax.eval.summary import final_records, group_row, pass_at_k
from tmax.rollout.trajectory import Trajectory
from tmax.tasks import TaskError, find_tasks, load_task

AXES = ("domain", "skill_type", "difficulty", "verifier_kind", "fixture_kind", "language",
        "task_complexity", "command_complexity")
"""The axes counted, from ``metadata`` (domain, difficulty) and ``metadata.axes``."""
LENGTHS = ("instruction_words", "verifier_lines")
GROUPS = ("domain", "difficulty")
"""The dataset axes pass@k is broken down by."""
RESULTS = "results.jsonl"
"""The records file in a ``tmax eval --out`` folder."""


class StatsError(Exception):
    """A folder or file the stats cannot use; the message names it."""


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


# ---------------------------------------------------------------------------- reading


def _has_records(folder: Path) -> bool:
    return any(folder.glob("records*.jsonl"))


def locate(folder: str | Path) -> tuple[Path, Path | None]:
    """(the task folder, the ``tmax gen`` run folder or None) of a folder given to stats."""
    p = Path(folder)
    if _has_records(p):
        return p / "tasks", p
    if p.name == "tasks" and _has_records(p.parent):
        return p, p.parent
    return p, None


def run_records(run: Path) -> list[dict[str, Any]]:
    """The latest record of each seed in ``run/records*.jsonl``, all shards, by seed."""
    found = latest_records(run)
    return [found[s] for s in sorted(found)]


def task_rows(tasks_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """One row per native task under ``tasks_dir`` (task id, axis values, lengths) and the
    number of tasks that do not load."""
    rows, invalid = [], 0
    for path in find_tasks(tasks_dir) if tasks_dir.is_dir() else []:
        try:
            task = load_task(path)
        except TaskError:
            invalid += 1
            continue
        meta = task.config.metadata
        values = {**meta.axes, "domain": meta.domain or "-", "difficulty": meta.difficulty}
        test = task.tests_dir / "test.sh"
        rows.append({"task_id": task.task_id,
                     "values": {a: values[a] for a in AXES if a in values},
                     "instruction_words": len(task.instruction.split()),
                     "verifier_lines": len(test.read_text(errors="replace").splitlines())
                     if test.is_file() else 0})
    return rows, invalid


def eval_results_path(path: str | Path) -> Path:
    """``path`` itself, or the ``results.jsonl`` of an eval folder."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS
        if not p.is_file():
            raise StatsError(f"{p.parent}: no {RESULTS} (not a `tmax eval` output folder)")
    return p


def read_eval(path: str | Path) -> list[Trajectory]:
    """The trajectory records of an eval's results file; ``StatsError`` naming the file and
    line of one that does not parse (an unterminated last line, torn by a crash, is
    skipped, as ``read_jsonl`` does)."""
    p = eval_results_path(path)
    try:
        lines = p.read_bytes().split(b"\n")
    except OSError as e:
        raise StatsError(f"{p}: cannot read ({e})") from None
    out = []
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            out.append(Trajectory.from_dict(json.loads(raw)))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            if no == len(lines):  # no newline after it: torn mid-write
                continue
            raise StatsError(f"{p}:{no}: not a trajectory record ({e})") from None
    if not out:
        raise StatsError(f"{p}: no trajectory records")
    return out


# ---------------------------------------------------------------------------- counting


def count_stats(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts and balance per axis, length summaries and the lengths themselves."""
    counts: dict[str, Counter[str]] = {axis: Counter() for axis in AXES}
    for row in rows:
        for axis, value in row["values"].items():
            counts[axis][value] += 1
    lengths = {key: [row[key] for row in rows] for key in LENGTHS}
    return {"counts": {a: dict(sorted(c.items())) for a, c in counts.items() if c},
            "balance": {a: round(balance(c), 4) for a, c in counts.items() if c},
            **{key: _length(v) for key, v in lengths.items()}, "lengths": lengths}


def run_yield(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's yield per stage by domain (and ``all``), drop reasons, unfinished seeds."""
    return {"records": len(records),
            "unfinished": sum(r["outcome"] == "error" for r in records),
            "table": yield_table(records),
            "drop_reasons": dict(drop_reasons(records).most_common())}


def ks_for(trials: int) -> list[int]:
    """1, 2, 4, ... up to ``trials``, and ``trials`` itself."""
    ks = [2 ** i for i in range(trials.bit_length()) if 2 ** i <= trials]
    return ks + ([trials] if trials and ks[-1] != trials else [])


def pass_at_ks(final: Mapping[tuple[str, int], Trajectory], ks: Sequence[int],
               threshold: float) -> dict[int, float | None]:
    """k -> mean pass@k over the tasks with at least k scored trials in ``final``."""
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for (task, _), r in final.items():
        by_task[task].append(r)
    out: dict[int, float | None] = {}
    for k in ks:
        vals = [pass_at_k(len(v), sum(r.score >= threshold for r in v), k)
                for v in by_task.values() if len(v) >= k]
        out[k] = round(statistics.fmean(vals), 6) if vals else None
    return out


def eval_stats(records: Iterable[Trajectory], tasks: Mapping[str, Mapping[str, str]], *,
               threshold: float = 1.0) -> dict[str, Any]:
    """pass@k (and mean reward, pass rate) of an eval's records over the dataset's
    ``tasks`` (task id -> axis values), overall and by the dataset's domain and
    difficulty."""
    scored = {key: r for key, r in final_records(records).items() if r.scored}
    final = {key: r for key, r in scored.items() if key[0] in tasks}
    trials = Counter(task for task, _ in final)
    ks = ks_for(max(trials.values(), default=0))

    def row(part: Mapping[tuple[str, int], Trajectory]) -> dict[str, Any]:
        return {**group_row(part, threshold), "pass_at_k": pass_at_ks(part, ks, threshold)}

    groups: dict[str, dict[str, Any]] = {}
    for axis in GROUPS:
        parts: dict[str, dict[tuple[str, int], Trajectory]] = defaultdict(dict)
        for key, r in final.items():
            parts[tasks[key[0]].get(axis, "-")][key] = r
        groups[axis] = {name: row(part) for name, part in sorted(parts.items())}
    return {"threshold": threshold, "trials": max(trials.values(), default=0), "ks": ks,
            **row(final),
            "unmatched_tasks": len({task for task, _ in scored} - set(tasks)),
            "tasks_without_eval": len(set(tasks) - set(trials)),
            **{f"by_{axis}": g for axis, g in groups.items()}}


def dataset_stats(folder: str | Path, eval_path: str | Path | None = None, *,
                  threshold: float = 1.0) -> dict[str, Any]:
    """Counts by axis, balance per axis, instruction words and verifier lines of the native
    tasks under ``folder`` (tasks that do not load are counted as ``invalid``); ``yield``
    when it is a gen run (see the module docstring); ``eval`` with ``eval_path``."""
    tasks_dir, run = locate(folder)
    rows, invalid = task_rows(tasks_dir)
    records = run_records(run) if run else []
    if not rows and not invalid and not records:
        raise StatsError(f"{folder}: no tasks and no `tmax gen` records (records*.jsonl)")
    stats: dict[str, Any] = {"folder": str(folder), "tasks_dir": str(tasks_dir),
                             "tasks": len(rows), "invalid": invalid, **count_stats(rows)}
    if run is not None:
        stats["yield"] = {"run": str(run), **run_yield(records)}
    if eval_path is not None:
        stats["eval"] = {"path": str(eval_results_path(eval_path)),
                         **eval_stats(read_eval(eval_path),
                                      {r["task_id"]: r["values"] for r in rows},
                                      threshold=threshold)}
    return stats


# ---------------------------------------------------------------------------- formatting


def dataset_names(all_stats: Sequence[Mapping[str, Any]]) -> list[str]:
    """A short column name per dataset: the folder's name, or its last two parts when two
    names clash (e.g. two runs' tasks/ folders)."""
    names = [Path(s["folder"]).name or s["folder"] for s in all_stats]
    if len(set(names)) < len(names):
        names = ["/".join(Path(s["folder"]).parts[-2:]) for s in all_stats]
    return names


Rows = list[tuple[str, list[str]]]


def _count_rows(all_stats: Sequence[Mapping[str, Any]]) -> Rows:
    rows: Rows = [("tasks", [str(s["tasks"]) for s in all_stats]),
                  ("invalid", [str(s["invalid"]) for s in all_stats])]
    for axis in [a for a in AXES if any(a in s["counts"] for s in all_stats)]:
        rows.append((f"balance {axis}", [f"{s['balance'][axis]:.3f}" if axis in s["balance"]
                                         else "-" for s in all_stats]))
        values = sorted({v for s in all_stats for v in s["counts"].get(axis, {})})
        rows += [(f"  {axis}={v}", [str(s["counts"].get(axis, {}).get(v, 0))
                                    for s in all_stats]) for v in values]
    for key in LENGTHS:
        rows.append((f"{key} mean/median", [f"{s[key]['mean']}/{s[key]['median']}"
                                            for s in all_stats]))
    return rows


def _yield_rows(all_stats: Sequence[Mapping[str, Any]]) -> Rows:
    runs = [s.get("yield") for s in all_stats]
    if not any(runs):
        return []
    zero = dict.fromkeys(("attempted", "parsed", "built", "checked", "kept"), 0)
    alls = [y["table"].get("all", zero) if y else None for y in runs]
    rows: Rows = [(f"yield {col}", ["-" if a is None else str(a[col]) for a in alls])
                  for col in zero]
    rows.append(("yield unfinished", ["-" if y is None else str(y["unfinished"])
                                      for y in runs]))
    reasons = sorted({r for y in runs if y for r in y["drop_reasons"]})
    rows += [(f"  dropped at {r}", ["-" if y is None else str(y["drop_reasons"].get(r, 0))
                                    for y in runs]) for r in reasons]
    return rows


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _eval_rows(all_stats: Sequence[Mapping[str, Any]]) -> Rows:
    evals = [s.get("eval") for s in all_stats]
    if not any(evals):
        return []
    ks = sorted({k for e in evals if e for k in e["ks"]})

    def cells(get) -> list[str]:
        return ["-" if e is None else get(e) for e in evals]

    rows: Rows = [("eval tasks", cells(lambda e: str(e["n_tasks"]))),
                  ("eval trials", cells(lambda e: str(e["n_trials"]))),
                  ("eval tasks not in dataset", cells(lambda e: str(e["unmatched_tasks"]))),
                  ("mean reward", cells(lambda e: _f(e["mean_reward"])))]
    rows += [(f"pass@{k}", cells(lambda e, k=k: _f(e["pass_at_k"].get(k)))) for k in ks]
    for axis in GROUPS:
        names = sorted({n for e in evals if e for n in e[f"by_{axis}"]})
        for name in names:
            rows += [(f"  {axis}={name} pass@{k}",
                      cells(lambda e, k=k, name=name, axis=axis: _f(
                          e[f"by_{axis}"].get(name, {}).get("pass_at_k", {}).get(k))))
                     for k in ks]
    return rows


def _render(names: Sequence[str], rows: Rows) -> str:
    width = max(len(r[0]) for r in rows)
    cols = [max(len(n), *(len(r[1][i]) for r in rows)) for i, n in enumerate(names)]
    lines = [" " * width + "  " + "  ".join(f"{n:>{c}}" for n, c in zip(names, cols,
                                                                         strict=True))]
    lines += [f"{label:{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(vals, cols,
                                                                            strict=True))
              for label, vals in rows]
    return "\n".join(lines)


def format_stats(all_stats: list[dict[str, Any]]) -> str:
    """The datasets side by side, one column per folder: counts, balance and lengths, the
    gen runs' yield, the evals' pass@k; then each run's yield table by domain."""
    names = dataset_names(all_stats)
    text = _render(names, _count_rows(all_stats) + _yield_rows(all_stats)
                   + _eval_rows(all_stats))
    for name, s in zip(names, all_stats, strict=True):
        if s.get("yield") and s["yield"]["table"]:
            text += f"\n\nyield of {name} ({s['yield']['run']}):\n"
            text += format_yield(s["yield"]["table"])
    return text


# ---------------------------------------------------------------------------- plotting


def _save(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG atomically (temp file in the same folder, then rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _bars(ax: Any, labels: Sequence[str], series: Mapping[str, Sequence[float]]) -> None:
    """Grouped bars: one group per label, one bar per dataset."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))],
               values, width, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def plot_specs(all_stats: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, list[str],
                                                                      dict[str, list[float]]]]:
    """(file name, title, labels, dataset -> values) of every bar chart: one per axis, the
    balance chart, and the yield per stage when a dataset is a gen run."""
    names = dataset_names(all_stats)
    specs = []
    for axis in [a for a in AXES if any(a in s["counts"] for s in all_stats)]:
        labels = sorted({v for s in all_stats for v in s["counts"].get(axis, {})})
        specs.append((f"axis_{axis}.png", f"tasks by {axis}", labels,
                      {n: [float(s["counts"].get(axis, {}).get(v, 0)) for v in labels]
                       for n, s in zip(names, all_stats, strict=True)}))
    axes = [a for a in AXES if any(a in s["balance"] for s in all_stats)]
    if axes:
        specs.append(("balance.png", "balance (exp(entropy) / categories)", axes,
                      {n: [s["balance"].get(a, 0.0) for a in axes]
                       for n, s in zip(names, all_stats, strict=True)}))
    runs = {n: s["yield"]["table"].get("all", {}) for n, s in zip(names, all_stats,
                                                                   strict=True)
            if s.get("yield")}
    if runs:
        cols = ["attempted", "parsed", "built", "checked", "kept"]
        specs.append(("yield.png", "gen yield per stage", cols,
                      {n: [float(t.get(c, 0)) for c in cols] for n, t in runs.items()}))
    return specs


def write_plots(all_stats: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """PNGs of the datasets side by side into ``out_dir`` (the bar charts of
    ``plot_specs``, ``lengths.png``, and ``pass_at_k.png`` when an eval was given); the
    paths written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def figure(width: float, height: float, ncols: int = 1) -> tuple[Any, Any]:
        fig = Figure(figsize=(width, height))
        FigureCanvasAgg(fig)
        return fig, fig.subplots(1, ncols)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, title, labels, series in plot_specs(all_stats):
        fig, ax = figure(max(5.0, 0.6 * len(labels) * max(len(series), 1) + 2), 4)
        _bars(ax, labels, series)
        ax.set_title(title)
        written.append(_save(fig, out / name))
    names = dataset_names(all_stats)
    fig, axs = figure(10, 3.8, ncols=len(LENGTHS))
    for ax, key in zip(axs, LENGTHS, strict=True):
        every = [v for s in all_stats for v in s["lengths"][key]]
        span = (min(every, default=0), max(every, default=0) + 1)  # the same bins for all
        for n, s in zip(names, all_stats, strict=True):
            if s["lengths"][key]:
                ax.hist(s["lengths"][key], bins=20, range=span, alpha=0.5, label=n)
        ax.set(title=key.replace("_", " "), xlabel=key.split("_")[-1], ylabel="tasks")
        if every:
            ax.legend(fontsize=8)
    written.append(_save(fig, out / "lengths.png"))
    evals = {n: s["eval"] for n, s in zip(names, all_stats, strict=True) if s.get("eval")}
    if evals:
        fig, ax = figure(6, 4)
        for n, e in evals.items():
            ks = [k for k in e["ks"] if e["pass_at_k"].get(k) is not None]
            ax.plot(ks, [e["pass_at_k"][k] for k in ks], marker="o", label=n)
        ax.set(title="pass@k", xlabel="k", ylabel="pass@k", ylim=(-0.02, 1.02))
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        written.append(_save(fig, out / "pass_at_k.png"))
    return written
