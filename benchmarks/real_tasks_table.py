"""The per-task table of a ``real_tasks.py measure`` results file, as Markdown.

    python benchmarks/real_tasks_table.py --sources SET/SOURCES.tsv --out SET/results.json \
        [--store DIR] [--collection NAME]

One row per task of ``SOURCES.tsv`` (of ``--collection``, in the file's order): validate,
build, the untouched environment's reward (nop) and the reference solution's (oracle), the
seconds of the ``tmax images build`` call (the build and its checks together), the image's
bytes in the store (``sif/<digest>.sif``; an image reused from the store counts the same),
and the first thing that stopped the task, or the reason it is marked not self-contained.
Tasks not in the results file are listed as not measured. A totals line follows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import real_tasks  # the benchmark beside this file (its classifier and sources reader)


def mark(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def reward(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def image_bytes(store: Path, digest: str) -> int | None:
    sif = store / "sif" / f"{digest}.sif"
    return sif.stat().st_size if digest and sif.is_file() else None


def rows(data: dict, sources: list[real_tasks.Source], store: Path) -> tuple[list[str], dict]:
    out, totals = [], {"n": len(sources), "measured": 0, "validate": 0, "build": 0,
                       "oracle1": 0, "nop_lt1": 0, "all": 0, "seconds": 0.0, "bytes": 0}
    for src in sources:
        rec = data["tasks"].get(src.id)
        note = "" if src.self_contained else f"not self-contained: {src.reason}"
        if rec is None:
            out.append(f"| {src.task} | not measured | | | | | | | {note} |")
            continue
        real_tasks.classify(rec, store)
        o = real_tasks.outcome(rec)
        b = rec.get("build") or {}
        checks = b.get("checks") or {}
        size = image_bytes(store, b.get("digest", "")) if o["build"] else None
        totals["measured"] += 1
        for k in ("validate", "build", "oracle1", "nop_lt1", "all"):
            totals[k] += bool(o[k])
        totals["seconds"] += b.get("seconds", 0.0)
        totals["bytes"] += size or 0
        cause = "all ok" if rec["cause"] == "ok" else f"{rec['cause']}: {rec['detail']}"
        cause = cause.replace("|", "\\|").replace("\n", " ")[:160]
        out.append(f"| {src.task} | {mark(o['validate'])} | "
                   f"{mark(o['build']) if rec['validate']['ok'] else '-'} | "
                   f"{reward(checks.get('oracle_reward'))} | {reward(checks.get('nop_reward'))} | "
                   f"{b.get('seconds', 0):.0f} | "
                   f"{'' if size is None else f'{size / 1e6:.0f}'} | {cause} | {note} |")
    return out, totals


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the results JSON of measure")
    p.add_argument("--store", type=Path, help="the image store [the run's, from the file]")
    p.add_argument("--collection", help="only this collection's tasks")
    args = p.parse_args(argv)
    data = json.loads(args.out.read_text())
    store = args.store or Path(data.get("runs", [{}])[-1].get("store", "/tmp/real-store"))
    sources = [s for s in real_tasks.read_sources(args.sources)
               if not args.collection or s.collection == args.collection]
    lines, t = rows(data, sources, store)
    print("| task | validate | build | oracle | nop | s | MB | first failure | marked |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    print(f"\n{t['measured']} of {t['n']} measured: validate {t['validate']}, build "
          f"{t['build']}, oracle 1 {t['oracle1']}, nop < 1 {t['nop_lt1']}, all ok {t['all']}; "
          f"{t['seconds']:.0f} s of build and checks; {t['bytes'] / 1e9:.2f} GB of images")


if __name__ == "__main__":
    main()
