"""sandfleet.runtime: real local sandboxes (bubblewrap) from the base SIF. Its pure parts
are test_runtime_parts.py."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandfleet.errors import (
    ImageMissing,
    SandboxLost,
    SandboxStartError,
)
from sandfleet.runtime.base import (
    ExecResult,
    SandboxSpec,
    kill_process_group,
    proc_start_time,
)
from sandfleet.runtime.local import LocalRuntime

REPO = Path(__file__).resolve().parents[2]
OWNER = f"t{os.getpid()}"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime")
    return root / "state", root / "cache"


@pytest.fixture(scope="module")
def runtime(dirs):
    runtime = LocalRuntime(*dirs, owner=OWNER)
    yield runtime
    left = runtime.reap(keep=())
    assert left == [], f"sandboxes left running: {left}"
    assert not list((dirs[0] / "sandboxes").glob("*")), "sandbox state left behind"
    for ctrl, parent in runtime.cgroups.parents.items():
        assert not list(parent.glob(f"{OWNER}-*")), f"{ctrl} cgroups left behind"
    assert str(dirs[0]) not in Path("/proc/self/mountinfo").read_text()


_ids = itertools.count()


@pytest.fixture
def make(runtime, base_sif):
    """Start sandboxes from the base image (or ``image``; spec fields as keywords); all
    stopped after."""
    started = []

    def make(**spec) -> str:
        sandbox_id = f"s{next(_ids)}"
        runtime.start(sandbox_id, SandboxSpec(**{"image": base_sif, **spec}))
        started.append(sandbox_id)
        return sandbox_id

    yield make
    for sandbox_id in started:
        runtime.stop(sandbox_id)


def run(runtime, sandbox_id, command, **kwargs) -> ExecResult:
    kwargs.setdefault("timeout", 30)
    return runtime.exec(sandbox_id, command, **kwargs)


@pytest.mark.sandbox
def test_exec_output_exit_code_cwd_env_stdin_and_state(runtime, make):
    sid = make(env={"FOO": "from-spec"}, workdir="/root")
    result = run(runtime, sid, "echo out; echo err >&2; exit 3")
    assert (result.output, result.exit_code, result.timed_out, result.oom) == \
        ("out\nerr\n", 3, False, False)
    assert run(runtime, sid, ["pwd"]).output == "/root\n"
    assert run(runtime, sid, "pwd", cwd="/tmp").output == "/tmp\n"
    env = run(runtime, sid, "echo $FOO $BAR $LC_ALL $HOME", env={"BAR": "call"}).output
    assert env == "from-spec call C.UTF-8 /root\n"  # LC_ALL: the image's 90-environment.sh
    assert run(runtime, sid, ["cat"], stdin=b"piped in").output == "piped in"
    run(runtime, sid, "echo kept > /root/note && mkdir -p /srv/app && cd /srv/app && touch x")
    assert run(runtime, sid, "cat /root/note; ls /srv/app").output == "kept\nx\n"
    big = run(runtime, sid, "seq 1 300000").output  # ~2 MB, over the 1 MiB cap
    assert big.startswith("1\n2\n") and big.endswith("\n300000\n") and "bytes cut" in big
    assert run(runtime, sid, "kill -9 $$").exit_code == 137


@pytest.mark.sandbox
def test_timeout_kills_the_process_group_and_the_sandbox_stays_usable(runtime, make):
    sid = make()
    # durations of this run's own: another run of this test on the host has its own sleeps
    first, second = f"sleep 101.{os.getpid()}", f"sleep 102.{os.getpid()}"
    result = run(runtime, sid, f"{first} & {second}; echo never", timeout=1)
    assert result.timed_out and result.exit_code == 124 and result.duration_s < 5
    assert "never" not in result.output
    assert run(runtime, sid, "echo back").output == "back\n"
    procs = run(runtime, sid, "ps -eo args").output
    assert first not in procs and second not in procs
    host = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True,
                          check=True, timeout=30).stdout
    assert first not in host


@pytest.mark.sandbox
def test_isolation_from_host_and_other_sandboxes(runtime, make, tmp_path):
    marker = tmp_path / "host-secret"
    marker.write_text("x")
    a, b = make(), make()
    run(runtime, a, "echo mine > /root/secret-a")
    check = (f"test -e {marker} && echo host-visible; test -e /work && echo work-visible; "
             "test -e /root/.cache && echo cache-visible; test -e /root/secret-a && echo a-visible;"
             "hostname; python3 -c 'import socket; print(socket.if_nameindex())'; "
             "cat /proc/1/cmdline | tr '\\0' ' '; echo; "
             "mknod /tmp/disk b 8 0 2>/dev/null && echo mknod-allowed; "
             "mount -t proc proc /mnt 2>/dev/null; ls /mnt | grep -c . ")
    out = run(runtime, b, check).output.splitlines()
    assert out[:2] == ["sandbox", "[(1, 'lo')]"], out
    assert "sandfleet-init" in out[2]
    assert "mknod-allowed" not in out
    assert int(out[-1]) < 100  # a /proc of its own pid namespace: a handful of processes
    assert run(runtime, a, "cat /root/secret-a").output == "mine\n"


@pytest.mark.sandbox
def test_writes_land_in_the_overlay_never_in_image_or_cache(runtime, make, base_sif, dirs):
    before = base_sif.stat()
    sid = make()
    run(runtime, sid, "echo new > /etc/added; echo changed >> /etc/hostname; rm /bin/ls")
    assert run(runtime, sid, "cat /etc/added; test -e /bin/ls || echo ls-gone").output == \
        "new\nls-gone\n"
    # the image is mounted, not unpacked: nothing in the cache, nothing on the host's mounts
    assert not (dirs[1] / "rootfs").exists()
    assert str(dirs[0]) not in Path("/proc/self/mountinfo").read_text()
    other = make()
    assert run(runtime, other, "test -e /etc/added || ls /bin/ls").output == "/bin/ls\n"
    after = base_sif.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.sandbox
def test_copy_in_and_out_round_trip(runtime, make, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha\n")
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)) * 10)
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    (src / "link").symlink_to("a.txt")
    sid = make()
    runtime.copy_in(sid, src, "/data/in")
    runtime.copy_in(sid, src / "a.txt", "/etc/single.txt")
    assert run(runtime, sid, "/data/in/run.sh; cat /data/in/link /etc/single.txt").output == \
        "ran\nalpha\nalpha\n"
    run(runtime, sid, "echo made > /data/in/sub/new.txt; ln -s /etc/passwd /data/in/evil")
    runtime.copy_out(sid, "/data/in", tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "a.txt").read_text() == "alpha\n"
    assert (out / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 10
    assert (out / "sub" / "new.txt").read_text() == "made\n"
    assert os.access(out / "run.sh", os.X_OK) and os.readlink(out / "link") == "a.txt"
    assert not (out / "evil").is_symlink()  # a link out of the copy is skipped
    runtime.copy_out(sid, "/etc/single.txt", tmp_path / "single.txt")
    assert (tmp_path / "single.txt").read_text() == "alpha\n"
    with pytest.raises(FileNotFoundError):
        runtime.copy_out(sid, "/nope", tmp_path / "nope")


@pytest.mark.sandbox
def test_memory_limit_oom_kill_is_reported(runtime, make):
    if "memory" not in runtime.cgroups.parents:
        pytest.skip("no writable memory cgroup here")
    sid = make(memory_mb=200)
    result = run(runtime, sid, ["python3", "-c", "b = bytearray(400 << 20); print('survived')"])
    assert result.oom and result.exit_code == 137 and "survived" not in result.output
    after = run(runtime, sid, ["python3", "-c", "b = bytearray(50 << 20); print('fits')"])
    assert (after.output, after.oom) == ("fits\n", False)


@pytest.mark.sandbox
def test_cpu_pinning(runtime, make):
    one = make(cpus=1)
    assert run(runtime, one, "nproc").output == "1\n"
    count = run(runtime, one, "grep Cpus_allowed_list /proc/self/status").output.split()[-1]
    assert count.isdigit()
    many = make(cpus=64)  # more than the machine: all of the worker's CPUs
    assert run(runtime, many, "nproc").output == f"{len(os.sched_getaffinity(0))}\n"


@pytest.mark.sandbox
def test_popen_gives_a_long_lived_shell(runtime, make):
    sid = make()
    shell = runtime.popen(sid, ["bash"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    try:
        shell.stdin.write(b"cd /tmp && export X=41\necho $PWD $((X + 1))\n")
        shell.stdin.flush()
        assert shell.stdout.readline() == b"/tmp 42\n"
        shell.stdin.write(b"sleep 300 &\necho bg $!\n")
        shell.stdin.flush()
        assert shell.stdout.readline().startswith(b"bg ")
        assert os.getpgid(shell.pid) == shell.pid  # leads its own process group
    finally:
        assert kill_process_group(shell) != 0
    assert "sleep 300" not in run(runtime, sid, "ps -eo args").output


@pytest.mark.sandbox
def test_lost_sandboxes_and_idempotent_stop(runtime, make):
    with pytest.raises(SandboxLost, match="no such sandbox"):
        runtime.exec("never-started", "true", timeout=5)
    runtime.stop("never-started")
    sid = make()
    os.kill(runtime._live(sid).init[0], signal.SIGKILL)  # its pid 1 dies: everything does
    with pytest.raises(SandboxLost, match="processes died"):
        run(runtime, sid, "true")
    assert sid not in runtime.list_running()
    runtime.stop(sid)
    runtime.stop(sid)
    with pytest.raises(SandboxLost):
        run(runtime, sid, "true")


@pytest.mark.sandbox
def test_list_running_and_reap_from_a_fresh_instance(runtime, make, dirs):
    a, b = make(), make()
    fresh = LocalRuntime(*dirs, owner=OWNER)
    assert {a, b} <= set(fresh.list_running())
    stranger = LocalRuntime(*dirs, owner=f"{OWNER}x")
    assert stranger.list_running() == [] and stranger.reap(keep=()) == []
    keep = set(fresh.list_running()) - {b}
    assert fresh.reap(keep=keep) == [b]
    with pytest.raises(SandboxLost):
        run(runtime, b, "true")
    assert run(fresh, a, "echo via-fresh").output == "via-fresh\n"
    assert run(runtime, a, "echo via-first").output == "via-first\n"
    c = make()  # its state dir lost: found by its cgroups (where there are any)
    pid, start = fresh._live(c).init
    shutil.rmtree(runtime._dir(c))
    if runtime.cgroups.parents:
        assert fresh.reap(keep=[a]) == [c]
        # SIGKILLed through its cgroup; on a loaded machine death can take a moment
        deadline = time.monotonic() + 10
        while proc_start_time(pid) == start and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_start_time(pid) != start


@pytest.mark.slow
@pytest.mark.sandbox
def test_max_lifetime_holds_when_the_bookkeeping_is_killed(base_sif, dirs):
    script = (
        "import sys, time; from pathlib import Path\n"
        "from sandfleet.runtime.local import LocalRuntime\n"
        "from sandfleet.runtime.base import SandboxSpec\n"
        f"rt = LocalRuntime(Path({str(dirs[0])!r}), Path({str(dirs[1])!r}), owner={OWNER!r})\n"
        f"rt.start('ttl', SandboxSpec(image=Path({str(base_sif)!r}), max_lifetime_s=3))\n"
        "print(rt._live('ttl').init[0], flush=True)\n"
        "time.sleep(600)\n")
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    try:
        started = time.monotonic()
        init_pid = int(worker.stdout.readline())
    finally:
        worker.kill()  # SIGKILL: no cleanup of any kind on the Python side
        worker.wait()
    runtime = LocalRuntime(*dirs, owner=OWNER)
    assert "ttl" in runtime.list_running()
    assert run(runtime, "ttl", "echo alive").output == "alive\n"
    while proc_start_time(init_pid) is not None and time.monotonic() - started < 15:
        time.sleep(0.1)
    assert 2.5 < time.monotonic() - started < 10
    with pytest.raises(SandboxLost, match="max lifetime"):
        run(runtime, "ttl", "true")
    assert "ttl" not in runtime.list_running()
    assert runtime.reap(keep=()) == ["ttl"]


@pytest.mark.sandbox
def test_missing_truncated_or_corrupt_image(runtime, base_sif, tmp_path):
    missing = tmp_path / "missing.sif"
    with pytest.raises(ImageMissing, match=str(missing)):
        runtime.start("bad1", SandboxSpec(image=missing))
    truncated = tmp_path / "truncated.sif"
    with open(base_sif, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ImageMissing, match=f"{truncated}.*truncated"):
        runtime.start("bad2", SandboxSpec(image=truncated))
    garbage = tmp_path / "garbage.sif"
    garbage.write_bytes(b"\0" * 4096)
    with pytest.raises(ImageMissing, match="garbage.sif"):
        runtime.start("bad3", SandboxSpec(image=garbage))
    assert not {"bad1", "bad2", "bad3"} & set(runtime.list_running())


@pytest.mark.sandbox
def test_a_failed_start_leaves_nothing_behind(runtime, base_sif, monkeypatch):
    from sandfleet.runtime import local

    monkeypatch.setattr(local, "INIT_SH", "echo init-failed >&2; exit 3")
    with pytest.raises(SandboxStartError, match="fail"):
        runtime.start("broken", SandboxSpec(image=base_sif))
    assert not runtime._dir("broken").exists()
    assert "broken" not in runtime.list_running()
    for parent in runtime.cgroups.parents.values():
        assert not (parent / runtime._cgroup_name("broken")).exists()


@pytest.mark.sandbox
def test_a_runtime_leaves_a_shared_cache_alone(base_sif, tmp_path):
    """The cache folder may be shared (the image builder keeps its base roots there): a
    runtime starting or running sandboxes removes nothing in it and unpacks nothing into it
    (images are mounted; ``sandfleet gc`` removes roots older versions unpacked)."""
    kept = tmp_path / "cache" / "base-rootfs" / "debian-slim-x" / "usr"
    kept.mkdir(parents=True)
    old = tmp_path / "cache" / "rootfs" / ".6d524ae9a92cb66bde4c899a.3n_2w_mq"
    old.mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache").rglob("*"))
    rt = LocalRuntime(tmp_path / "state", tmp_path / "cache", owner=OWNER)
    rt.start("y", SandboxSpec(image=base_sif))
    try:
        assert run(rt, "y", "echo ok").output == "ok\n"
        assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache").rglob("*")) == before
    finally:
        rt.stop("y")


@pytest.mark.sandbox
def test_the_entry_helper_reads_nothing_of_the_sandbox_after_entering(runtime, make):
    """Commands enter through a Python helper that changes root into the sandbox: a module
    it imported only then would come from the agent's files. Plant stdlib look-alikes at the
    host interpreter's paths inside the sandbox; running, failing and missing commands must
    never execute them."""
    stdlib = os.path.dirname(os.__file__)
    sid = make()
    plant = "; ".join(
        f"mkdir -p {stdlib}/{os.path.dirname(m)} && "
        f"echo 'open(\"/tmp/pwned\", \"a\").write(\"{m}\\n\")' > {stdlib}/{m}"
        for m in ("warnings.py", "traceback.py", "linecache.py", "re/__init__.py",
                  "subprocess.py", "signal.py", "json/__init__.py", "encodings/__init__.py"))
    assert run(runtime, sid, plant).exit_code == 0
    for command in (["true"], ["no-such-command"], ["/no/such/path"], "exit 3", "kill -9 $$"):
        run(runtime, sid, command)
    assert run(runtime, sid, "cat /tmp/pwned 2>/dev/null; echo checked").output == "checked\n"


@pytest.mark.sandbox
def test_commands_run_as_the_specs_user_copies_and_the_verifier_as_root(runtime, make,
                                                                         tmp_path):
    """Docker's USER: exec and popen run as the user, without root's capabilities and with
    its home; files are copied in as root; the verifier runs as root; the helper still
    reads nothing of the sandbox's but /etc/passwd and /etc/group."""
    sid = make(user="daemon", workdir="/tmp")
    assert run(runtime, sid, "id -u; id -g; echo $HOME").output == "1\n1\n/usr/sbin\n"
    denied = run(runtime, sid, "touch /etc/planted || echo refused")
    assert denied.output.endswith("refused\n") and "Permission denied" in denied.output
    shell = runtime.popen(sid, ["bash", "-c", "id -un"], stdout=subprocess.PIPE)
    assert shell.communicate(timeout=30)[0] == b"daemon\n"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "f").write_text("x")
    runtime.copy_in(sid, tmp_path / "in", "/opt/in")  # /opt: root's, as in `docker cp`
    assert run(runtime, sid, "stat -c %U /opt/in/f").output == "root\n"
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text("id -u > /logs/verifier/uid\n")
    result = runtime.verify(sid, ["bash", "/tests/test.sh"], tests=tests,
                            logs=tmp_path / "logs", timeout=60)
    assert result.exit_code == 0 and (tmp_path / "logs" / "uid").read_text() == "0\n"
    unknown = run(runtime, make(user="nobody-here"), "true")
    assert unknown.exit_code == 125 and "no user 'nobody-here'" in unknown.output


