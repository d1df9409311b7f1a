"""Start and stop local sandboxes from a SIF; print start and first-exec latencies as JSON.

    python benchmarks/sandbox_start.py IMAGE.sif [-n 20] [--old]

The first start runs on a fresh runtime, with nothing made or started ahead
(``cold_start_ms``); the next ``n`` starts are of the image seen before, each once the
runtime's pools are full again (disks made ahead, a sandbox started ahead for the shape:
``prepared=2, ready=1``, what a worker runs), or with ``--old`` with nothing ahead
(``prepared=0, ready=0``, as ``SANDFLEET_PREPARED=0``). ``start`` returns once the sandbox
can run commands (image environment read); ``first_exec`` is the first ``true`` after that.
benchmarks/runtime_compare.py compares both modes on both runtimes in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from sandfleet.runtime.base import SandboxSpec
from sandfleet.runtime.local import LocalRuntime


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", type=Path)
    parser.add_argument("-n", type=int, default=20, help="warm starts to time")
    parser.add_argument("--old", action="store_true",
                        help="nothing made or started ahead (prepared=0, ready=0)")
    args = parser.parse_args()
    spec = SandboxSpec(image=args.image.resolve())
    ahead = {"prepared": 0, "ready": 0} if args.old else {"prepared": 2, "ready": 1}
    with tempfile.TemporaryDirectory(prefix="sandfleet-bench-") as tmp:
        runtime = LocalRuntime(Path(tmp) / "state", Path(tmp) / "cache", owner="bench",
                               **ahead)
        t0 = time.perf_counter()
        runtime.start("cold", spec)
        cold = time.perf_counter() - t0
        runtime.stop("cold")
        starts, execs, stops = [], [], []
        for i in range(args.n):
            settle = time.monotonic() + 60
            while not (runtime.ready.idle() and runtime.disks.idle()) \
                    and time.monotonic() < settle:
                time.sleep(0.02)
            t0 = time.perf_counter()
            runtime.start(f"b{i}", spec)
            t1 = time.perf_counter()
            runtime.exec(f"b{i}", ["true"], timeout=30)
            t2 = time.perf_counter()
            runtime.stop(f"b{i}")
            starts.append(t1 - t0)
            execs.append(t2 - t1)
            stops.append(time.perf_counter() - t2)
        taken, missed = runtime.ready.taken, runtime.ready.missed
        runtime.close()
    def ms(seconds: float) -> float:
        return round(seconds * 1000, 1)

    print(json.dumps({
        "image": str(args.image), "n": args.n, "cpus": os.cpu_count(), **ahead,
        "started_ahead_taken": taken, "started_ahead_missed": missed,
        "cold_start_ms": ms(cold),
        "start_p50_ms": ms(percentile(starts, 50)), "start_p90_ms": ms(percentile(starts, 90)),
        "first_exec_p50_ms": ms(percentile(execs, 50)),
        "first_exec_p90_ms": ms(percentile(execs, 90)),
        "stop_p50_ms": ms(percentile(stops, 50)),
    }, indent=1))


if __name__ == "__main__":
    main()
