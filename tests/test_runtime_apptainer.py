"""sandfleet.runtime.apptainer: the exact command lines, and the class over a fake apptainer.

There is no apptainer here. The fake below keeps instances as detached ``sleep`` processes
and runs ``exec`` on the host (no isolation at all): it checks the runtime's plumbing
(records, pids, watchdog, list/reap, timeouts, lost instances), not Apptainer. Tests marked
``apptainer`` run against a real one where it is installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sandfleet.errors import ImageMissing, SandboxLost
from sandfleet.runtime.apptainer import (
    WATCHDOG_SH,
    ApptainerRuntime,
    exec_argv,
    list_argv,
    memory_oom_file,
    own_memory_cgroup,
    parse_instance_list,
    start_argv,
    stop_argv,
    watchdog_argv,
)
from sandfleet.runtime.base import SandboxSpec

SPEC = SandboxSpec(image=Path("/img/base.sif"), cpus=4, memory_mb=1024, hostname="box")


def test_start_argv():
    assert start_argv("apptainer", SPEC, "me-s1", Path("/st/pid")) == [
        "apptainer", "instance", "start", "--writable-tmpfs", "--containall", "--cleanenv",
        "--no-home", "--pid-file", "/st/pid", "--hostname", "box", "--net", "--network", "none",
        "/img/base.sif", "me-s1"]
    networked = SandboxSpec(image=Path("/img/base.sif"), network=True, cpus=4, memory_mb=1024)
    assert start_argv("/opt/apptainer", networked, "me-s1", Path("/st/pid"),
                      cgroup_limits=True) == [
        "/opt/apptainer", "instance", "start", "--writable-tmpfs", "--containall",
        "--cleanenv", "--no-home", "--pid-file", "/st/pid", "--hostname", "sandbox",
        "--cpus", "4", "--memory", "1024M", "/img/base.sif", "me-s1"]


def test_exec_stop_list_watchdog_argv():
    assert exec_argv("apptainer", "me-s1", ["bash", "-c", "ls, -l"], cwd="/app",
                     env={"A": "1,2", "B": "x=y"}) == [
        "env", "APPTAINERENV_A=1,2", "APPTAINERENV_B=x=y", "apptainer", "exec", "--cleanenv",
        "--pwd", "/app", "instance://me-s1", "bash", "-c", "ls, -l"]
    assert stop_argv("apptainer", "me-s1") == ["apptainer", "instance", "stop", "--force",
                                                "me-s1"]
    assert list_argv("apptainer") == ["apptainer", "instance", "list", "--json"]
    assert watchdog_argv("apptainer", "me-s1", 14400.0, 321) == [
        "sh", "-c", WATCHDOG_SH, "sandfleet-watchdog", "14400", "apptainer", "me-s1", "321"]


def test_parse_instance_list():
    text = """{"instances": [
        {"instance": "me-s1", "pid": 1234, "img": "/img/a.sif", "ip": "",
         "logErrPath": "/x.err", "logOutPath": "/x.out"},
        {"instance": "other-s2", "pid": 99, "img": "/img/b.sif"}]}"""
    assert parse_instance_list(text) == {"me-s1": 1234, "other-s2": 99}
    assert parse_instance_list('{"instances": null}') == {}
    assert parse_instance_list("") == {}


FAKE = textwrap.dedent('''\
    #!{python}
    """A fake apptainer: instances are detached sleeps; exec runs on the host."""
    import json, os, subprocess, sys
    from pathlib import Path
    reg = Path(os.environ["FAKE_APPTAINER_DIR"])
    reg.mkdir(exist_ok=True)
    args = sys.argv[1:]
    with open(reg / "calls.log", "a") as log:
        log.write(json.dumps(args) + "\\n")
    def alive(pid):
        try:
            return Path(f"/proc/{{pid}}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    if args[:2] == ["instance", "start"]:
        name, pid_file = args[-1], args[args.index("--pid-file") + 1]
        p = subprocess.Popen(["sleep", "1000"], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        Path(pid_file).write_text(str(p.pid))
        (reg / f"{{name}}.json").write_text(json.dumps({{"pid": p.pid, "img": args[-2]}}))
        print("INFO: instance started successfully")
    elif args[:2] == ["instance", "list"]:
        items = [{{"instance": f.stem, **json.loads(f.read_text())}} for f in reg.glob("*.json")]
        print(json.dumps({{"instances": [i for i in items if alive(i["pid"])]}}))
    elif args[:2] == ["instance", "stop"]:
        f = reg / f"{{args[-1]}}.json"
        if not f.exists():
            sys.exit("FATAL: no instance found")
        if alive(json.loads(f.read_text())["pid"]):
            os.kill(json.loads(f.read_text())["pid"], 9)
        f.unlink()
    elif args[0] == "exec":
        name = next(a for a in args if a.startswith("instance://"))[len("instance://"):]
        f = reg / f"{{name}}.json"
        if not f.exists() or not alive(json.loads(f.read_text())["pid"]):
            sys.exit(f"FATAL: no instance found with name {{name}}")
        cmd = args[args.index(f"instance://{{name}}") + 1:]
        env = {{k[len("APPTAINERENV_"):]: v for k, v in os.environ.items()
               if k.startswith("APPTAINERENV_")}}
        env["PATH"] = os.environ["PATH"]
        os.chdir(args[args.index("--pwd") + 1])
        os.execvpe(cmd[0], cmd, env)
    else:
        sys.exit(f"fake apptainer: unsupported {{args}}")
    ''').format(python=sys.executable)


@pytest.fixture
def fake(tmp_path, base_sif, monkeypatch):
    exe = tmp_path / "apptainer"
    exe.write_text(FAKE)
    exe.chmod(0o755)
    monkeypatch.setenv("FAKE_APPTAINER_DIR", str(tmp_path / "registry"))
    runtime = ApptainerRuntime(tmp_path / "state", owner="me", apptainer=str(exe))
    yield runtime, tmp_path
    runtime.reap(keep=())
    assert list((tmp_path / "registry").glob("*.json")) == []


def test_class_over_a_fake_apptainer(fake, base_sif):
    runtime, tmp = fake
    spec = SandboxSpec(image=base_sif, env={"FOO": "bar"}, workdir=str(tmp))
    runtime.start("s1", spec)
    runtime.start("s2", spec)
    result = runtime.exec("s1", "echo $FOO $CALL; pwd", env={"CALL": "x"}, timeout=10)
    assert (result.output, result.exit_code) == (f"bar x\n{tmp}\n", 0)
    slow = runtime.exec("s1", "sleep 50 & sleep 51", timeout=1)
    assert slow.timed_out and slow.exit_code == 124
    (tmp / "src").mkdir()
    (tmp / "src" / "f.txt").write_text("hi")
    runtime.copy_in("s1", tmp / "src", f"{tmp}/copied")
    runtime.copy_out("s1", f"{tmp}/copied", tmp / "back")
    assert (tmp / "back" / "f.txt").read_text() == "hi"

    fresh = ApptainerRuntime(tmp / "state", owner="me", apptainer=runtime.apptainer)
    assert fresh.list_running() == ["s1", "s2"]
    assert ApptainerRuntime(tmp / "state", owner="you",
                            apptainer=runtime.apptainer).list_running() == []
    assert fresh.reap(keep=["s1"]) == ["s2"]
    with pytest.raises(SandboxLost):
        runtime.exec("s2", "true", timeout=5)
    runtime.stop("s2")  # idempotent

    pid = runtime._live("s1").instance[0]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(SandboxLost, match="died"):
        runtime.exec("s1", "true", timeout=5)
    with pytest.raises(SandboxLost, match="no such sandbox"):
        runtime.exec("nope", "true", timeout=5)
    with pytest.raises(ImageMissing, match="missing.sif"):
        runtime.start("s3", SandboxSpec(image=tmp / "missing.sif"))


def test_memory_oom_file_from_proc_cgroup():
    v1 = "9:name=systemd:/x\n4:memory:/job_1/apptainer-7\n0::/\n"
    assert memory_oom_file(v1) == "/sys/fs/cgroup/memory/job_1/apptainer-7/memory.oom_control"
    assert memory_oom_file("4:memory:/\n0::/\n") is None  # the root: not the instance's
    assert memory_oom_file("0::/user.slice/apptainer-7.scope\n", root="/cg") == \
        "/cg/user.slice/apptainer-7.scope/memory.events"
    assert memory_oom_file("0::/\n") is None
    job = "/cg/memory/job_1/memory.oom_control"
    ours = "/cg/memory/job_1/step_0/memory.oom_control"
    inst = "/cg/memory/job_1/apptainer-7/memory.oom_control"
    assert own_memory_cgroup(inst, ours) == inst
    assert own_memory_cgroup(job, ours) is None  # the job's: every sandbox's OOMs
    assert own_memory_cgroup(ours, ours) is None and own_memory_cgroup(None, ours) is None
    assert own_memory_cgroup("/cg/memory/job_10/memory.oom_control", ours) is not None


def test_oom_kills_from_the_instance_memory_cgroup(fake, base_sif):
    """What ``cgroup_limits`` does, done by hand on the fake: the instance moved into a
    memory cgroup of its own, where a process then gets OOM-killed."""
    runtime, tmp = fake
    spec = SandboxSpec(image=base_sif, workdir=str(tmp))
    runtime.start("s1", spec)
    assert runtime.oom_kills("s1") is None  # no cgroup_limits: cannot tell
    def with_limits() -> ApptainerRuntime:
        return ApptainerRuntime(tmp / "state", owner="me", apptainer=runtime.apptainer,
                                cgroup_limits=True)

    assert with_limits().oom_kills("s1") is None  # in our own cgroup: not the instance's
    ours = memory_oom_file(Path("/proc/self/cgroup").read_text())
    if ours is None or not os.access(os.path.dirname(ours), os.W_OK):
        pytest.skip("no writable memory cgroup here")
    group = Path(os.path.dirname(ours)) / f"fake-apptainer-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(64 << 20))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(64 << 20))
        (group / "cgroup.procs").write_text(str(runtime._live("s1").instance[0]))
        limited = with_limits()
        assert limited.oom_kills("s1") == 0
        hog = runtime.exec("s1", f"echo $$ > {group}/cgroup.procs && "
                           "exec python3 -c 'b = bytearray(300 << 20)'", timeout=30)
        assert hog.exit_code == 137
        assert limited.oom_kills("s1") == 1
        limited.stop("s1")
        assert limited.oom_kills("s1") is None
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        group.rmdir()


def test_watchdog_stops_the_instance_at_max_lifetime(fake, base_sif):
    runtime, tmp = fake
    runtime.start("short", SandboxSpec(image=base_sif, max_lifetime_s=1, workdir=str(tmp)))
    deadline = time.monotonic() + 10
    while "short" in runtime.list_running() and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(SandboxLost, match="max lifetime"):
        runtime.exec("short", "true", timeout=5)


@pytest.mark.skipif(shutil.which("apptainer") is None, reason="no apptainer here")
def test_real_apptainer(tmp_path, base_sif):
    runtime = ApptainerRuntime(tmp_path / "state", owner="t")
    runtime.start("a", SandboxSpec(image=base_sif))
    try:
        assert runtime.exec("a", "echo hi", timeout=30).output == "hi\n"
        out = runtime.exec("a", ["python3", "-c",
                                 "import socket; print(socket.if_nameindex())"], timeout=30)
        assert out.output == "[(1, 'lo')]\n"
        assert runtime.exec("a", "sleep 100", timeout=1).timed_out
        assert runtime.list_running() == ["a"]
    finally:
        runtime.stop("a")
    assert runtime.list_running() == []