@pytest.fixture(scope="module")
def tools_sif(base_sif, tmp_path_factory) -> Path:
    """The base image plus verifier tools in /.tmax/verifier (as an image build prepares
    them): a `gradetool` on the tools' PATH and an env file."""
    from sandfleet.runtime import sif

    root = tmp_path_factory.mktemp("tools-image") / "root"
    sif.extract(base_sif, root)
    tools = root / ".tmax" / "verifier"
    (tools / "bin").mkdir(parents=True)
    (tools / "bin" / "gradetool").write_text("#!/bin/sh\necho graded-by-the-image-tool\n")
    (tools / "bin" / "gradetool").chmod(0o755)
    (tools / "env").write_text("PATH=/.tmax/verifier/bin:$PATH\nTOOL_CACHE=/.tmax/verifier/cache\n"
                               "not a setting\n")
    (tools / "cache").mkdir()
    return sif.pack(root, root.parent / "tools.sif")


@pytest.mark.slow
@pytest.mark.sandbox
def test_verifier_tools_are_hidden_from_the_agent_and_given_to_the_verifier(
        runtime, tools_sif, tmp_path):
    runtime.start("tools", SandboxSpec(image=tools_sif))
    try:
        agent = run(runtime, "tools", "ls -A /.tmax/verifier | wc -l; "
                                      "touch /.tmax/verifier/x 2>&1 | grep -c Read-only; "
                                      "umount /.tmax/verifier 2>/dev/null || echo cannot-unmount")
        assert agent.output.split() == ["0", "1", "cannot-unmount"], agent.output
        tests = tmp_path / "tests"
        tests.mkdir()
        (tests / "test.sh").write_text(
            "gradetool; echo $TOOL_CACHE; echo cached > $TOOL_CACHE/entry && cat $TOOL_CACHE/entry\n"
            "echo 1 > /logs/verifier/reward.txt\n")
        result = runtime.verify("tools", ["/bin/bash", "/tests/test.sh"], tests=tests,
                                logs=tmp_path / "logs", timeout=60)
        assert result.output.split() == ["graded-by-the-image-tool", "/.tmax/verifier/cache",
                                         "cached"], result.output
        assert (tmp_path / "logs" / "reward.txt").read_text() == "1\n"
        # what the verifier wrote there went to its own layer, never the image or the agent
        assert run(runtime, "tools", "ls -A /.tmax/verifier | wc -l").output == "0\n"
        again = runtime.verify("tools", ["/bin/sh", "-c", "ls $TOOL_CACHE"], tests=tests,
                               logs=tmp_path / "logs2", timeout=60)
        assert again.output == ""
    finally:
        runtime.stop("tools")


