"""Before and after a refactor, in one interleaved run: lease acquire and exec round trips
through a local fleet (``sandfleet_bench.py exec``) and a tiny training step
(``trainer_bench.py``), each run from a checkout of the old revision and from this one,
alternately, so load on a shared machine hits both alike.

    python benchmarks/refactor_compare.py --image IMAGE.sif [--old 0394fd5] [--rounds 3]
        [-n 200] [--out FILE.json]

The old revision is checked out with ``git worktree`` in a temporary folder (removed at the
end) and run with its own packages first on ``PYTHONPATH``. Both run with
``SANDFLEET_PREPARED=0`` (nothing made ahead; older revisions have no such thing): the
figures compare the code paths, not the start-ahead pools. Per metric: the median over the
rounds of each round's p50 (exec, acquire) or tokens/s (training), and new/old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine

REPO = Path(__file__).resolve().parents[1]
EXEC_ROWS = {"lease acquire (warm image cache, idle worker)": "acquire_p50_ms",
             "exec `true` through a lease (sync client)": "exec_fleet_p50_ms",
             "exec `true` through a lease (asyncio client, uvloop)": "exec_async_p50_ms",
             "exec `true` via ShellSession.run, no fleet": "exec_shell_p50_ms"}


def run_tree(tree: Path, argv: list[str], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "SANDFLEET_PREPARED": "0"}
    out = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(argv)} failed ({out.returncode}):\n"
                         f"{out.stderr[-3000:]}")
    return out.stdout


def exec_figures(tree: Path, image: str, n: int) -> dict[str, float]:
    out = run_tree(tree, ["benchmarks/sandfleet_bench.py", "--image", image, "-n", str(n),
                          "exec"], 1800)
    figures = {}
    for line in out.splitlines():
        row = json.loads(line) if line.startswith("{") else {}
        if row.get("what") in EXEC_ROWS:
            figures[EXEC_ROWS[row["what"]]] = row["p50_ms"]
    return figures


def train_figures(tree: Path, report: Path) -> dict[str, float]:
    run_tree(tree, ["benchmarks/trainer_bench.py", "--sequences", "8", "--warmup", "1",
                    "--repeats", "3", "--out", str(report)], 1800)
    rows = json.loads(report.read_text())["rows"]
    row = next(r for r in rows if r["variant"] == "dppo+fp32head" and r["dtype"] == "float32")
    return {"train_step_tokens_per_s": row["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--image", required=True)
    parser.add_argument("--old", default="0394fd5")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-n", type=int, default=200, help="exec samples per way and run")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    image = str(Path(args.image).resolve())
    old_rev = subprocess.run(["git", "rev-parse", "--short", args.old], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.strip()
    new_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="refactor-compare-") as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.old], cwd=REPO,
                       capture_output=True, check=True)
        try:
            samples: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
            for k in range(args.rounds):
                for name, tree in (("old", old), ("new", REPO)):
                    figures = exec_figures(tree, image, args.n)
                    figures |= train_figures(tree, Path(tmp) / f"train-{name}-{k}.json")
                    for key, value in figures.items():
                        samples[name].setdefault(key, []).append(value)
                    print(json.dumps({"round": k, "tree": name, **figures}), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO,
                           capture_output=True, check=False)
    summary = {"benchmark": "refactor_compare", "old": old_rev, "new": new_rev,
               "machine": machine(), "rounds": args.rounds, "metrics": {}}
    for key in samples["new"]:
        o, n = (statistics.median(samples[t][key]) for t in ("old", "new"))
        summary["metrics"][key] = {"old": round(o, 3), "new": round(n, 3),
                                   "new_over_old": round(n / o, 3) if o else None}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
