"""Bytes of image stores: total, per task beyond shared layers, and what N tasks would take.

    python benchmarks/store_bytes.py STORE [STORE...] [--tasks 13000] [--only TASKS_DIR]...
        [--out FILE.json]

For each store (a ``tmax images`` store folder): the bytes of every distinct file its
manifest names (task images, layers, bases, separate verifiers), each task's own bytes
(files no other task of the store uses: ``tmax.images.store.own_bytes``), their median
and p90 (nearest rank), the shared bytes (bases and layers used by two tasks or more),
and ``shared + N x mean own`` as the size of N such tasks.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tmax.images.store import ImageStore, own_bytes


def nearest_rank(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))] \
        if ordered else 0


def measure(root: Path, n_tasks: int, only: Path | None = None) -> dict:
    manifest = ImageStore(root).read()
    if only is not None:  # the tasks of one folder, and the bases they use
        names = {p.name for p in only.iterdir() if p.is_dir()}
        manifest.tasks = {k: v for k, v in manifest.tasks.items() if k in names}
        manifest.bases = {k: v for k, v in manifest.bases.items()
                          if k in {e.base for e in manifest.tasks.values()}}
    files = {rel: size for e in manifest.tasks.values() for rel, size, _ in e.files()} | \
        {b.sif: b.size for b in manifest.bases.values()}
    own = own_bytes(manifest)
    shared = sum(files.values()) - sum(own.values())
    mean_own = statistics.fmean(own.values()) if own else 0.0
    return {
        "store": str(root) + (f" (tasks of {only})" if only else ""),
        "tasks": len(manifest.tasks), "bases": len(manifest.bases),
        "layered_tasks": sum(1 for e in manifest.tasks.values() if e.layers),
        "total_bytes": sum(files.values()), "shared_bytes": shared,
        "own_bytes_median": statistics.median(own.values()) if own else 0,
        "own_bytes_p90": nearest_rank(list(own.values()), 90),
        "own_bytes_max": max(own.values(), default=0),
        f"bytes_for_{n_tasks}_tasks": round(shared + n_tasks * mean_own),
        "own_bytes": dict(sorted(own.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stores", nargs="+", type=Path)
    parser.add_argument("--tasks", type=int, default=13000)
    parser.add_argument("--only", type=Path, action="append", default=[],
                        help="count only the tasks named by this folder's subfolders (and "
                             "their bases), once per --only, for each store")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = [measure(s, args.tasks, only) for s in args.stores
               for only in (args.only or [None])]
    for r in results:
        mb = 2**20
        print(f"{r['store']}: {r['tasks']} tasks ({r['layered_tasks']} layered), "
              f"{r['bases']} bases: {r['total_bytes'] / mb:.1f} MB in all, "
              f"{r['shared_bytes'] / mb:.1f} MB shared; own per task median "
              f"{r['own_bytes_median'] / mb:.3f} MB, p90 {r['own_bytes_p90'] / mb:.3f} MB; "
              f"{args.tasks} such tasks: {r[f'bytes_for_{args.tasks}_tasks'] / 2**30:.1f} GiB")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