@pytest.fixture(scope="module")
def user_sif(base_sif, tmp_path_factory) -> Path:
    """The base image plus a user ``grader`` (uid 1000, group 1000, also in group 1001), a
    root-only /var/lib/secret, a set-user-ID-root ``peek`` (a copy of cat) that reads it, and
    verifier tools with a cache (as an image whose Dockerfile ends ``USER grader``)."""
    from sandfleet.runtime import sif

    root = tmp_path_factory.mktemp("user-image") / "root"
    sif.extract(base_sif, root)
    with open(root / "etc" / "passwd", "a") as f:
        f.write("grader:x:1000:1000::/home/grader:/bin/bash\n")
    with open(root / "etc" / "group", "a") as f:
        f.write("grader:x:1000:\nstaff2:x:1001:grader\n")
    (root / "home" / "grader").mkdir(parents=True)
    os.chown(root / "home" / "grader", 1000, 1000)
    secret = root / "var" / "lib" / "secret"
    secret.mkdir(parents=True)
    (secret / "rate").write_text("0.7\n")
    secret.chmod(0o700)
    peek = root / "usr" / "local" / "bin" / "peek"
    shutil.copy(root / "usr" / "bin" / "cat", peek)
    peek.chmod(0o4755)
    tools = root / ".tmax" / "verifier"
    (tools / "cache").mkdir(parents=True)
    (tools / "cache" / ".lock").write_text("")
    (tools / "env").write_text("TOOL_CACHE=/.tmax/verifier/cache\n")
    return sif.pack(root, root.parent / "user.sif")


