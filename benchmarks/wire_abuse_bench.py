"""Pre-authentication abuse of a real local fleet: memory under the probe, exec latency
under silent and abusive connections (issue 11, item 5).

    python benchmarks/wire_abuse_bench.py [--image IMAGE.sif] [--probes 4]
        [--probe-mib 256] [--silent 200] [--abusers 2] [--rounds 6] [--block-s 6]
        [--out FILE.json]

1. Memory: the controller's and the worker's RSS before, at the peak of, and after
   ``--probes`` concurrent pre-auth probes on each (a ``put`` frame with a wrong token
   announcing MAX_PAYLOAD_BYTES, then up to ``--probe-mib`` MiB of its payload streamed);
   and how many bytes each probe got the server to take (the kernel's socket buffers, once
   the server no longer reads).
2. Latency: a well-behaved sync client's ``exec true`` round trip p50/p99, in ``--rounds``
   interleaved blocks of ``--block-s`` seconds per way, without and with abuse open on both
   the controller and the worker: ``--silent`` connections that never send a byte (reopened
   as the servers close them at their auth deadline) and ``--abusers`` probe loops per
   server.

The fleet runs with its default wire limits (``FleetConfig``: 5 s auth deadline, 256
unauthenticated connections per peer). Loopback only (127.0.0.1); every loop is bounded and
the fleet is taken down at the end. Figures are from one run on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

import yaml
from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

from sandfleet.client import FleetClient
from sandfleet.discovery import read_controller_info
from sandfleet.wire.frames import MAX_PAYLOAD_BYTES, PREFIX
from sandfleet.wire.messages import new_id

log = logging.getLogger("wire_abuse_bench")
SANDFLEET = [sys.executable, "-m", "sandfleet.cli"]
LOOPBACK = "127.0.0.1"


def default_image() -> str | None:
    """The tests' slim Debian base, when this machine has built it."""
    from tmax.images.store import ImageStore

    cache = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
    with contextlib.suppress(Exception):
        store = ImageStore(cache / "test-store")
        return str(store.path(store.read().bases["debian-slim"].sif))
    return None


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for pid {pid}")


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


# ---- the fleet


def fleet_up(root: Path, image_cache: Path) -> Path:
    state = root / "state"
    config = {"provider": "local", "min_nodes": 1, "max_nodes": 1, "cpus_per_node": 4,
              "work_dir": str(root / "w"), "cache_dir": str(image_cache), "host": LOOPBACK,
              "worker_host": LOOPBACK}
    (root / "fleet.yaml").write_text(yaml.safe_dump(config))
    subprocess.run([*SANDFLEET, "up", "--config", str(root / "fleet.yaml"), "--state-dir",
                    str(state)], check=True, timeout=60, stdin=subprocess.DEVNULL)
    return state


def fleet_down(state: Path) -> None:
    subprocess.run([*SANDFLEET, "down", "--state-dir", str(state)], check=True, timeout=180,
                   stdin=subprocess.DEVNULL)


