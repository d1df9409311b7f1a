"""The local and apptainer runtimes side by side, in one run, on one image.

    python benchmarks/runtime_compare.py IMAGE.sif [--new 5] [--seen 15] [--out FILE]

Per runtime (``local``: bubblewrap, as root; ``apptainer``: instances, as whoever runs
this, through bin/tmax-apptainer where no apptainer is on PATH):

- ``acquire_new``: ``runtime.start`` of an image new to the node (a fresh state and cache
  folder each time: the local runtime unpacks the image, the apptainer one has nothing to
  reuse) and ``acquire_seen`` with the image seen before (same folders), p50 and p99
  (nearest rank: with 15 starts p99 is the slowest);
- ``shell_run_true``: ``run("true")`` p50 through the persistent shell (what
  ``lease.run`` goes through on the worker), and ``exec_true``: a one-off
  ``exec(["true"])`` (a new ``apptainer exec`` each time on Apptainer);
- ``verify``: the sandbox's verifier on a trivial test.sh (writes reward 1), first in a
  fresh folder and then p50 of the next ones;
- ``disk_per_lease``: bytes allocated in the runtime's folders while one lease (default
  spec: storage_mb 10240) is up, minus before, and the sectors the node's block device wrote
  over that lease's start-exec-stop (machine-wide: other processes count too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine
from sandfleet.runtime import get_runtime
from sandfleet.runtime.base import SandboxSpec
from sandfleet.shell import ShellSession

TEST_SH = "#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def make(name: str, root: Path):
    kwargs = {"state_dir": root / "state", "owner": "bench"}
    if name == "local":
        kwargs["cache_dir"] = root / "cache"
    else:  # as root: a benchmark on a machine of one's own (see ROOT_REFUSAL)
        kwargs["allow_host_root"] = True
    return get_runtime(name, **kwargs)


def allocated(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


def sectors_written(path: Path) -> int | None:
    """Sectors written by the block device holding ``path`` (/sys/block/*/stat)."""
    dev = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    try:
        return int(sysfs.read_text().split()[6])
    except (OSError, IndexError, ValueError):
        return None


def bench(name: str, image: Path, n_new: int, n_seen: int, tmp: Path) -> dict:
    spec = SandboxSpec(image=image)
    new = []
    for i in range(n_new):
        runtime = make(name, tmp / f"{name}-new{i}")
        t0 = time.perf_counter()
        runtime.start("n", spec)
        new.append(time.perf_counter() - t0)
        runtime.stop("n")
    runtime = make(name, tmp / f"{name}-seen")
    runtime.start("warm", spec)
    runtime.stop("warm")
    seen, true, shell_true = [], [], []
    for i in range(n_seen):
        t0 = time.perf_counter()
        runtime.start(f"s{i}", spec)
        seen.append(time.perf_counter() - t0)
        if i == 0:
            for _ in range(20):
                t1 = time.perf_counter()
                runtime.exec("s0", ["true"], timeout=60)
                true.append(time.perf_counter() - t1)
            shell = ShellSession(runtime, "s0")  # what lease.run goes through
            shell.start()
            for _ in range(50):
                t1 = time.perf_counter()
                shell.run("true", 60)
                shell_true.append(time.perf_counter() - t1)
            shell.close()
        runtime.stop(f"s{i}")
    tests = tmp / "tests"
    tests.mkdir(exist_ok=True)
    (tests / "test.sh").write_text(TEST_SH)
    fresh = make(name, tmp / f"{name}-verify")
    fresh.start("v", spec)
    verifies, rewards = [], []
    for _ in range(6):
        t0 = time.perf_counter()
        fresh.verify("v", ["sh", "/tests/test.sh"], tests=tests, logs=tmp / f"logs-{name}",
                     timeout=120)
        verifies.append(time.perf_counter() - t0)
        rewards.append((tmp / f"logs-{name}" / "reward.txt").read_text().strip())
    fresh.stop("v")
    root = tmp / f"{name}-disk"
    runtime = make(name, root)
    runtime.start("warm", spec)  # the image seen: what a lease costs, not the first unpack
    runtime.stop("warm")
    before, sectors = allocated(root), sectors_written(root)
    runtime.start("d", spec)
    runtime.exec("d", ["true"], timeout=60)
    during = allocated(root) - before
    runtime.stop("d")
    after = sectors_written(root)
    return {
        "acquire_new_p50_ms": ms(percentile(new, 50)), "acquire_new_p99_ms": ms(max(new)),
        "acquire_seen_p50_ms": ms(percentile(seen, 50)),
        "acquire_seen_p99_ms": ms(percentile(seen, 99)),
        "exec_true_p50_ms": ms(percentile(true, 50)),
        "shell_run_true_p50_ms": round(percentile(shell_true, 50) * 1000, 2),
        "verify_first_ms": ms(verifies[0]), "verify_p50_ms": ms(percentile(verifies[1:], 50)),
        "verify_rewards": sorted(set(rewards)),
        "disk_allocated_per_lease_bytes": during,
        "device_bytes_written_over_one_lease": None if sectors is None or after is None
        else (after - sectors) * 512,
        "n_new": n_new, "n_seen": n_seen,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", type=Path)
    parser.add_argument("--new", type=int, default=5)
    parser.add_argument("--seen", type=int, default=15)
    parser.add_argument("--runtimes", default="local,apptainer")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {"machine": machine(), "image": str(args.image), "uid": os.getuid()}
    with tempfile.TemporaryDirectory(prefix="runtime-compare-", dir="/tmp") as tmp:
        for name in args.runtimes.split(","):
            report[name] = bench(name, args.image.resolve(), args.new, args.seen,
                                 Path(tmp))
            shutil.rmtree(Path(tmp, "tests"), ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
