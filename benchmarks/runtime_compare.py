"""The local and apptainer runtimes side by side, old (nothing made ahead) against new
(disks/overlays made ahead and sandboxes started ahead), in one interleaved run.

    python benchmarks/runtime_compare.py IMAGE.sif [--new 8] [--seen 15] [--out FILE]
        [--runtimes local,apptainer] [--modes old,new]

Per runtime (``local``: bubblewrap, as root; ``apptainer``: instances, as whoever runs
this, through bin/tmax-apptainer where no apptainer is on PATH) and per mode (``old``:
``prepared=0, ready=0``, as ``SANDFLEET_PREPARED=0``; ``new``: ``prepared=2, ready=1``,
what a worker runs), one runtime each, used alternately:

- ``acquire_new``: ``runtime.start`` of an image new to the node (a fresh copy of IMAGE,
  another file, each time; its data is in the page cache from the copy), and
  ``acquire_seen``: of IMAGE, seen before; p50 and p99 (nearest rank: with 15 starts p99
  is the slowest). Before each timed start both runtimes are let settle: the new one's
  pools full again (leases arriving no faster than the pool refills; a burst faster than
  that gets what the old mode gets, with a disk made ahead);
- ``shell_run_true``: ``run("true")`` p50 through the persistent shell (what
  ``lease.run`` goes through on the worker), and ``exec_true``: a one-off
  ``exec(["true"])`` p50 (a new ``apptainer exec`` each time on Apptainer);
- ``verify``: the sandbox's verifier on a trivial test.sh (writes reward 1), first in a
  fresh sandbox and then p50 of the next ones.
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
MODES = {"old": {"prepared": 0, "ready": 0}, "new": {"prepared": 2, "ready": 1}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def make(name: str, root: Path, mode: str):
    kwargs = {"state_dir": root / "state", "owner": "bench", **MODES[mode]}
    if name == "local":
        kwargs["cache_dir"] = root / "cache"
    else:  # as root: a benchmark on a machine of one's own (see ROOT_REFUSAL)
        kwargs["allow_host_root"] = True
    return get_runtime(name, **kwargs)


def settle(runtime, timeout: float = 60.0) -> None:
    """Wait until the runtime's pools are full again (nothing made in the background)."""
    pool = getattr(runtime, "disks", None) or runtime.overlays
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (runtime.ready.idle() and pool.idle()):
        time.sleep(0.02)


def bench(name: str, image: Path, modes: list[str], n_new: int, n_seen: int,
          tmp: Path) -> dict:
    runtimes = {mode: make(name, tmp / f"{name}-{mode}", mode) for mode in modes}
    spec = SandboxSpec(image=image)
    out: dict[str, dict] = {mode: {} for mode in modes}
    new: dict[str, list[float]] = {mode: [] for mode in modes}
    seen: dict[str, list[float]] = {mode: [] for mode in modes}
    true: dict[str, list[float]] = {mode: [] for mode in modes}
    shell: dict[str, list[float]] = {mode: [] for mode in modes}
    verifies: dict[str, list[float]] = {mode: [] for mode in modes}
    rewards: dict[str, set[str]] = {mode: set() for mode in modes}
    try:
        for rt in runtimes.values():  # the size wanted, the image seen
            rt.start("warm", spec)
            rt.stop("warm")
        for i in range(n_new):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                rt = runtimes[mode]
                copy = tmp / f"{name}-{mode}-new{i}.sif"
                shutil.copyfile(image, copy)
                copy.chmod(0o644)
                for other in runtimes.values():
                    settle(other)
                t0 = time.perf_counter()
                rt.start(f"n{i}", SandboxSpec(image=copy))
                new[mode].append(time.perf_counter() - t0)
                rt.stop(f"n{i}")
                copy.unlink()
        for rt in runtimes.values():
            rt.start("warm", spec)  # IMAGE the last shape used again
            rt.stop("warm")
        for i in range(n_seen):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                rt = runtimes[mode]
                for other in runtimes.values():
                    settle(other)
                t0 = time.perf_counter()
                rt.start(f"s{i}", spec)
                seen[mode].append(time.perf_counter() - t0)
                if i == 0:
                    for other in runtimes.values():
                        settle(other)  # commands timed with nothing made in the background
                    for _ in range(20):
                        t1 = time.perf_counter()
                        rt.exec("s0", ["true"], timeout=60)
                        true[mode].append(time.perf_counter() - t1)
                    session = ShellSession(rt, "s0")  # what lease.run goes through
                    session.start()
                    for _ in range(50):
                        t1 = time.perf_counter()
                        session.run("true", 60)
                        shell[mode].append(time.perf_counter() - t1)
                    session.close()
                rt.stop(f"s{i}")
        tests = tmp / "tests"
        tests.mkdir(exist_ok=True)
        (tests / "test.sh").write_text(TEST_SH)
        for mode in modes:
            runtimes[mode].start("v", spec)
        for rt in runtimes.values():
            settle(rt)
        for _ in range(6):
            for mode in modes:
                logs = tmp / f"logs-{name}-{mode}"
                t0 = time.perf_counter()
                runtimes[mode].verify("v", ["sh", "/tests/test.sh"], tests=tests, logs=logs,
                                      timeout=120)
                verifies[mode].append(time.perf_counter() - t0)
                rewards[mode].add((logs / "reward.txt").read_text().strip())
        for mode in modes:
            runtimes[mode].stop("v")
            pool = runtimes[mode].ready
            out[mode] = {
                "acquire_new_p50_ms": ms(percentile(new[mode], 50)),
                "acquire_new_p99_ms": ms(percentile(new[mode], 99)),
                "acquire_seen_p50_ms": ms(percentile(seen[mode], 50)),
                "acquire_seen_p99_ms": ms(percentile(seen[mode], 99)),
                "exec_true_p50_ms": ms(percentile(true[mode], 50)),
                "shell_run_true_p50_ms": round(percentile(shell[mode], 50) * 1000, 2),
                "verify_first_ms": ms(verifies[mode][0]),
                "verify_p50_ms": ms(percentile(verifies[mode][1:], 50)),
                "verify_rewards": sorted(rewards[mode]),
                "started_ahead_taken": pool.taken, "started_ahead_missed": pool.missed,
                "n_new": n_new, "n_seen": n_seen, **MODES[mode],
            }
    finally:
        for rt in runtimes.values():
            rt.reap(())
            rt.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", type=Path)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--seen", type=int, default=15)
    parser.add_argument("--runtimes", default="local,apptainer")
    parser.add_argument("--modes", default="old,new")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; valid: {', '.join(MODES)}")
    report = {"machine": machine(), "image": str(args.image), "uid": os.getuid(),
              "command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="runtime-compare-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        for name in args.runtimes.split(","):
            report[name] = bench(name, args.image.resolve(), modes, args.new, args.seen,
                                 Path(tmp))
            shutil.rmtree(Path(tmp, "tests"), ignore_errors=True)
    report["load_at_end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