def worker_of(fleet: FleetClient, timeout: float = 60) -> tuple[int, tuple[str, int]]:
    """The one worker's pid and address, once it has registered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = fleet.status()
        if status["nodes"] and status["jobs"]:
            pid = int(status["jobs"][0]["job_id"].split(".")[0])
            return pid, address(status["nodes"][0]["address"])
        time.sleep(0.2)
    raise RuntimeError("no worker registered")


# ---- the abuse


def probe(target: tuple[str, int], stream: int, stop: threading.Event | None = None,
          hold: threading.Event | None = None, taken: list[int] | None = None) -> int:
    """A wrong-token ``put`` announcing MAX_PAYLOAD_BYTES, then up to ``stream`` bytes of
    its payload; the bytes the server took (appended to ``taken`` too, as soon as known).
    With ``hold``, the socket then stays open until it is set."""
    raw = json.dumps({"type": "put", "v": 1, "id": new_id(), "token": "wrong-token",
                      "lease_id": "L", "path": "/p", "name": "n"}).encode()
    sent, chunk = 0, b"\0" * (1 << 20)
    with socket.create_connection(target, timeout=5) as sock:
        try:
            sock.sendall(PREFIX.pack(len(raw), MAX_PAYLOAD_BYTES) + raw)
            while sent < stream and not (stop and stop.is_set()):
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset by the server, or a full window for 5 s
            pass
        if taken is not None:
            taken.append(sent)
        if hold is not None:
            hold.wait(60)
    return sent


class Abuse:
    """``silent`` never-speaking connections per target (reopened as the server closes
    them) and ``abusers`` probe loops per target, in a process of their own (so the
    attacker's Python does not take the client's GIL), until the ``with`` block ends."""

    def __init__(self, targets: list[tuple[str, int]], silent: int, abusers: int):
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.counts = ctx.Array("q", 3)  # silent closed by the server, probes, refused
        self.process = ctx.Process(target=abuse, daemon=True,
                                   args=(targets, silent, abusers, self.stop, self.counts))
        self.closed = self.probes = self.refused = 0

    def __enter__(self) -> Self:
        self.process.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.closed, self.probes, self.refused = self.counts[:]


def abuse(targets, silent: int, abusers: int, stop, counts) -> None:
    """The abuse process: a thread keeping ``silent`` connections per target, and
    ``abusers`` probe loops per target."""
    lock = threading.Lock()

    def count(i: int, n: int = 1) -> None:
        with lock:
            counts[i] += n

    def keep_silent(target: tuple[str, int]) -> None:
        socks: list[socket.socket] = []
        try:
            while not stop.is_set():
                if socks:  # one select for all: readable here means closed by the server
                    gone = set(select.select(socks, [], [], 0.05)[0])
                    for sock in gone:
                        sock.close()
                    count(0, len(gone))
                    socks = [s for s in socks if s not in gone]
                while len(socks) < silent and not stop.is_set():
                    try:
                        socks.append(socket.create_connection(target, timeout=5))
                    except OSError:
                        count(2)
                        stop.wait(0.1)
                        break
        finally:
            for sock in socks:
                sock.close()

    def probe_loop(target: tuple[str, int]) -> None:
        while not stop.is_set():
            try:
                probe(target, 64 << 20, stop)
            except OSError:
                count(2)
                stop.wait(0.1)
            count(1)

    threads = [threading.Thread(target=keep_silent, args=(t,)) for t in targets]
    threads += [threading.Thread(target=probe_loop, args=(t,))
                for t in targets for _ in range(abusers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# ---- the measurements


def memory(pids: dict[str, int], targets: dict[str, tuple[str, int]], probes: int,
           stream: int) -> dict[str, Any]:
    """RSS before, at the peak of (sampled every 20 ms while the probes stream, and once
    more with all of them still open) and after ``probes`` concurrent probes per server."""
    before = {role: rss_mib(pid) for role, pid in pids.items()}
    peak = dict(before)
    hold, taken = threading.Event(), {role: [] for role in targets}
    threads = [threading.Thread(target=probe, args=(targets[role], stream),
                                kwargs={"hold": hold, "taken": taken[role]}, daemon=True)
               for role in targets for _ in range(probes)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while True:
        for role, pid in pids.items():
            peak[role] = max(peak[role], rss_mib(pid))
        if sum(map(len, taken.values())) == len(threads) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    hold.set()
    for thread in threads:
        thread.join(timeout=30)
    time.sleep(0.5)
    after = {role: rss_mib(pid) for role, pid in pids.items()}
    return {role: {"rss_before_mib": before[role], "rss_peak_mib": peak[role],
                   "rss_after_mib": after[role],
                   "probe_bytes_taken_mib": [round(b / 2**20, 1) for b in taken[role]]}
            for role in pids}


def latency(lease, targets: list[tuple[str, int]], rounds: int, block_s: float,
            silent: int, abusers: int) -> dict[str, Any]:
    """``exec true`` round trips in interleaved blocks of ``block_s`` seconds each (longer
    than the fleet's auth deadline, so the servers close silent connections during them):
    quiet, then under abuse."""
    samples: dict[str, list[float]] = {"quiet": [], "abuse": []}
    seen = {"silent_closed_by_fleet": 0, "probes": 0, "refused": 0}

    def timed(seconds: float) -> list[float]:
        out, end = [], time.monotonic() + seconds
        while time.monotonic() < end and len(out) < 100_000:
            t = time.perf_counter()
            lease.run("true")
            out.append(time.perf_counter() - t)
        return out

    for _ in range(rounds):
        timed(0.1)
        samples["quiet"] += timed(block_s)
        with Abuse(targets, silent, abusers) as abuse:
            time.sleep(0.5)  # the silent connections are open, the probes streaming
            samples["abuse"] += timed(block_s)
        seen["silent_closed_by_fleet"] += abuse.closed
        seen["probes"] += abuse.probes
        seen["refused"] += abuse.refused
    rows = {key: {"n": len(v), "p50_ms": round(pct(v, 0.5) * 1e3, 3),
                  "p99_ms": round(pct(v, 0.99) * 1e3, 3)} for key, v in samples.items()}
    rows["abuse_over_quiet_p50_x"] = round(rows["abuse"]["p50_ms"] / rows["quiet"]["p50_ms"],
                                           3)
    rows["abuse_over_quiet_p99_x"] = round(rows["abuse"]["p99_ms"] / rows["quiet"]["p99_ms"],
                                           3)
    return {**rows, **seen}


def rejection_lines(state: Path) -> dict[str, int]:
    """Log lines of rejected connections, per daemon log."""
    return {path.name: sum("rejected" in line for line in path.read_text(
        errors="replace").splitlines()) for path in sorted((state / "logs").glob("*.log"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=default_image(), help="a SIF to lease")
    parser.add_argument("--probes", type=int, default=4, help="concurrent probes per server")
    parser.add_argument("--probe-mib", type=int, default=256, help="payload streamed each")
    parser.add_argument("--silent", type=int, default=200, help="silent conns per server")
    parser.add_argument("--abusers", type=int, default=2, help="probe loops per server")
    parser.add_argument("--rounds", type=int, default=6, help="blocks per way")
    parser.add_argument("--block-s", type=float, default=6.0, help="seconds per block")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.image:
        parser.error("no --image and no test base image on this machine")
    root = Path(tempfile.mkdtemp(prefix="wire-abuse-"))
    report: dict[str, Any] = {"machine": machine(), "root": str(root)}
    state = fleet_up(root, root / "cache")
    try:
        with FleetClient(state) as fleet:
            info = read_controller_info(state)
            worker_pid, worker = worker_of(fleet)
            pids = {"controller": info.pid, "worker": worker_pid}
            targets = {"controller": address(info.address), "worker": worker}
            log.info("memory under %d probes per server", args.probes)
            report["memory"] = memory(pids, targets, args.probes, args.probe_mib << 20)
            with fleet.lease(str(Path(args.image).resolve())) as lease:
                lease.run("true")
                log.info("exec latency, %d rounds", args.rounds)
                report["exec"] = latency(lease, list(targets.values()), args.rounds,
                                         args.block_s, args.silent, args.abusers)
            report["rejection_log_lines"] = rejection_lines(state)
    finally:
        fleet_down(state)
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for role, m in report["memory"].items():
        rows.append(f"{role:10} RSS {m['rss_before_mib']:7.1f} -> peak {m['rss_peak_mib']:7.1f}"
                    f" -> {m['rss_after_mib']:7.1f} MiB; probes took "
                    f"{m['probe_bytes_taken_mib']} MiB")
    ex = report["exec"]
    for key in ("quiet", "abuse"):
        rows.append(f"exec {key:5}  p50 {ex[key]['p50_ms']:.3f} ms  p99 "
                    f"{ex[key]['p99_ms']:.3f} ms  (n={ex[key]['n']})")
    rows.append(f"abuse/quiet p50 x{ex['abuse_over_quiet_p50_x']}, p99 "
                f"x{ex['abuse_over_quiet_p99_x']}; silent conns closed by "
                f"the fleet {ex['silent_closed_by_fleet']}, probes {ex['probes']}, refused "
                f"{ex['refused']}; rejection log lines {report['rejection_log_lines']}")
    emit(report, f"wire abuse, {args.probes} probes x {args.probe_mib} MiB per server, "
         f"{args.silent} silent + {args.abusers} probe loops per server; {report['machine']}",
         "\n".join(rows), args.out)


if __name__ == "__main__":
    main()
