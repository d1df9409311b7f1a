"""The audit-and-repair report: label counts before and after, the repairs made, what was
dropped and why, the probe cost; as JSON, text and a bar chart (PNG, matplotlib's Agg
backend, imported only when the plot is written)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tmax.audit.labels import FIXABLE
from tmax.audit.repair import RepairRecord
from tmax.audit.run import AuditRecord, label_counts


def repair_report(audits: Sequence[AuditRecord], repairs: Sequence[RepairRecord]
                  ) -> dict[str, Any]:
    """Counts before (each task's audit label) and after (the kept and repaired tasks'
    labels after the repair; dropped tasks are gone), the repairs, the drops."""
    after: Counter[str] = Counter()
    for r in repairs:
        if r.action in ("kept", "repaired"):
            after[r.after or "unlabelled"] += 1
    actions = Counter(r.action for r in repairs)
    sandbox = sum(a.sandbox_s for a in audits) + sum(r.sandbox_s for r in repairs)
    return {
        "tasks": len(audits),
        "before": label_counts(audits),
        "after": dict(sorted(after.items(), key=lambda kv: (-kv[1], kv[0]))),
        "actions": dict(actions),
        "repaired": [{"task": r.task, "label": r.before, "changes": r.changes,
                      "attempts": r.attempts} for r in repairs if r.action == "repaired"],
        "dropped": [{"task": r.task, "label": r.before, "reason": r.reason}
                    for r in repairs if r.action == "dropped"],
        "drop_reasons": dict(Counter(_kind(r) for r in repairs if r.action == "dropped")),
        "unfinished": [{"task": r.task, "reason": r.reason} for r in repairs
                       if r.action == "error"],
        "sandbox_s": round(sandbox, 1),
        "sandbox_s_per_task": round(sandbox / len(audits), 2) if audits else 0.0,
    }


def _kind(r: RepairRecord) -> str:
    if r.before is None:
        return "not audited"
    if r.before not in FIXABLE:
        return f"{r.before} (not repairable)"
    if r.attempts == 0:
        return f"{r.before}: no teacher to repair it"
    return f"{r.before}: repair did not hold"


def format_report(report: dict[str, Any]) -> str:
    labels = sorted(set(report["before"]) | set(report["after"]),
                    key=lambda k: -report["before"].get(k, 0))
    lines = [f"{report['tasks']} tasks: " + ", ".join(f"{n} {a}" for a, n in
                                                    sorted(report["actions"].items())),
             f"  {'label':32s} {'before':>7s} {'after':>7s}"]
    for label in labels:
        lines.append(f"  {label:32s} {report['before'].get(label, 0):7d} "
                     f"{report['after'].get(label, 0):7d}")
    for r in report["repaired"]:
        lines.append(f"repaired {r['task']} ({r['label']}): " + "; ".join(r["changes"]))
    for r in report["dropped"]:
        lines.append(f"dropped {r['task']} ({r['label']}): {r['reason'][:300]}")
    for r in report["unfinished"]:
        lines.append(f"not finished {r['task']}: {r['reason'][:300]}")
    lines.append(f"probe cost: {report['sandbox_s']} sandbox-s "
                 f"({report['sandbox_s_per_task']} per task)")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: str | Path) -> list[Path]:
    """report.json, report.txt and labels.png in ``out`` (each written then renamed)."""
    out = Path(out)
    written = []
    for name, text in (("report.json", json.dumps(report, indent=2) + "\n"),
                       ("report.txt", format_report(report) + "\n")):
        tmp = out / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
        written.append(out / name)
    written.append(plot_labels(report, out / "labels.png"))
    return written


def plot_labels(report: dict[str, Any], path: Path) -> Path:
    """Bars of the label counts before and after, side by side."""
    from tmax.eval.report import _pyplot

    plt = _pyplot()
    labels = sorted(set(report["before"]) | set(report["after"]),
                    key=lambda k: -report["before"].get(k, 0))
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels)), 4.0))
    ax.bar([x - 0.2 for x in xs], [report["before"].get(k, 0) for k in labels], 0.4,
           label="before")
    ax.bar([x + 0.2 for x in xs], [report["after"].get(k, 0) for k in labels], 0.4,
           label="after repair")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tasks")
    ax.set_title(f"audit labels ({report['tasks']} tasks)")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


__all__ = ["format_report", "plot_labels", "repair_report", "write_report"]
