"""Checks of the apptainer runtime against a real Apptainer, shared by root and an ordinary
user: tests/integration/test_apptainer_real.py calls each ``case_*`` in-process as root, and runs
``python -m tests.apptainer_cases CASE IMAGE STATE_DIR`` as an ordinary user it creates
(the cluster case: no setuid starter, user namespaces, ``--fakeroot``). A case returns a
small JSON-able dict of what it saw; its asserts are the test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
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
        # (held: rootless, memory is polled, and a spike shorter than a poll is not seen)
        hog = run(runtime, "life", "python3 -c 'import time; b = bytearray(400 << 20); "
                  "time.sleep(60)'; echo rc=$?")
        seen["hog"] = (hog.output.strip().splitlines() or [""])[-1]
        seen["hog_exit"] = hog.exit_code
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
            # a process in a pid namespace of its own is still the command's
            nested = shell.run("unshare --pid --fork sleep 103 & sleep 104", 1)
            assert nested.timed_out
            inside = run(runtime, "sh", "ps -eo args").output
            assert "sleep 103" not in inside and "sleep 104" not in inside, inside
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
    runtime.start("victim", SandboxSpec(image=image, storage_mb=32))
    runtime.start("short", SandboxSpec(image=image, max_lifetime_s=3, storage_mb=32))
    try:
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
            f"r = ApptainerRuntime(Path({str(runtime.state_dir)!r}), owner={runtime.owner!r}, "
            f"allow_host_root=True); "
            f"[r.start(s, SandboxSpec(image=Path({str(image)!r}), storage_mb=32)) "
            f"for s in ('d1', 'd2')]; os.kill(os.getpid(), signal.SIGKILL)")
    worker = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=False)
    assert worker.returncode == -9, worker.stderr
    other = ApptainerRuntime(runtime.state_dir / "other-worker", owner=runtime.owner,
                            allow_host_root=True)
    other.start("o1", SandboxSpec(image=image, storage_mb=32))
    try:
        fresh = ApptainerRuntime(runtime.state_dir, owner=runtime.owner, allow_host_root=True)
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


FORGE_SH = "#!/bin/sh\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"
FORGE_PY = ('import atexit\n'
            'atexit.register(lambda: open("/logs/verifier/reward.txt", "w").write("1\\n"))\n')
WATCHER = """while :; do
  for d in /proc/[0-9]*; do
    c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null) || continue
    case "$c" in *test.sh*) echo 1 > $d/root/logs/verifier/reward.txt; kill -STOP ${d#/proc/};;
    esac
  done
done
"""


def put(path: str, text: str, mode: str = "644") -> str:
    return (f"mkdir -p $(dirname {path}) && printf %s {shlex.quote(text)} > {path} && "
            f"chmod {mode} {path}")


def detached(script: str) -> str:
    return f"setsid bash {script} </dev/null >/dev/null 2>&1 & disown; sleep 0.3"


# attack -> (what the agent runs as its root, expected reward: the honest test.sh's 0.25)
SEAL_ATTACKS = {
    "pre-created": "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                   "chmod -R a-w /logs; true",
    "rewriting-loop": put("/opt/loop.sh", "while :; do mkdir -p /logs/verifier; echo 1 > "
                          "/logs/verifier/reward.txt; done\n") + " && " + detached("/opt/loop.sh"),
    "bind-mount": "mkdir -p /opt/fake /logs/verifier && echo 1 > /opt/fake/reward.txt && "
                  "mount --bind /opt/fake /logs/verifier; true",
    "python3-replaced": put("/opt/forge", FORGE_SH, "755") + " && for p in "
                        "$(readlink -f /usr/bin/python3) /usr/local/bin/python3; do "
                        "rm -f $p; cp /opt/forge $p; done",
    "bash-replaced": put("/opt/forge", FORGE_SH, "755") + " && cp /opt/forge /usr/bin/bash.n"
                     " && mv -f /usr/bin/bash.n /usr/bin/bash",
    "proc-watcher": put("/opt/watch.sh", WATCHER) + " && " + detached("/opt/watch.sh"),
    "etc-preload-sitecustomize": "echo /opt/agent-preload.so > /etc/ld.so.preload && "
                                 + put("/etc/python3.11/sitecustomize.py", FORGE_PY) + " && "
                                 + put("/usr/lib/python3/dist-packages/zz-forge.pth",
                                       "import atexit; atexit.register(lambda: open("
                                       "'/logs/verifier/reward.txt', 'w').write('1'))\n"),
    "symlinked-etc": "cp -a /etc /etc2 && " + put("/etc2/python3.11/sitecustomize.py", FORGE_PY)
                     + " && rm -rf /etc && /usr/bin/ln -s /etc2 /etc",
    "umount-and-peek-tools": "umount /.tmax/verifier 2>/dev/null; ls -A /.tmax/verifier "
                             "2>/dev/null | wc -l > /opt/tools-seen",
}
HONEST_TEST_SH = """#!/bin/bash
echo 0 > /logs/verifier/reward.txt
cat /app/answer.txt
python3 -c 'print(0.25)' > /logs/verifier/reward.txt
"""


def case_verifier_seal(runtime: ApptainerRuntime, image: Path) -> dict:
    """Each attack, then the honest verifier: its reward (0.25) and the agent's work seen,
    the image's python and bash run; no agent process alive while it runs."""
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        tests = Path(tmp, "tests")
        tests.mkdir()
        (tests / "test.sh").write_text(HONEST_TEST_SH)
        for n, (attack, commands) in enumerate(SEAL_ATTACKS.items()):
            sid = f"seal{n}"
            runtime.start(sid, SandboxSpec(image=image, workdir="/app", storage_mb=256))
            try:
                prep = run(runtime, sid, "mkdir -p /app && echo agent-work > /app/answer.txt"
                                         " && " + commands)
                logs = Path(tmp, f"logs-{n}")
                result = runtime.verify(sid, ["bash", "/tests/test.sh"], tests=tests,
                                        logs=logs, timeout=120)
                reward = (logs / "reward.txt").read_text().strip() \
                    if (logs / "reward.txt").exists() else None
                got[attack] = reward
                assert (reward, result.output) == ("0.25", "agent-work\n"), \
                    (attack, reward, result.output, prep.output)
                # the sandbox goes on after verify, with the agent's files
                after = run(runtime, sid, ["/usr/bin/cat", "/app/answer.txt"]).output
                assert after.endswith("agent-work\n"), after  # (after the agent's preload)
            finally:
                runtime.stop(sid)
    no_leftovers(runtime)
    return got


# the boilerplates' forgeries (tests/integration/test_verifier_forge_attacks.py has the local runtime's), on
# the image of its ``forge_sif``: a top-level /venv whose runner writes 0.25, verifier tools
# whose uvx exits 1 (the tests ran and failed). attack -> (agent's commands, test.sh,
# verifier env, expected reward)
def forge_attacks() -> dict:
    from tests.integration.test_verifier_forge_attacks import HARBOR_SH, RUNNER_SH, UNITTEST_SH
    from tests.seal_helpers import HOST_PATH, write_file

    wrong = write_file("/app/solution.py", "def answer():\n    return 41\n")
    pytest_sh = ("cd /app\npython3 -m pytest /tests -q\nif [ $? -eq 0 ]; then echo 1 > "
                 "/logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    return {
        "uvx-function-env": (write_file("/root/answer.txt", "agent-answer\n") + " && "
                             + write_file("/root/.local/bin/env", "uvx() { return 0; }\n"),
                             HARBOR_SH, {}, "0"),
        "pytest-py-in-workdir": (wrong + " && " + write_file("/app/pytest.py",
                                                           "import sys\nsys.exit(0)\n"),
                                 pytest_sh, {}, "0"),
        "unittest-py-in-workdir": (wrong + " && " + write_file("/app/unittest.py",
                                                             "import sys\nsys.exit(0)\n"),
                                   UNITTEST_SH, {}, "0"),
        "top-level-venv": (write_file("/tmp/forge", FORGE_SH, "755")
                           + " && cp /tmp/forge /venv/bin/runner", RUNNER_SH,
                           {"PATH": f"/venv/bin:{HOST_PATH}"}, "0.25"),
        "apt-hook": (write_file("/root/hook.sh", "echo 1 > /logs/verifier/reward.txt; "
                                "cp /root/uvx /.tmax/verifier/bin/uvx\n", "755") + " && "
                     + write_file("/root/uvx", "#!/bin/sh\nexit 0\n", "755") + " && "
                     + write_file("/etc/apt/apt.conf.d/00forge",
                                  'APT::Update::Pre-Invoke { "/root/hook.sh"; };\n'),
                     ("apt-get update >/dev/null 2>&1\nuvx pytest\nif [ $? -eq 0 ]; then echo 1 "
                      "> /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"),
                     {}, "0"),
    }


def case_verifier_forges(runtime: ApptainerRuntime, image: Path) -> dict:
    """Each of ``forge_attacks`` in a sandbox of the forge image, then its verifier: the
    reward it wrote, per attack; the legitimate path (the agent's module right, imported
    from the workdir) still scores 1."""
    from tests.integration.test_verifier_forge_attacks import TEST_SOLUTION
    from tests.seal_helpers import write_file

    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, (attack, (commands, test_sh, env, _)) in enumerate(forge_attacks().items()):
            tests = Path(tmp, f"tests-{n}")
            tests.mkdir()
            (tests / "test.sh").write_text(test_sh)
            (tests / "test_solution.py").write_text(TEST_SOLUTION)
            sid = f"forge{n}"
            runtime.start(sid, SandboxSpec(image=image, workdir="/app", storage_mb=256))
            try:
                run(runtime, sid, f"mkdir -p /app && {commands}")
                logs = Path(tmp, f"logs-{n}")
                result = runtime.verify(sid, ["bash", "/tests/test.sh"], tests=tests,
                                        logs=logs, env=env, timeout=120)
                got[attack] = (logs / "reward.txt").read_text().strip() \
                    if (logs / "reward.txt").exists() else result.output[-400:]
                if attack == "unittest-py-in-workdir" and got[attack] == "0":
                    run(runtime, sid, "rm /app/unittest.py && " + write_file(
                        "/app/solution.py", "def answer():\n    return 6 * 7\n"))
                    result = runtime.verify(sid, ["bash", "/tests/test.sh"], tests=tests,
                                            logs=logs, timeout=120)
                    got["legitimate-import-from-workdir"] = \
                        (logs / "reward.txt").read_text().strip()
            finally:
                runtime.stop(sid)
    no_leftovers(runtime)
    return got


GROW = ("import time\nb = []\ntry:\n    while len(b) < {n}: b.append(bytearray(16 << 20))\n"
        "except MemoryError:\n    pass\nopen('/tmp/grown', 'w').write(str(len(b)))\n"
        "time.sleep(300)\n")
"""Touches 16 MiB chunks up to ``n``, holds what it got (RLIMIT_DATA may stop it first)."""


def case_memory(runtime: ApptainerRuntime, image: Path) -> dict:
    """memory_mb without cgroups (rootless on cgroup v1: apptainer_memory's watcher): one
    process growing to 3x the limit, four each under it but together over it, both killed
    with the sandbox's other processes (a sleeping job), reported as oom, through exec and
    through the persistent shell; under the limit a command runs as usual."""
    from sandfleet.shell import ShellSession

    spec = SandboxSpec(image=image, cpus=1, memory_mb=256, storage_mb=64)
    runtime.start("mem", spec)
    seen: dict = {"cgroup_limits": runtime.cgroup_limits, "rootless": runtime.info.rootless}
    try:
        under = run(runtime, "mem", "python3 -c 'print(len(bytearray(150 << 20)))'")
        assert (under.output, under.exit_code, under.oom) == (f"{150 << 20}\n", 0, False)
        assert runtime.oom_kills("mem") == 0
        grow = run(runtime, "mem", f"sleep 301 & python3 -c {shlex.quote(GROW.format(n=48))}")
        assert (grow.exit_code, grow.oom) == (137, True), grow
        seen["grow_peak_mb"] = runtime._memory.peaks["mem"] >> 20
        inside = run(runtime, "mem", "ps -eo args").output
        assert inside.split("\n")[1:] == ["appinit", "ps -eo args", ""], inside
        bomb = run(runtime, "mem", "sleep 302 & for i in 1 2 3 4; do python3 -c "
                   f"{shlex.quote(GROW.format(n=6))} & done; wait")
        assert (bomb.exit_code, bomb.oom) == (137, True), bomb
        seen["group_peak_mb"] = runtime._memory.peaks["mem"] >> 20
        assert run(runtime, "mem", "ps -eo args").output.split("\n")[1:] == [
            "appinit", "ps -eo args", ""]
        shell = ShellSession(runtime, "mem")
        shell.start()
        try:
            assert shell.run("cd /tmp; echo ok", 30).output == "ok\n"
            hog = shell.run(f"python3 -c {shlex.quote(GROW.format(n=48))}", 60)
            assert hog.oom and "a new shell was started" in hog.output, hog
            after = shell.run("echo fine; pwd", 30)
            assert (after.output, after.oom) == ("fine\n/\n", False), after
        finally:
            shell.close()
        seen["oom_kills"] = runtime.oom_kills("mem")
        assert seen["oom_kills"] == 3, seen
        assert runtime.list_running() == ["mem"]
    finally:
        runtime.stop("mem")
    assert runtime._memory.kills("mem") is None
    no_leftovers(runtime)
    return seen


def case_allowlist(runtime: ApptainerRuntime, image: Path) -> dict:
    """The allowlist network: the worker's proxy (sandfleet.netproxy) listening in the
    instance's private network (as an ordinary user: through the instance's user namespace),
    an upstream on this host reached by an allowed name, everything else refused."""
    import asyncio
    import socket
    import threading

    from sandfleet.netproxy import REGISTRY_HOSTS, ProxyPool

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nupstream")
        await writer.drain()
        writer.close()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    server = on_loop(asyncio.start_server(serve, "0.0.0.0", 0))
    port, name = server.sockets[0].getsockname()[1], socket.gethostname()
    hosts, pool = (f"{name}:{port}", *REGISTRY_HOSTS), ProxyPool()
    fetch = ("import sys, urllib.request as u\ntry: print(u.urlopen(sys.argv[1], timeout=20)"
             ".read().decode())\nexcept Exception as e: print('FAILED', e)\n")
    dial = ("import socket, sys\ntry: socket.create_connection((sys.argv[1], int(sys.argv[2])),"
            " timeout=5); print('CONNECTED')\nexcept OSError as e: print('FAILED', e)\n")
    runtime.start("net", SandboxSpec(image=image, allowed_hosts=hosts))
    try:
        on_loop(pool.open("net", runtime, hosts))
        seen = {
            "allowed": run(runtime, "net", ["python3", "-c", fetch, f"http://{name}:{port}/"]
                           ).output.strip(),
            "refused": run(runtime, "net", ["python3", "-c", fetch, "https://example.com/"]
                           ).output.strip(),
            "direct": run(runtime, "net", ["python3", "-c", dial, "1.1.1.1", "443"]
                          ).output.strip(),
            # apt in a one-id user namespace, through the proxy (netproxy.install_apt_conf)
            "apt": run(runtime, "net", "apt-get update -qq && apt-get install -y -qq "
                       "--no-install-recommends tree >/dev/null 2>&1; tree --version",
                       timeout=300).output.strip(),
        }
        seen["stats"] = vars(pool.proxies["net"].stats)
    finally:
        on_loop(pool.close("net"))
        runtime.stop("net")
        server.close()
        loop.call_soon_threadsafe(loop.stop)
    no_leftovers(runtime)
    return seen


HOST_REACH = {
    "sysctl": "echo 1 > /proc/sys/kernel/printk_ratelimit",
    "drop_caches": "echo 3 > /proc/sys/vm/drop_caches",
    "memory_limit": "echo 9999999999 > /sys/fs/cgroup/memory/memory.limit_in_bytes",
    "root_cgroup": "echo $$ > /sys/fs/cgroup/memory/cgroup.procs",
    "unified_cgroup": "echo $$ > /sys/fs/cgroup/cgroup.procs",
}
"""Writes to the host's kernel settings and cgroups from inside (tests/integration/test_seal_inside.py
runs them as root, where Apptainer does not stop them)."""


def case_host_reach(runtime: ApptainerRuntime, image: Path) -> dict:
    """What root inside reaches of the host: each of HOST_REACH's writes, "refused" when it
    fails (a file the host lacks counts as refused too: nothing was written)."""
    runtime.start("reach", SandboxSpec(image=image, cpus=1, memory_mb=256, storage_mb=32))
    try:
        seen = {name: "written" if run(runtime, "reach", f"{cmd} 2>/dev/null").exit_code == 0
                else "refused" for name, cmd in HOST_REACH.items()}
        seen["uid_map"] = run(runtime, "reach", "cat /proc/self/uid_map").output.split()
    finally:
        runtime.stop("reach")
    no_leftovers(runtime)
    return seen


def case_overlay_released(runtime: ApptainerRuntime, image: Path) -> dict:
    """Once the instance has ended, no process has its overlay open any more: the
    container's fuse2fs, which writes the image back after ``instance stop`` returns, is
    waited for, so the verifier's container and the instance started again never mount an
    image still being written. The agent's files are there after verify."""
    from sandfleet.runtime.apptainer_setup import holders

    seen = {}
    runtime.start("rel", SandboxSpec(image=image, storage_mb=64))
    try:
        overlay = runtime._dir("rel") / "overlay.img"
        run(runtime, "rel", "dd if=/dev/urandom of=/root/data bs=1M count=16 status=none && "
                            "md5sum /root/data > /root/data.md5")
        seen["held_while_running"] = bool(holders(overlay))
        for n in range(3):
            runtime._end_instance("rel", runtime._record("rel"))
            seen[f"held_after_end_{n}"] = holders(overlay)
            runtime._launch("rel", SandboxSpec.from_dict(runtime._record("rel").spec),
                            runtime.info, runtime._record("rel").cpus,
                            runtime._record("rel").deadline)
        with tempfile.TemporaryDirectory() as tmp:
            tests = Path(tmp, "tests")
            tests.mkdir()
            (tests / "test.sh").write_text("md5sum -c /root/data.md5\n")
            seen["verify"] = runtime.verify("rel", ["sh", "/tests/test.sh"], tests=tests,
                                            logs=Path(tmp, "logs"), timeout=120).output
        seen["after"] = run(runtime, "rel", "md5sum -c /root/data.md5").output
    finally:
        runtime.stop("rel")
    no_leftovers(runtime)
    return seen


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main(argv: list[str]) -> None:
    name, image, state = argv
    runtime = ApptainerRuntime(Path(state), owner="t", allow_host_root=True)
    print(json.dumps(CASES[name](runtime, Path(image))))


if __name__ == "__main__":
    main(sys.argv[1:])
