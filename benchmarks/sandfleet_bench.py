"""Sandfleet benchmarks (see issue 4): exec round trip, acquire latency, 64 concurrent
episodes, controller capacity with simulated workers. Prints one JSON object per section.

Usage: python benchmarks/sandfleet_bench.py --image IMAGE.sif [exec] [episodes] [capacity]
(IMAGE.sif: any task or base image, e.g. from `tmax images ls`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

SANDFLEET = [sys.executable, "-m", "sandfleet.cli"]
SIF = ""  # set from --image
CACHE = Path(os.environ.get("TMAX_CACHE", Path.home() / ".cache" / "tmax"))


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(name, values, unit=1e3):
    return {"what": name, "n": len(values), "p50_ms": round(pct(values, 0.5) * unit, 3),
            "p99_ms": round(pct(values, 0.99) * unit, 3),
            "mean_ms": round(statistics.mean(values) * unit, 3)}


def fleet_up(root: Path, **config) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    state = root / "state"
    data = {"provider": "local", "cache_dir": str(CACHE), "work_dir": str(root / "w"),
            **config}
    (root / "fleet.yaml").write_text(yaml.safe_dump(data))
    subprocess.run([*SANDFLEET, "up", "--config", str(root / "fleet.yaml"), "--state-dir",
                    str(state)], check=True, timeout=60)
    return state


def fleet_down(state: Path) -> None:
    subprocess.run([*SANDFLEET, "down", "--state-dir", str(state)], check=True, timeout=180)


# ---- exec round trip and acquire latency

V10_SCRIPT = ('read -r dir < "$1/cwd" && cd "$dir" || exit 1; . "$1/env"; state=$1; shift; '
              'eval "$1"; status=$?; pwd > "$state/cwd"; export -p > "$state/env"; '
              'exit $status')
"""TMax v1.0's way: a fresh ``bash -c`` per command that restores the working directory and
the exported environment from files and saves them after (builtins only)."""


def timed(fn, n: int, warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return samples


class RawPipe:
    """(a): one bash on the host behind a pipe, the same end-marker protocol, nothing else."""

    def __init__(self):
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def run(self, command: str) -> bytes:
        nonce = os.urandom(8).hex()
        marker = f"__TMAX_{nonce}__ ".encode()
        os.write(self.proc.stdin.fileno(),
                 f"{command}\nprintf '__TMAX_%s__ %d\\n' {nonce} $?\n".encode())
        out = b""
        while marker not in out or not out.endswith(b"\n"):
            out += os.read(self.proc.stdout.fileno(), 65536)
        return out[:out.index(marker)]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def bench_exec(root: Path, n: int, rounds: int = 10) -> None:
    """Acquire latency, then the exec round trip of every way in ``rounds`` interleaved
    blocks (``n`` samples each in all), so a slow spell of the machine hits all alike."""
    from sandfleet.client import AsyncFleetClient, FleetClient
    from sandfleet.runtime.base import SandboxSpec
    from sandfleet.runtime.local import LocalRuntime
    from sandfleet.shell import ShellSession
    from sandfleet.wire.transport import new_event_loop

    state = fleet_up(root / "exec", min_nodes=1, max_nodes=1, cpus_per_node=4)
    rt = LocalRuntime(root / "rt-state", CACHE, owner="bench")
    loop = new_event_loop()  # TMax's rollout loop (uvloop)
    with contextlib.ExitStack() as stack:
        stack.callback(fleet_down, state)
        fleet = stack.enter_context(FleetClient(state))
        time.sleep(1)
        acq = []
        for _ in range(30):
            t = time.perf_counter()
            lease = fleet.acquire(SIF)
            acq.append(time.perf_counter() - t)
            lease.release()
            time.sleep(0.25)  # let the previous sandbox's stop finish
        print(json.dumps(summary("lease acquire (warm image cache, idle worker)", acq)))

        lease = stack.enter_context(fleet.lease(SIF))
        assert lease.run("cd /tmp; export KEPT=1").exit_code == 0
        assert lease.run('pwd; echo "$KEPT"').output == "/tmp\n1\n"
        stack.callback(loop.close)
        aclient = loop.run_until_complete(AsyncFleetClient(state).__aenter__())
        stack.callback(lambda: loop.run_until_complete(aclient.__aexit__(None, None, None)))
        alease = loop.run_until_complete(aclient.acquire(SIF))
        stack.callback(lambda: loop.run_until_complete(alease.release()))

        async def async_block(k: int) -> list[float]:
            samples = []
            for _ in range(k):
                t = time.perf_counter()
                await alease.run("true")
                samples.append(time.perf_counter() - t)
            return samples

        rt.start("b1", SandboxSpec(image=Path(SIF)))
        stack.callback(rt.stop, "b1")
        shell = stack.enter_context(ShellSession(rt, "b1"))
        # (b) v1.0: a fresh process per command entering the sandbox, state from files
        rt.exec("b1", "mkdir -p /tmp/v10 && echo /tmp > /tmp/v10/cwd && : > /tmp/v10/env",
                timeout=10)
        v10 = ["bash", "-c", V10_SCRIPT, "bash", "/tmp/v10"]
        assert rt.exec("b1", [*v10, "cd /; export KEPT=1"], timeout=10).exit_code == 0
        assert rt.exec("b1", [*v10, 'pwd; echo "$KEPT"'], timeout=10).output == "/\n1\n"
        # (b') the same on the host, no sandbox to enter: the cheapest a fresh process gets
        host_state = root / "v10-host"
        host_state.mkdir()
        (host_state / "cwd").write_text("/tmp\n")
        (host_state / "env").write_text("")
        host = ["bash", "-c", V10_SCRIPT, "bash", str(host_state)]
        raw = RawPipe()
        stack.callback(raw.close)
        assert raw.run("echo hi") == b"hi\n"

        ways = {  # key: (what, one block of k samples)
            "fleet": ("exec `true` through a lease (sync client)",
                      lambda k: timed(lambda: lease.run("true"), k, warmup=5)),
            "fleet_async": ("exec `true` through a lease (asyncio client, uvloop)",
                            lambda k: loop.run_until_complete(async_block(k))),
            "shell": ("exec `true` via ShellSession.run, no fleet",
                      lambda k: timed(lambda: shell.run("true", 10), k, warmup=5)),
            "v10_sandbox": ("exec `true`, v1.0 style: fresh process into the sandbox (b)",
                            lambda k: timed(lambda: rt.exec("b1", [*v10, "true"], timeout=10),
                                            max(k // 3, 5), warmup=2)),
            "v10_host": ("exec `true`, v1.0 style on the host, no sandbox (b')",
                         lambda k: timed(lambda: subprocess.run(
                             [*host, "true"], stdin=subprocess.DEVNULL, capture_output=True,
                             check=True), max(k // 3, 5), warmup=2)),
            "raw": ("exec `true` via a raw bash pipe on the host (a)",
                    lambda k: timed(lambda: raw.run("true"), k, warmup=5)),
        }
        samples: dict[str, list[float]] = {key: [] for key in ways}
        for _ in range(rounds):
            for key, (_, block) in ways.items():
                samples[key] += block(max(n // rounds, 1))
    p50 = {}
    for key, (what, _) in ways.items():
        row = summary(what, samples[key])
        p50[key] = row["p50_ms"]
        print(json.dumps(row))
    print(json.dumps({
        "what": "exec targets (p50; interleaved blocks)",
        "fleet_overhead_over_raw_pipe_ms": round(p50["fleet"] - p50["raw"], 3),
        "fleet_async_overhead_over_raw_pipe_ms": round(p50["fleet_async"] - p50["raw"], 3),
        "v10_sandbox_over_fleet_x": round(p50["v10_sandbox"] / p50["fleet"], 1),
        "v10_sandbox_over_fleet_async_x": round(p50["v10_sandbox"] / p50["fleet_async"], 1),
        "v10_host_over_fleet_x": round(p50["v10_host"] / p50["fleet"], 1)}))


# ---- 64 concurrent episodes


async def episodes(state: Path, leases: int, commands: int) -> dict:
    from sandfleet.client import AsyncFleetClient
    from sandfleet.errors import InfraError

    infra, results, durations = [], [], []

    async def episode(i: int) -> None:
        try:
            async with AsyncFleetClient(state, client_id=f"c{i}") as client, \
                    client.lease(SIF, memory_mb=256, wait_s=300) as lease:
                t = time.perf_counter()
                for k in range(commands):
                    cmd = ["cd /tmp && mkdir -p ep && cd ep", f"echo {k} >> log",
                           "ls -la / | wc -l", "python3 -c 'print(sum(range(10000)))'",
                           "cat log | wc -l"][k % 5]
                    r = await lease.run(cmd, timeout=60)
                    results.append(r.exit_code)
                durations.append(time.perf_counter() - t)
        except InfraError as e:
            infra.append(f"{e.cause}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(episode(i) for i in range(leases)))
    wall = time.perf_counter() - t0
    return {"what": f"{leases} concurrent leases x {commands} commands", "wall_s": round(wall, 1),
            "infra_failures": len(infra), "infra": infra[:5],
            "commands": len(results), "nonzero_exits": sum(1 for c in results if c),
            "commands_per_s": round(len(results) / wall, 1),
            "episode_s_p50": round(pct(durations, 0.5), 2) if durations else None}


def bench_episodes(root: Path, leases: int, commands: int) -> None:
    from sandfleet import run_event_loop

    state = fleet_up(root / "ep", min_nodes=1, max_nodes=1, cpus_per_node=2 * leases,
                     memory_mb_per_node=256 * leases, lease_ttl_s=300)
    try:
        time.sleep(1)
        print(json.dumps(run_event_loop(episodes(state, leases, commands))))
    finally:
        fleet_down(state)


# ---- controller capacity with simulated workers


async def capacity(state: Path, nodes: int, slots: int, seconds: float, clients: int) -> dict:
    from sandfleet.discovery import read_controller_info
    from sandfleet.wire.messages import Acquire, Heartbeat, Register, Release, new_id
    from sandfleet.wire.server import Server
    from sandfleet.wire.transport import Connection

    info = read_controller_info(state)

    def fake_worker(req, payload, peer):  # starts and stops sandboxes instantly
        return {"started": True}

    server = Server(fake_worker, info.token, name="fake-worker")
    _, port = await server.start("127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    conns = [await Connection.open(info.address, info.token) for _ in range(4)]
    ids = [f"sim{i}" for i in range(nodes)]
    await asyncio.gather(*(conns[i % 4].request(Register(
        id=new_id(), worker_id=w, name=w, address=address, node=f"node{i}", slots=slots,
        memory_mb=slots * 4096)) for i, w in enumerate(ids)))
    stop = asyncio.Event()

    async def heartbeats():
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.gather(*(conns[i % 4].call(Heartbeat(id=new_id(), token=info.token,
                                                                worker_id=w))
                                   for i, w in enumerate(ids)))
            await asyncio.sleep(max(0, 1.0 - (time.perf_counter() - t)))

    cycles = 0
    errors: list[str] = []

    async def client(k: int):
        nonlocal cycles
        conn = await Connection.open(info.address, info.token)
        while not stop.is_set():
            try:
                grant, _ = await conn.request(Acquire(id=new_id(), token=info.token,
                                                      image="/x.sif", cpus=2, client=f"c{k}",
                                                      wait_s=30))
                await conn.request(Release(id=new_id(), token=info.token,
                                           lease_id=grant["lease_id"]))
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.1)
                continue
            cycles += 1
        await conn.close()

    hb = asyncio.create_task(heartbeats())
    tasks = [asyncio.create_task(client(k)) for k in range(clients)]
    await asyncio.sleep(1.0)  # warm up

    def cpu() -> float:
        fields = Path(f"/proc/{info.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    start_cycles, t0, c0, b0 = cycles, time.perf_counter(), cpu(), time.process_time()
    await asyncio.sleep(seconds)
    done, wall, used = cycles - start_cycles, time.perf_counter() - t0, cpu() - c0
    bench_used = time.process_time() - b0
    rss = int(next(line.split()[1] for line in Path(f"/proc/{info.pid}/status").read_text()  # noqa: ASYNC240 - procfs
                   .splitlines() if line.startswith("VmRSS")))
    stop.set()
    await asyncio.gather(*tasks, hb, return_exceptions=True)
    for conn in conns:
        await conn.close()
    await server.close()
    return {"what": f"controller capacity, {nodes} simulated nodes x {slots} slots, "
                    f"{clients} concurrent clients", "cycles_per_s": round(done / wall),
            "controller_cpu_s_per_s": round(used / wall, 2),
            "cycles_per_controller_cpu_s": round(done / used) if used else None,
            "controller_rss_mib": round(rss / 1024, 1),
            "bench_process_cpu_s_per_s": round(bench_used / wall, 2),
            "errors": len(errors), "first_errors": errors[:3]}


def bench_capacity(root: Path, nodes: int, slots: int, seconds: float, clients: int) -> None:
    state = fleet_up(root / "cap", min_nodes=0, max_nodes=1, cpus_per_node=slots,
                     memory_mb_per_node=slots * 4096, heartbeat_s=1.0, lost_after_s=10)
    try:
        print(json.dumps(asyncio.run(capacity(state, nodes, slots, seconds, clients))))
    finally:
        fleet_down(state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", nargs="*", default=["exec", "episodes", "capacity"])
    parser.add_argument("--image", required=True, help="a SIF file to lease sandboxes of")
    parser.add_argument("-n", type=int, default=500)
    parser.add_argument("--leases", type=int, default=64)
    parser.add_argument("--commands", type=int, default=25)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    global SIF
    SIF = str(Path(args.image).resolve())
    root = Path(tempfile.mkdtemp(prefix="sfbench-"))
    print(json.dumps({"machine": f"{os.cpu_count()} CPUs, "
                      f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') >> 30} GiB",
                      "root": str(root)}))
    if "exec" in args.what:
        bench_exec(root, args.n)
    if "episodes" in args.what:
        bench_episodes(root, args.leases, args.commands)
    if "capacity" in args.what:
        bench_capacity(root, args.nodes, args.slots, args.seconds, args.clients)


if __name__ == "__main__":
    main()
