"""The local and apptainer runtimes side by side, old (nothing made ahead) against new
(disks/overlays made ahead and sandboxes started ahead), in one interleaved run.

    python benchmarks/runtime_compare.py IMAGE.sif [--new 8] [--seen 15] [--out FILE]
        [--runtimes local,apptainer] [--modes old,new] [--layered TASK.layers]

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
from sandfleet.runtime import get_runtime, layers
from sandfleet.runtime.base import SandboxSpec
from sandfleet.shell import ShellSession

TEST_SH = "#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n"
MODES = {"old": {"prepared": 0, "ready": 0}, "new": {"prepared": 2, "ready": 1},
         "layered-old": {"prepared": 0, "ready": 0}, "layered": {"prepared": 2, "ready": 1}}
"""The layered modes start ``--layered`` (a layers file over the same base) instead of
IMAGE; an image new to the node is then a fresh copy of its own layers over the base the
node has (a new task of a base in use)."""


def fresh_copy(image: Path, stem: Path) -> list[Path]:
    """A copy of ``image`` under other file names: the SIF, or a layered image's own
    layers (its base shared) and a layers file naming them; the files, the image first."""
    if not layers.is_layered(image):
        copy = stem.with_suffix(".sif")
        shutil.copyfile(image, copy)
        copy.chmod(0o644)
        return [copy]
    found = layers.read(image)
    copies = []
    for j, layer in enumerate(found[:-1]):
        copies.append(stem.with_name(f"{stem.name}-{j}.sqfs"))
        shutil.copyfile(layer.path, copies[-1])
        copies[-1].chmod(0o644)
    layers.write(stem.with_suffix(".layers"), [*copies, found[-1].path])
    return [stem.with_suffix(".layers"), *copies]


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


def bench(name: str, images: dict[str, Path], modes: list[str], n_new: int, n_seen: int,
          tmp: Path) -> dict:
    runtimes = {mode: make(name, tmp / f"{name}-{mode}", mode) for mode in modes}
    specs = {mode: SandboxSpec(image=images[mode]) for mode in modes}
    out: dict[str, dict] = {mode: {} for mode in modes}
    new: dict[str, list[float]] = {mode: [] for mode in modes}
    seen: dict[str, list[float]] = {mode: [] for mode in modes}
    true: dict[str, list[float]] = {mode: [] for mode in modes}
    shell: dict[str, list[float]] = {mode: [] for mode in modes}
    verifies: dict[str, list[float]] = {mode: [] for mode in modes}
    rewards: dict[str, set[str]] = {mode: set() for mode in modes}
    try:
        for mode, rt in runtimes.items():  # the size wanted, the image seen
            rt.start("warm", specs[mode])
            rt.stop("warm")
        for i in range(n_new):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                rt = runtimes[mode]
                copies = fresh_copy(images[mode], tmp / f"{name}-{mode}-new{i}")
                for other in runtimes.values():
                    settle(other)
                t0 = time.perf_counter()
                rt.start(f"n{i}", SandboxSpec(image=copies[0]))
                new[mode].append(time.perf_counter() - t0)
                rt.stop(f"n{i}")
                for copy in copies:
                    copy.unlink()
        for mode, rt in runtimes.items():
            rt.start("warm", specs[mode])  # IMAGE the last shape used again
            rt.stop("warm")
        for i in range(n_seen):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                rt = runtimes[mode]
                for other in runtimes.values():
                    settle(other)
                t0 = time.perf_counter()
                rt.start(f"s{i}", specs[mode])
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
            runtimes[mode].start("v", specs[mode])
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
    parser.add_argument("--layered", type=Path,
                        help="a layers file over IMAGE's base, for the layered modes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; valid: {', '.join(MODES)}")
    if any(m.startswith("layered") for m in modes) and not args.layered:
        parser.error("--modes layered and layered-old need --layered LAYERS_FILE")
    images = {m: (args.layered if m.startswith("layered") else args.image).resolve()
              for m in modes}
    report = {"machine": machine(), "image": str(args.image), "uid": os.getuid(),
              "layered": str(args.layered or ""), "command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="runtime-compare-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        for name in args.runtimes.split(","):
            report[name] = bench(name, images, modes, args.new, args.seen, Path(tmp))
            shutil.rmtree(Path(tmp, "tests"), ignore_errors=True)
    report["load_at_end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
