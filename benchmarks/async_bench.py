"""How much of a run's wall time the trainer waits for rollouts: synchronous
(``rollout.async_steps=0``) vs asynchronous (``rollout.async_steps=4``) on a short real run
of configs/tiny-cpu.yaml (tiny model, SFT warm start, DPPO against a private local fleet).

    python benchmarks/async_bench.py [--steps 6] [--sft-steps 55] [--async-steps 4]
        [--config configs/tiny-cpu.yaml] [--set KEY=VALUE ...] [--root DIR] [--out FILE.json]

Both runs go through ``tmax.train.loop.train`` with the same config but
``rollout.async_steps``; the synchronous run goes first and its SFT init (``RUN/init``) is
copied into the asynchronous run's folder, which the loop then reuses, so both start from
the same weights and the second does no SFT. From each run's metrics.jsonl:

- wall time of the RL phase: ``elapsed`` of the last step (from the first rollout request;
  SFT and fleet start-up excluded);
- rollouts/min: rollouts finished over that time (in-flight ones at the end not counted);
- trainer wait share: sum(``wait_seconds``) / wall; trainer busy share: sum(``train_seconds``)
  / wall; and the same two from step 2 on (``steady``: step 1 always waits for a first batch);

and async vs sync ratios. One run each on a shared machine: read the ratios, and rerun
before trusting small differences. ``--root`` keeps the run folders (default: a temporary
folder, removed at the end).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

log = logging.getLogger("async_bench")

REPO = Path(__file__).resolve().parents[1]



def run(config_path: Path, run_dir: Path, overrides: list[str], init_from: Path | None
        ) -> tuple[Path, float]:
    """One training run in ``run_dir``; ``(run_dir, seconds of the whole call)``."""
    from tmax.train.config import load_train_config
    from tmax.train.loop import train

    config = load_train_config(config_path, [f"out_dir={run_dir}", *overrides])
    if init_from is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(init_from, run_dir / "init")
    t0 = time.perf_counter()
    train(config, progress=True)
    return run_dir, time.perf_counter() - t0


def summarize(run_dir: Path, call_s: float, async_steps: int) -> dict[str, Any]:
    from tmax.train.loop import read_metrics

    rows = read_metrics(run_dir)
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no steps")
    wall = rows[-1]["elapsed"]
    wait = sum(r["wait_seconds"] for r in rows)
    busy = sum(r["train_seconds"] for r in rows)
    rollouts = sum(r["rollouts"] for r in rows)
    steady_wall = wall - rows[0]["elapsed"]
    steady = {}
    if len(rows) > 1 and steady_wall > 0:
        steady = {"steady_wait_share": round(sum(r["wait_seconds"] for r in rows[1:])
                                             / steady_wall, 4),
                  "steady_train_share": round(sum(r["train_seconds"] for r in rows[1:])
                                              / steady_wall, 4),
                  "steady_rollouts_per_min": round(sum(r["rollouts"] for r in rows[1:])
                                                   / steady_wall * 60, 2)}
    return {"async_steps": async_steps, "run_dir": str(run_dir), "steps": len(rows),
            "wall_s": round(wall, 2), "call_s": round(call_s, 2), "rollouts": rollouts,
            "rollouts_per_min": round(rollouts / wall * 60, 2),
            "wait_s": round(wait, 2), "wait_share": round(wait / wall, 4),
            "train_s": round(busy, 2), "train_share": round(busy / wall, 4), **steady,
            "first_step_wait_s": round(rows[0]["wait_seconds"], 2),
            "staleness_mean": round(sum(r.get("staleness_mean", 0.0) for r in rows)
                                    / len(rows), 3),
            "groups_stale": sum(r.get("groups_stale", 0) for r in rows),
            "reward_mean_last": rows[-1].get("reward_mean")}


def ratios(sync: dict[str, Any], asyn: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str, invert: bool = False) -> float | None:
        a, s = asyn.get(key), sync.get(key)
        if a is None or s is None or (a if invert else s) == 0:
            return None
        return round(s / a if invert else a / s, 3)
    return {"speedup_wall (sync/async)": ratio("wall_s", invert=True),
            "rollouts_per_min (async/sync)": ratio("rollouts_per_min"),
            "wait_share (async/sync)": ratio("wait_share"),
            "steady_wait_share (async/sync)": ratio("steady_wait_share")}


def table(report: dict[str, Any]) -> str:
    cols = [("mode", 6, "{}"), ("steps", 5, "{}"), ("wall s", 7, "{:.1f}"),
            ("rollouts", 8, "{}"), ("roll/min", 8, "{:.1f}"), ("wait", 6, "{:.0%}"),
            ("train", 6, "{:.0%}"), ("wait*", 6, "{:.0%}"), ("train*", 6, "{:.0%}"),
            ("stale", 5, "{}")]
    keys = ["mode", "steps", "wall_s", "rollouts", "rollouts_per_min", "wait_share",
            "train_share", "steady_wait_share", "steady_train_share", "groups_stale"]
    lines = [" ".join(f"{name:>{w}}" for name, w, _ in cols)]
    for r in report["runs"]:
        row = {**r, "mode": "sync" if r["async_steps"] == 0 else f"async{r['async_steps']}"}
        lines.append(" ".join(f"{'-' if row.get(k) is None else f.format(row[k]):>{w}}"
                              for k, (_, w, f) in zip(keys, cols, strict=True)))
    lines.append("(wait/train: share of the RL wall time; *: from step 2 on)")
    lines += [f"{k}: {v}" for k, v in report["ratios"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sft-steps", type=int, default=55)
    parser.add_argument("--async-steps", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="more config overrides (repeatable)")
    parser.add_argument("--root", type=Path, help="keep the run folders here")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args()
    if args.async_steps < 1:
        parser.error("--async-steps must be at least 1 (0 is the synchronous baseline)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    root = args.root or Path(tempfile.mkdtemp(prefix="tmax-async-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    common = [f"steps={args.steps}", f"sft.steps={args.sft_steps}", *args.overrides]
    started = machine()
    try:
        runs = []
        init = None
        for mode in (0, args.async_steps):
            run_dir = root / ("sync" if mode == 0 else f"async{mode}")
            if run_dir.exists():
                raise SystemExit(f"{run_dir} exists; use an empty --root")
            log.info("run %s (rollout.async_steps=%d)", run_dir.name, mode)
            run_dir, call_s = run(args.config, run_dir,
                                  [*common, f"rollout.async_steps={mode}"], init)
            runs.append(summarize(run_dir, call_s, mode))
            init = run_dir / "init"
        report = {"benchmark": "trainer wait for rollouts, sync vs async", "machine": started,
                  "config": str(args.config), "overrides": common, "runs": runs,
                  "ratios": ratios(runs[0], runs[1])}
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    emit(report, f"{report['benchmark']}: {report['config']} {' '.join(common)}; {started}", table(report), args.out)


if __name__ == "__main__":
    main()
