"""Checks of the apptainer runtime against a real Apptainer, shared by root and an ordinary
user: tests/test_apptainer_real.py calls each ``case_*`` in-process as root, and runs
``python -m tests.apptainer_cases CASE IMAGE STATE_DIR`` as an ordinary user it creates
(the cluster case: no setuid starter, user namespaces, ``--fakeroot``). A case returns a
small JSON-able dict of what it saw; its asserts are the test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sandfleet.errors import ImageMissing, SandboxLost
from sandfleet.runtime.apptainer import ApptainerRuntime
from sandfleet.runtime.base import SandboxSpec


def run(runtime, sid, command, **kwargs):
    kwargs.setdefault("timeout", 60)
    return runtime.exec(sid, command, **kwargs)


def no_leftovers(runtime: ApptainerRuntime) -> None:
    """Nothing of this runtime left: instances, records, overlays, watchdogs, mounts."""
    assert runtime.list_running() == [], runtime.list_running()
    left = list((runtime.state_dir / "sandboxes").glob("*"))
    assert left == [], f"sandbox state left: {left}"
    listed = runtime._instances() or {}
    assert not [n for n in listed if n.startswith(runtime.prefix)], listed
    assert str(runtime.state_dir) not in Path("/proc/self/mountinfo").read_text()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert runtime.prefix not in ps.stdout, "a watchdog or instance left running"


def case_lifecycle(runtime: ApptainerRuntime, image: Path) -> dict:
    """Exec, env, cwd, identity, isolation, timeouts, files, storage quota, limits."""
    spec = SandboxSpec(image=image, cpus=1, memory_mb=256, storage_mb=64, workdir="/root",
                       env={"FOO": "from-spec"}, hostname="box")
    host_marker = Path(tempfile.gettempdir()) / f"host-only-{os.getpid()}"
    host_marker.write_text("host")
    runtime.start("life", spec)
    seen: dict = {}
    try:
        result = run(runtime, "life", "echo out; echo err >&2; exit 3")
        assert (result.output, result.exit_code, result.timed_out) == ("out\nerr\n", 3, False)
        assert run(runtime, "life", ["pwd"]).output == "/root\n"
        assert run(runtime, "life", "pwd", cwd="/tmp").output == "/tmp\n"
        assert run(runtime, "life", "echo $FOO $BAR", env={"BAR": "call"}).output == \
            "from-spec call\n"
        assert run(runtime, "life", "id -u; hostname").output == "0\nbox\n"
        nics = run(runtime, "life", ["python3", "-c",
                                     "import socket; print(socket.if_nameindex())"])
        assert nics.output == "[(1, 'lo')]\n", nics.output
        assert run(runtime, "life", f"test -e {host_marker} || echo hidden").output == \
            "hidden\n"
        assert run(runtime, "life", "echo w > /usr/written && cat /usr/written").output == \
            "w\n"
        # stdin, and a timeout that kills every process the command started
        assert run(runtime, "life", "cat", stdin=b"in").output == "in"
        slow = run(runtime, "life", "sleep 50 & (sleep 51 &); sleep 52", timeout=1)
        assert slow.timed_out and slow.exit_code == 124
        inside = run(runtime, "life", "ps -eo args").output
        assert not re.search(r"sleep 5[012]", inside), inside
        # files in and out
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp, "src")
            (src / "sub").mkdir(parents=True)
            (src / "sub" / "f.txt").write_text("hi")
            runtime.copy_in("life", src, "/work/in")
            assert run(runtime, "life", "cat /work/in/sub/f.txt").output == "hi"
            runtime.copy_out("life", "/work/in", Path(tmp, "back"))
            assert Path(tmp, "back", "sub", "f.txt").read_text() == "hi"
        # the storage quota: ENOSPC inside, on the sandbox's own overlay
        fill = run(runtime, "life", "dd if=/dev/zero of=/fill bs=1M count=100; echo rc=$?")
        assert "No space left on device" in fill.output and "rc=1" in fill.output, fill.output
        overlay = runtime._dir("life") / "overlay.img"  # the node's disk: at most the quota
        assert overlay.stat().st_size == 64 << 20
        seen["overlay_bytes"] = overlay.stat().st_blocks * 512
        assert 0 < seen["overlay_bytes"] <= 64 << 20, seen
        run(runtime, "life", "rm /fill")
        assert run(runtime, "life", "echo again > /again && cat /again").output == "again\n"
        # limits
        affinity = run(runtime, "life", "grep Cpus_allowed_list /proc/self/status").output
        seen["cpus"] = affinity.split()[-1]
        hog = run(runtime, "life", "python3 -c 'b = bytearray(400 << 20)'; echo rc=$?")
        seen["hog"] = hog.output.strip().splitlines()[-1]
        seen["oom"], seen["oom_kills"] = hog.oom, runtime.oom_kills("life")
        seen["cgroup_limits"], seen["rootless"] = runtime.cgroup_limits, runtime.info.rootless
        assert runtime.list_running() == ["life"]
    finally:
        runtime.stop("life")
        host_marker.unlink()
    runtime.stop("life")  # idempotent
    no_leftovers(runtime)
    return seen


def case_shell(runtime: ApptainerRuntime, image: Path) -> dict:
    """The persistent shell (sandfleet.shell) in an instance."""
    from sandfleet.shell import ShellSession

    runtime.start("sh", SandboxSpec(image=image, cpus=1, memory_mb=512, storage_mb=64))
    try:
        shell = ShellSession(runtime, "sh")
        shell.start()
        try:
            assert shell.run("cd /tmp; export X=kept; f() { echo fn; }", 30).exit_code == 0
            assert shell.run("pwd; echo $X; f", 30).output == "/tmp\nkept\nfn\n"
            shell.run("sleep 300 & echo $! > /tmp/server.pid", 30)
            slow = shell.run("echo before; sleep 101 & sleep 102", 1)
            assert slow.timed_out and slow.exit_code == 124 and \
                slow.output.startswith("before")
            inside = run(runtime, "sh", "ps -eo args").output
            assert "sleep 300" in inside and "sleep 101" not in inside and \
                "sleep 102" not in inside, inside
            assert shell.run("kill -0 $(cat /tmp/server.pid) && echo alive", 30).output == \
                "alive\n"
            assert shell.run("exit 7", 30).exit_code == 7
            assert shell.run("echo fresh", 30).output.endswith("fresh\n")
        finally:
            shell.close()
    finally:
        runtime.stop("sh")
    no_leftovers(runtime)
    return {}


def case_lifetime_and_kill(runtime: ApptainerRuntime, image: Path) -> dict:
    """The hard lifetime ends an instance; a stopped one is lost, not a result."""
    runtime.start("short", SandboxSpec(image=image, max_lifetime_s=3, storage_mb=32))
    runtime.start("victim", SandboxSpec(image=image, storage_mb=32))
    try:
        assert run(runtime, "short", "echo up").output == "up\n"
        deadline = time.monotonic() + 30
        while "short" in runtime.list_running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "short" not in runtime.list_running()
        try:
            run(runtime, "short", "true")
            raise AssertionError("ran in an instance past its lifetime")
        except SandboxLost as e:
            assert "max lifetime" in str(e), e
        # killed from outside under a running command: SandboxLost, not an exit code
        proc = runtime.popen("victim", ["sleep", "100"])
        os.kill(runtime._live("victim").instance[0], signal.SIGKILL)
        proc.wait(timeout=30)
        try:
            run(runtime, "victim", "true")
            raise AssertionError("ran in a killed instance")
        except SandboxLost as e:
            assert "died" in str(e), e
    finally:
        runtime.stop("short")
        runtime.stop("victim")
    no_leftovers(runtime)
    try:
        runtime.start("bad", SandboxSpec(image=Path(__file__)))
        raise AssertionError("started a non-SIF file")
    except ImageMissing as e:
        assert "not a SIF" in str(e) or "SIF" in str(e), e
    return {}


def case_worker_death(runtime: ApptainerRuntime, image: Path) -> dict:
    """A worker SIGKILLed mid-lease: its instances, overlays and watchdogs stay until a
    fresh runtime on the same state folder (the next worker, ``sandfleet gc``) reaps."""
    code = (f"import os, signal; from pathlib import Path; "
            f"from sandfleet.runtime.apptainer import ApptainerRuntime; "
            f"from sandfleet.runtime.base import SandboxSpec; "
            f"r = ApptainerRuntime(Path({str(runtime.state_dir)!r}), owner={runtime.owner!r}); "
            f"[r.start(s, SandboxSpec(image=Path({str(image)!r}), storage_mb=32)) "
            f"for s in ('d1', 'd2')]; os.kill(os.getpid(), signal.SIGKILL)")
    worker = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=False)
    assert worker.returncode == -9, worker.stderr
    other = ApptainerRuntime(runtime.state_dir / "other-worker", owner=runtime.owner)
    other.start("o1", SandboxSpec(image=image, storage_mb=32))
    try:
        fresh = ApptainerRuntime(runtime.state_dir, owner=runtime.owner)
        assert fresh.list_running() == ["d1", "d2"]
        pids = [fresh._record(s).instance[0] for s in ("d1", "d2")]
        assert sorted(fresh.reap(keep=())) == ["d1", "d2"]
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or \
                Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
        no_leftovers(fresh)
        assert other.list_running() == ["o1"], "reaped another worker's instance"
    finally:
        other.stop("o1")
    no_leftovers(other)
    return {}


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main(argv: list[str]) -> None:
    name, image, state = argv
    runtime = ApptainerRuntime(Path(state), owner="t")
    print(json.dumps(CASES[name](runtime, Path(image))))


if __name__ == "__main__":
    main(sys.argv[1:])