@pytest.mark.sandbox
def test_the_verifier_runs_as_the_user_the_image_names(runtime, user_sif, tmp_path):
    """``verify(user=...)`` as ``docker exec -u`` (Harbor's verifier as the image's USER):
    the image's ids and home, no capabilities, the image's set-user-ID programs work,
    /logs/verifier and the tools' cache are writable, root's files are not; the agent's
    rewritten /etc/passwd does not choose the verifier's ids; a user the image does not
    name exits 126, as Docker's exec fails."""
    runtime.start("graded", SandboxSpec(image=user_sif, user="grader", workdir="/tmp"))
    try:
        # the agent (root here: the copy runs as root) makes grader uid 0 in its /etc/passwd
        forged = run(runtime, "graded", "id -u")
        assert forged.output == "1000\n"
        (tmp_path / "passwd").write_text("root:x:0:0::/root:/bin/bash\n"
                                         "grader:x:0:0::/root:/bin/bash\n")
        runtime.copy_in("graded", tmp_path / "passwd", "/etc/passwd")
        assert run(runtime, "graded", "grep -c ':0:0:' /etc/passwd").output == "2\n"
        tests = tmp_path / "tests"
        tests.mkdir()
        (tests / "test.sh").write_text(
            "id -u; id -g; id -G; echo $HOME; grep CapEff /proc/self/status\n"
            "peek /var/lib/secret/rate\n"
            "cat /var/lib/secret/rate 2>/dev/null || echo no-read\n"
            "touch /etc/planted 2>/dev/null || echo no-write\n"
            "echo x > $TOOL_CACHE/entry && : >> $TOOL_CACHE/.lock && echo cache-ok\n"
            "echo 1 > /logs/verifier/reward.txt\n")
        result = runtime.verify("graded", ["/bin/bash", "/tests/test.sh"], tests=tests,
                                logs=tmp_path / "logs", timeout=60, user="grader")
        assert result.exit_code == 0, result.output
        assert result.output.splitlines() == [
            "1000", "1000", "1000 1001", "/home/grader", "CapEff:\t0000000000000000",
            "0.7", "no-read", "no-write", "cache-ok"], result.output
        assert (tmp_path / "logs" / "reward.txt").read_text() == "1\n"
        assert (tmp_path / "logs" / "reward.txt").stat().st_uid != 0  # (the sandbox's ids)
        as_root = runtime.verify("graded", ["/bin/sh", "-c", "id -u; cat /var/lib/secret/rate"],
                                 tests=tests, logs=tmp_path / "logs-root", timeout=60)
        assert as_root.output == "0\n0.7\n"
        by_uid = runtime.verify("graded", ["/bin/sh", "-c", "id -u; id -g; echo $HOME"],
                                tests=tests, logs=tmp_path / "logs-uid", timeout=60,
                                user="4242:1001")
        assert by_uid.output == "4242\n1001\n/\n"
        unknown = runtime.verify("graded", ["true"], tests=tests, logs=tmp_path / "logs-x",
                                 timeout=60, user="nobody-here")
        assert unknown.exit_code == 126
        assert "no user 'nobody-here' in the image's /etc/passwd" in unknown.output
    finally:
        runtime.stop("graded")


