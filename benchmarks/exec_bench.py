"""Round trip of one ``true`` through four ways of running agent commands; JSON out.

    python benchmarks/exec_bench.py IMAGE.sif [-n 500] [--warmup 20] [--cache-dir DIR]

- ``raw_pipe``: one bash on the host fed through a pipe, with the end-marker protocol and
  nothing else (no sandbox, no fleet): the floor.
- ``bash_c_state_files`` (TMax v1.0 style): a fresh ``bash -c`` per command on the host,
  restoring the working directory and exported environment from files before the command
  and saving them after.
- ``shell_session``: ``sandfleet.shell.ShellSession.run`` in a local sandbox.
- ``runtime_exec``: ``LocalRuntime.exec``, a fresh ``nsenter`` into the same sandbox per
  command.

Each is warmed up, then timed ``n`` times; p50 and p99 in milliseconds, plus the session's
overhead over the raw pipe and how many times slower the other two are than the session.
The rootfs cache goes to a temporary directory unless ``--cache-dir`` names one to reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sandfleet.runtime.base import SandboxSpec
from sandfleet.runtime.local import LocalRuntime
from sandfleet.shell import ShellSession

STATE_SH = """read -r dir < "$1/cwd" && cd "$dir" || exit 1
. "$1/env"
state=$1
shift
eval "$1"
status=$?
pwd > "$state/cwd"
export -p > "$state/env"
exit $status
"""
"""The v1.0 wrapper, builtins only: cwd and exported variables in, the command, both out."""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def timed(fn: Callable[[], object], n: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return {"p50_ms": round(percentile(samples, 50) * 1000, 3),
            "p99_ms": round(percentile(samples, 99) * 1000, 3)}


class RawPipe:
    """A host bash behind a pipe: the command, then a marker with its status; read to it."""

    def __init__(self):
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def run(self, command: str) -> bytes:
        nonce = secrets.token_hex(8)
        marker = f"__TMAX_{nonce}__ ".encode()
        os.write(self.proc.stdin.fileno(),
                 f"{command}\nprintf '__TMAX_%s__ %d\\n' {nonce} $?\n".encode())
        out = b""
        while marker not in out or not out.endswith(b"\n"):
            select.select([self.proc.stdout], [], [])
            out += os.read(self.proc.stdout.fileno(), 65536)
        return out[:out.index(marker)]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


class StateFiles:
    """TMax v1.0: ``bash -c`` per command, cwd and environment kept in files."""

    def __init__(self, state: Path):
        self.state = state
        state.mkdir(parents=True, exist_ok=True)
        (state / "cwd").write_text("/tmp\n")
        (state / "env").write_text("export HOME=/root\n")

    def run(self, command: str) -> bytes:
        env = {"PATH": os.environ.get("PATH", os.defpath)}
        return subprocess.run(["bash", "-c", STATE_SH, "bash", str(self.state), command],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env, timeout=30, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", type=Path)
    parser.add_argument("-n", type=int, default=500, help="timed commands per method")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--cache-dir", type=Path, help="rootfs cache to reuse")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="sandfleet-exec-bench-") as tmp:
        raw = RawPipe()
        try:
            assert raw.run("echo hi") == b"hi\n"
            results["raw_pipe"] = timed(lambda: raw.run("true"), args.n, args.warmup)
        finally:
            raw.close()
        files = StateFiles(Path(tmp) / "v1")
        files.run("cd /; export KEPT=1")
        assert files.run('pwd; echo "$KEPT"') == b"/\n1\n"
        results["bash_c_state_files"] = timed(lambda: files.run("true"), args.n, args.warmup)

        runtime = LocalRuntime(Path(tmp) / "state", args.cache_dir or Path(tmp) / "cache",
                               owner="execbench")
        runtime.start("bench", SandboxSpec(image=args.image.resolve()))
        try:
            with ShellSession(runtime, "bench") as shell:
                assert shell.run("echo hi", timeout=30).output == "hi\n"
                results["shell_session"] = timed(lambda: shell.run("true", timeout=30),
                                                 args.n, args.warmup)
            results["runtime_exec"] = timed(lambda: runtime.exec("bench", "true", timeout=30),
                                            args.n, args.warmup)
        finally:
            runtime.stop("bench")

    def ratio(a: str, b: str, key: str) -> float:
        return round(results[a][key] / results[b][key], 2)

    print(json.dumps({
        "image": str(args.image), "n": args.n, "warmup": args.warmup, "cpus": os.cpu_count(),
        **results,
        "session_overhead_over_raw_pipe_ms": {
            key: round(results["shell_session"][key] - results["raw_pipe"][key], 3)
            for key in ("p50_ms", "p99_ms")},
        "session_over_raw_pipe_x": {k: ratio("shell_session", "raw_pipe", k)
                                    for k in ("p50_ms", "p99_ms")},
        "bash_c_state_files_over_session_x": {k: ratio("bash_c_state_files", "shell_session", k)
                                              for k in ("p50_ms", "p99_ms")},
        "runtime_exec_over_session_x": {k: ratio("runtime_exec", "shell_session", k)
                                        for k in ("p50_ms", "p99_ms")},
    }, indent=1))


if __name__ == "__main__":
    main()