@pytest.mark.sandbox
def test_a_verifier_whose_folder_the_agent_removed_starts_in_root_and_is_graded(
        runtime, make, tmp_path):
    """What the agent left is graded (a 0 it earned), never a verifier that could not start
    (an error, left out of training, which an agent could choose by removing its folder or
    putting a file there); Docker's exec would fail instead."""
    sid = make(workdir="/tmp")
    (tmp_path / "work").mkdir()
    runtime.copy_in(sid, tmp_path / "work", "/srv/work")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text("pwd; echo 0 > /logs/verifier/reward.txt\n")
    there = runtime.verify(sid, ["/bin/sh", "/tests/test.sh"], tests=tests,
                           logs=tmp_path / "logs", timeout=60, cwd="/srv/work")
    assert (there.exit_code, there.output) == (0, "/srv/work\n")
    for leave in ("rm -rf /srv", "rm -rf /srv/work && touch /srv/work"):
        run(runtime, sid, leave)
        result = runtime.verify(sid, ["/bin/sh", "/tests/test.sh"], tests=tests,
                                logs=tmp_path / leave.split()[-1].replace("/", "-"),
                                timeout=60, cwd="/srv/work")
        assert (result.exit_code, result.output) == (
            0, "sandfleet verify: cannot enter /srv/work: started in /\n/\n"), leave


@pytest.mark.sandbox
def test_a_sandbox_with_the_network_runs_commands_and_copies(runtime, make, tmp_path):
    """``network`` shares the host's network namespace: entering must not try to enter it
    again from the sandbox's user namespace (refused by the kernel)."""
    sid = make(network=True)
    assert run(runtime, sid, "echo up").output == "up\n"
    (tmp_path / "f.txt").write_text("x\n")
    runtime.copy_in(sid, tmp_path / "f.txt", "/tmp/f.txt")
    assert run(runtime, sid, "cat /tmp/f.txt").output == "x\n"
