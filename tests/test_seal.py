"""The local runtime's seal, attacked from inside as the agent's root (issue 11).

Every test runs real sandboxes and tries what an agent (or an RL policy looking for reward)
would: host kernel settings, capabilities, mounts and nested namespaces, raising its own
limits, filling the node's disk, reaching another sandbox, and forging its reward, through
the runtime (``LocalRuntime.verify``) and through the fleet and rollout path as training and
evaluation use it (``tmax.rollout.run.rollout`` with a scripted attacker). Each asserts what
a broken seal gets wrong: on the old runtime (commit 2dfe18e: uid 0 inside was host uid 0
with a full capability set, the verifier ran in the agent's own shell, no disk quota) every
one of them fails.

Tests named ``test_FINDING_...`` are attacks that still work against the sealed runtime, and
tests whose docstring starts a paragraph with "FINDING" are required behaviours it gets
wrong: both fail on purpose until the runtime is fixed (the docstrings give the command and
what it does). At the time of writing:

- an agent that replaces /etc with a symlink to a copy gets its own /etc (sitecustomize.py,
  ld.so.preload) into the verifier and forges the reward; a symlink at / (a /conftest.py)
  reaches the verifier too;
- the agent stays frozen for the whole verification (its services cannot answer), and a
  verifier printing more than a pipe holds comes back timed out after ``start_timeout_s``;
- an agent can end its episode as an infrastructure failure instead of its 0: by filling
  /dev/shm (pid 1 is OOM-killed), its disk (the verifier's folders are made there), or its
  root with names (bwrap's command line grows past the kernel's limit).

Nothing here changes a host value: kernel settings are written with the value already there,
/proc/sysrq-trigger is only opened, never written.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES

REPO = Path(__file__).resolve().parents[1]
OWNER = f"seal{os.getpid()}"
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Capabilities root inside must not have (capability(7) numbers); Docker's default set
# keeps none of them.
FORBIDDEN_CAPS = {"CAP_DAC_READ_SEARCH": 2, "CAP_LINUX_IMMUTABLE": 9, "CAP_NET_ADMIN": 12,
                  "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_PTRACE": 19,
                  "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_SYS_RESOURCE": 24,
                  "CAP_SYS_TIME": 25, "CAP_MAC_ADMIN": 33, "CAP_SYSLOG": 34,
                  "CAP_PERFMON": 38, "CAP_BPF": 39}
CORRECT_CSV_ROWS = "region,total_units,total_revenue\nCentral,1161,10940.99\nEast,1193,9918.91\n"
"""csv-sales-aggregate's header and its first two of five rows: real work worth 0.4."""
FORGE_PY = ('import atexit\n'
            'atexit.register(lambda: open("/logs/verifier/reward.txt", "w").write("1\\n"))\n')
"""Python that, run in the verifier's interpreter, overwrites its reward with 1 at exit."""
FORGE_SH = "#!/bin/sh\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"


# ---- helpers


def write_file(path: str, text: str, mode: str = "644") -> str:
    """A shell command writing ``text`` to ``path`` inside the sandbox."""
    return (f"mkdir -p $(dirname {path}) && printf %s {shlex.quote(text)} > {path} && "
            f"chmod {mode} {path}")


def daemon(script_path: str) -> str:
    """A shell command starting ``bash script_path`` detached from the command's group."""
    return f"setsid bash {script_path} </dev/null >/dev/null 2>&1 & disown; sleep 0.2"


def host_read(path: str) -> str:
    return Path(path).read_text()


def cap_sets(status: str) -> dict[str, int]:
    """CapInh/CapPrm/CapEff/CapBnd/CapAmb of a /proc/PID/status text, as ints."""
    return {key: int(value, 16) for key, value in re.findall(r"^(Cap\w+):\s*([0-9a-f]+)$",
                                                              status, re.MULTILINE)}


def uid_maps(text: str) -> list[tuple[int, int, int]]:
    return [tuple(map(int, line.split())) for line in text.splitlines() if line.strip()]


def loop_lines(*needles: str) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return [line for line in out.splitlines() if any(n in line for n in needles)]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.05)


def slot_free(lock_dir: Path, slot: int) -> bool:
    fd = os.open(lock_dir / str(slot), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


# ---- one sealed runtime for the module


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("seal")
    return root / "state", root / "cache"


@pytest.fixture(scope="module")
def runtime(dirs):
    from sandfleet.runtime.local import LocalRuntime

    # a short start timeout: a verifier start that hangs costs this long (see the tests)
    runtime = LocalRuntime(*dirs, owner=OWNER, start_timeout_s=15)
    yield runtime
    left = runtime.reap(keep=())
    assert left == [], f"sandboxes left running: {left}"


_ids = itertools.count()


@pytest.fixture
def make(runtime, base_sif):
    """Start sandboxes from the base image (spec fields, ``image`` too, as keywords); all
    stopped after."""
    from sandfleet.runtime.base import SandboxSpec

    started = []

    def make(**spec) -> str:
        sandbox_id = f"x{next(_ids)}"
        runtime.start(sandbox_id, SandboxSpec(**{"image": base_sif, **spec}))
        started.append(sandbox_id)
        return sandbox_id

    yield make
    for sandbox_id in started:
        runtime.stop(sandbox_id)


def run(runtime, sandbox_id, command, **kwargs):
    kwargs.setdefault("timeout", 60)
    return runtime.exec(sandbox_id, command, **kwargs)


def verify(runtime, sandbox_id, tmp_path: Path, test_sh: str,
           files: dict[str, str] | None = None, **kwargs):
    """Run ``test_sh`` as the task verifier (``/bin/bash /tests/test.sh``) beside the sandbox,
    ``files`` (name: text) beside it in /tests; (result, reward.txt's text or None)."""
    root = Path(tmp_path) / f"verify{next(_ids)}"
    tests, logs = root / "tests", root / "logs"
    tests.mkdir(parents=True)
    logs.mkdir()
    for name, text in {**(files or {}), "test.sh": test_sh}.items():
        (tests / name).write_text(text)
    kwargs.setdefault("timeout", 60)
    kwargs.setdefault("env", {"PATH": HOST_PATH})
    result = runtime.verify(sandbox_id, ["/bin/bash", "/tests/test.sh"], tests=tests,
                            logs=logs, **kwargs)
    reward = logs / "reward.txt"
    return result, (reward.read_text().strip() if reward.is_file() else None)


# ---- 1. host kernel settings


@pytest.mark.sandbox
@pytest.mark.parametrize("setting", ["kernel/printk_ratelimit", "kernel/core_pattern"])
def test_host_kernel_settings_cannot_be_written_from_inside(runtime, make, setting):
    path = f"/proc/sys/{setting}"
    before = host_read(path)
    sid = make()
    # the value that is already there: a seal that leaks changes nothing on the host either
    result = run(runtime, sid, f'printf "%s\\n" "$V" > {path} && echo WROTE',
                 env={"V": before.rstrip("\n")})
    sysctl = run(runtime, sid, f"sysctl -w {setting.replace('/', '.')}=\"$V\" && echo WROTE",
                 env={"V": before.rstrip("\n")})
    assert host_read(path) == before
    for attempt in (result, sysctl):
        assert attempt.exit_code != 0 and "WROTE" not in attempt.output, attempt.output


# ---- 2. root inside is not host root


@pytest.mark.sandbox
def test_root_inside_maps_to_an_unprivileged_range_without_admin_capabilities(runtime, make):
    sid = make()
    out = run(runtime, sid, "cat /proc/self/uid_map; echo ==; cat /proc/self/gid_map; echo ==;"
                            "for s in /proc/[0-9]*/status; do cat $s; echo ==; done").output
    uid_map, gid_map, *statuses = [part for part in out.split("==\n") if part.strip()]
    for ids in (uid_maps(uid_map), uid_maps(gid_map)):
        assert len(ids) == 1, ids
        inside, outside, count = ids[0]
        assert inside == 0 and outside >= 65536 and count <= 65536, ids  # uid 0 is not host 0
    assert len(statuses) >= 2  # pid 1 and this shell at least: every process inside
    for status in statuses:
        caps = cap_sets(status)
        for name in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb"):
            held = {cap for cap, bit in FORBIDDEN_CAPS.items() if caps[name] >> bit & 1}
            assert not held, f"{name} of a process inside holds {sorted(held)}"


@pytest.mark.sandbox
def test_no_mounts_no_nested_namespaces_no_sys_no_sysrq(runtime, make):
    sid = make()
    attempts = {
        "cgroup": "mkdir -p /tmp/cgm && mount -t cgroup -o memory none /tmp/cgm",
        "cgroup2": "mkdir -p /tmp/cg2 && mount -t cgroup2 none /tmp/cg2",
        "tmpfs": "mkdir -p /tmp/t && mount -t tmpfs none /tmp/t",
        "bind": "mkdir -p /tmp/b && mount --bind /etc /tmp/b",
        "proc-remount": "mount -o remount,rw /proc/sys",
        "userns": "unshare -U true",
        "userns-root": "unshare -Ur true",
        "mountns": "unshare -m true",
        "sysrq": "python3 -c \"open('/proc/sysrq-trigger', 'wb', buffering=0)\"",  # no write
        "kmsg": "head -c 1 /dev/kmsg",
        "kcore": "head -c 1 /proc/kcore",
    }
    for name, command in attempts.items():
        result = run(runtime, sid, f"{command} && echo ALLOWED")
        assert result.exit_code != 0 and "ALLOWED" not in result.output, (name, result.output)
    assert run(runtime, sid, "ls -A /sys 2>/dev/null | wc -l").output.strip() == "0"
    for path in ("/proc/sys/kernel/printk_ratelimit", "/proc/sys/vm/drop_caches"):
        assert run(runtime, sid, f"test -w {path} && echo W").output == "", path


@pytest.mark.sandbox
def test_root_inside_is_still_root_of_its_own_filesystem(runtime, make):
    sid = make()
    script = ("set -e; useradd -m bob; touch /srv/owned; chown bob:bob /srv/owned;"
              "stat -c %U:%G /srv/owned; su bob -c 'id -un; echo hi > ~/note; cat ~/note';"
              "echo sys > /usr/lib/agent-file; echo etc > /etc/agent-file; rm /usr/bin/yes;"
              "cat /usr/lib/agent-file /etc/agent-file; test ! -e /usr/bin/yes && echo yes-gone;"
              "chmod 4755 /srv/owned && stat -c %a /srv/owned")
    result = run(runtime, sid, script)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["bob:bob", "bob", "hi", "sys", "etc", "yes-gone",
                                          "4755"]
    # on the host, the files are the sandbox's range's, never root's
    record = runtime._live(sid)
    upper = Path(f"/proc/{record.monitor[0]}/root") / runtime._dir(sid).relative_to("/") \
        / "disk" / "upper"
    assert (upper / "etc" / "agent-file").stat().st_uid == record.uid_base
    bob = int(run(runtime, sid, "id -u bob").output)
    assert (upper / "srv" / "owned").stat().st_uid == record.uid_base + bob


# ---- 3. limits cannot be raised


@pytest.mark.sandbox
def test_the_memory_limit_holds_and_cannot_be_raised_from_inside(runtime, make):
    if "memory" not in runtime.cgroups.parents:
        pytest.fail("no memory cgroup: the runtime should have refused to start")
    sid = make(memory_mb=200)
    memory = next(Path(p) for p in runtime._live(sid).cgroups
                  if Path(p).parent == runtime.cgroups.parents["memory"])
    pids = next(Path(p) for p in runtime._live(sid).cgroups
                if Path(p).parent == runtime.cgroups.parents["pids"])
    limits = {f: (memory / f).read_text() for f in ("memory.limit_in_bytes",)}
    limits["pids.max"] = (pids / "pids.max").read_text()
    assert int(limits["memory.limit_in_bytes"]) == 200 << 20
    raise_it = ("mkdir -p /tmp/cgm /tmp/cgp;"
                "mount -t cgroup -o memory none /tmp/cgm && echo 4294967296 > "
                "/tmp/cgm/memory.limit_in_bytes; mount -t cgroup -o pids none /tmp/cgp && "
                "echo max > /tmp/cgp/pids.max;"
                "for f in /sys/fs/cgroup/memory/memory.limit_in_bytes "
                "/sys/fs/cgroup/memory/*/memory.limit_in_bytes; do echo 4294967296 > $f; done;"
                "true")
    run(runtime, sid, raise_it)
    result = run(runtime, sid, ["python3", "-c",
                                "b = bytearray(400 << 20); print('survived', len(b))"])
    assert result.oom and result.exit_code == 137 and "survived" not in result.output
    assert (memory / "memory.limit_in_bytes").read_text() == limits["memory.limit_in_bytes"]
    assert (pids / "pids.max").read_text() == limits["pids.max"]
    assert run(runtime, sid, "echo still-up").output == "still-up\n"


# ---- 4. disk quota


@pytest.mark.sandbox
def test_writes_past_storage_mb_fail_inside_and_the_node_disk_is_untouched(runtime, make,
                                                                           dirs):
    a, b = make(storage_mb=64), make(storage_mb=64)
    assert int(run(runtime, a, "df -k --output=size / | tail -1").output) < 70 * 1024
    free = os.statvfs(dirs[0])
    before = free.f_bavail * free.f_frsize
    result = run(runtime, a, "dd if=/dev/zero of=/tmp/fill bs=1M count=1024 status=none; "
                             "echo rc=$?")
    assert "No space left on device" in result.output and "rc=0" not in result.output
    free = os.statvfs(dirs[0])
    dropped = before - free.f_bavail * free.f_frsize
    assert dropped < 512 << 20, f"the node lost {dropped >> 20} MiB for 1024 attempted"
    # a policy outcome: the sandbox is up, full, and can free its space again
    assert run(runtime, a, "rm /tmp/fill && echo 12 > /tmp/small && cat /tmp/small").output \
        == "12\n"
    # the other sandbox has its own quota
    other = run(runtime, b, "dd if=/dev/zero of=/tmp/f bs=1M count=32 status=none && "
                            "stat -c %s /tmp/f")
    assert other.exit_code == 0 and other.output == f"{32 << 20}\n", other.output


@pytest.mark.sandbox
def test_FINDING_filling_dev_shm_kills_the_sandbox(runtime, make):
    """FINDING (works against the sealed runtime): /dev is bwrap's tmpfs, writable by the
    sandbox's root, sized at half the node's RAM and outside the ``storage_mb`` quota; only
    the memory cgroup bounds it, and its pages cannot be reclaimed. ``dd if=/dev/zero
    of=/dev/shm/fill bs=1M`` comes back as an OOM (exit 137), but the cgroup stays full, the
    OOM killer goes on to kill pid 1, and the sandbox is dead: for about two seconds every
    exec returns exit 125 "sandfleet enter: [Errno 2] No such file or directory:
    '/proc/<pid 1>/ns/mnt'" as if it were the command's result (pid 1 is exiting, not yet
    a zombie, so ``_live`` still counts it alive), then SandboxLost. A policy can end any
    episode as an infrastructure failure this way. Expected: writes there fail (ENOSPC, as
    on the disk) or are killed, and the sandbox goes on."""
    sid = make(memory_mb=200)
    fill = run(runtime, sid, "dd if=/dev/zero of=/dev/shm/fill bs=1M count=400 status=none")
    assert fill.exit_code != 0
    time.sleep(1)
    after = run(runtime, sid, "rm -f /dev/shm/fill; echo still-up")
    assert (after.exit_code, after.output) == (0, "still-up\n"), after.output


# ---- 5. two sandboxes


@pytest.mark.sandbox
def test_two_sandboxes_have_disjoint_uid_ranges_and_cannot_see_each_other(runtime, make):
    a, b = make(), make()
    maps = [uid_maps(run(runtime, s, "cat /proc/self/uid_map").output)[0] for s in (a, b)]
    assert maps[0] != maps[1]
    (_, base_a, count_a), (_, base_b, count_b) = maps
    assert base_a + count_a <= base_b or base_b + count_b <= base_a, maps
    run(runtime, a, "echo secret-a > /root/secret-a; "
                    + write_file("/tmp/a-loop.sh", "exec -a a-marker-proc sleep 300\n")
                    + "; " + daemon("/tmp/a-loop.sh"))
    assert "a-marker-proc" in run(runtime, a, "ps -eo args").output
    # the names are split so that b's own command line does not hold them
    seen = run(runtime, b, "cat /root/[s]ecret-a 2>/dev/null; "
                           "ps -eo args | grep -c '[a]-marker-proc'; "
                           "grep -l '[a]-marker-proc' /proc/[0-9]*/cmdline 2>/dev/null; "
                           "find / -xdev -name '[s]ecret-a' 2>/dev/null; true").output
    assert seen == "0\n", seen
    # b kills everything it can: a's process lives on
    run(runtime, b, "kill -9 -1; true")
    assert "a-marker-proc" in run(runtime, a, "ps -eo args").output


# ---- the verifier beside the sandbox (runtime level)


@pytest.mark.sandbox
def test_the_verifier_is_out_of_sight_and_reach_of_the_agents_processes(runtime, make,
                                                                        tmp_path):
    """A watcher scans /proc for the verifier (test.sh, its sleep) to forge its reward
    through /proc/PID/root and to kill it, and a second loop signals everything it can
    (kill -KILL -1, kill -STOP -1). The verifier runs 2 s and gets its own reward.

    FINDING (fails on the sealed runtime): the watcher's heartbeat does not move while the
    verifier runs: the agent stays frozen for the whole verification (see
    test_a_verifier_with_more_output_than_a_pipe_holds_is_not_timed_out), so the seal is
    only tested here once that is fixed."""
    sid = make()
    watcher = textwrap.dedent("""\
        while :; do
          echo x >> /var/tmp/beat
          for d in /proc/[0-9]*; do
            p=${d#/proc/}
            c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null) || continue
            case "$c" in
              *test.sh*|*verifier-sleep*)
                echo "SAW $p $c" >> /var/tmp/saw
                echo 1 > $d/root/logs/verifier/reward.txt
                kill -9 $p ;;
            esac
          done
        done
        """)
    signaller = "while :; do kill -STOP -1; kill -KILL -1; done 2>/dev/null\n"
    run(runtime, sid, write_file("/opt/watch.sh", watcher) + "; " + daemon("/opt/watch.sh"))
    test_sh = ("echo 0 > /logs/verifier/reward.txt\n"
               "wc -l < /var/tmp/beat\n"
               "bash -c 'exec -a verifier-sleep sleep 2'\n"
               "wc -l < /var/tmp/beat\n"
               "echo 0.25 > /logs/verifier/reward.txt\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert (result.exit_code, reward) == (0, "0.25"), result.output
    # the watcher ran all along (else this proves nothing): see the service tests
    before, after = map(int, result.output.split())
    assert after > before, "the agent's processes were stopped while the verifier ran"
    # it did not see the verifier, and the verifier saw none of the agent's processes
    assert run(runtime, sid, "cat /var/tmp/saw 2>/dev/null; "
                             "pgrep -x -f 'bash /opt/watch.sh' >/dev/null && echo watching"
               ).output == "watching\n"
    run(runtime, sid, write_file("/opt/sig.sh", signaller) + "; " + daemon("/opt/sig.sh"))
    result, reward = verify(runtime, sid, tmp_path, test_sh.replace("wc -l < /var/tmp/beat\n",
                                                                    ""))
    assert (result.exit_code, reward) == (0, "0.25"), result.output


@pytest.mark.sandbox
def test_the_verifier_gets_the_images_system_tools_and_the_agents_files(runtime, make,
                                                                       tmp_path):
    """/usr/bin/python3 and /bin/bash replaced, /etc/alternatives/awk and
    /etc/ld.so.preload rewritten, a sitecustomize.py in /etc/python3.11, files at / and
    /logs/verifier pre-created: the verifier runs the image's tools over the agent's work."""
    sid = make(workdir="/app")
    attack = "; ".join([
        "mkdir -p /app && echo 'the agent wrote this' > /app/answer.txt",
        write_file("/tmp/forge", FORGE_SH, "755"),
        "rm -f /usr/bin/python3 && cp /tmp/forge /usr/bin/python3",
        "cp /tmp/forge /usr/local/bin/python3",
        "ln -sf /tmp/forge /etc/alternatives/awk",
        "echo /tmp/agent-preload.so > /etc/ld.so.preload",
        write_file("/etc/python3.11/sitecustomize.py", FORGE_PY),
        write_file("/conftest.py", FORGE_PY),
        write_file("/logs/verifier/reward.txt", "1\n"),
        "cp /tmp/forge /usr/bin/bash.new && mv -f /usr/bin/bash.new /usr/bin/bash",
    ])
    assert run(runtime, sid, attack).exit_code == 0
    test_sh = textwrap.dedent("""\
        echo 0 > /logs/verifier/reward.txt
        cat /app/answer.txt
        test -e /conftest.py && echo conftest-visible
        awk 'BEGIN { print "awk-ok" }'
        python3 -c 'import sys; print("python-ok", sys.version_info[0])'
        python3 -c 'print(0.5)' > /logs/verifier/reward.txt
        """)
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert reward == "0.5", (reward, result.output)
    assert result.output.splitlines() == ["the agent wrote this", "awk-ok", "python-ok 3"], \
        result.output  # nothing from the loader about the agent's ld.so.preload either
    # the agent's sandbox keeps its changes, but what would have shaped the verifier's tools
    # where the image has nothing (its ld.so.preload, a file at /) is set aside, not lost
    names = run(runtime, sid, ["/bin/ls", "-a", "/etc", "/"]).output.split()  # (its bash
    aside = [n for n in names if n.startswith(".tmax-set-aside-")]           # is the forge)
    assert [n.rsplit("-", 1)[0] for n in sorted(aside)] == [
        ".tmax-set-aside-conftest.py", ".tmax-set-aside-ld.so.preload"], names
    preload = next(n for n in aside if "ld.so.preload" in n)
    assert run(runtime, sid, ["/bin/cat", f"/etc/{preload}", "/app/answer.txt"]).output == \
        "/tmp/agent-preload.so\nthe agent wrote this\n"


@pytest.mark.sandbox
def test_agent_system_opt_in_shows_the_agents_system_tools(runtime, make, tmp_path):
    sid = make()
    run(runtime, sid, write_file("/usr/local/bin/agent-tool", "#!/bin/sh\necho 1\n", "755"))
    test_sh = ("echo 0 > /logs/verifier/reward.txt\n"
               "agent-tool > /tmp/r && mv /tmp/r /logs/verifier/reward.txt\n")
    assert verify(runtime, sid, tmp_path, test_sh)[1] == "0"
    assert verify(runtime, sid, tmp_path, test_sh, agent_system=True)[1] == "1"


@pytest.fixture(scope="module")
def venv_sif(base_sif, tmp_path_factory) -> Path:
    """The base image plus tools outside /usr, as images install them on their PATH: a
    "venv" /opt/tool (its program /opt/tool/bin/runner runs the code in /opt/tool/lib,
    which writes reward 0.25), /app/bin/app-tool and /srv/work/bin/work-tool (each prints
    "image")."""
    from sandfleet.runtime import sif

    root = tmp_path_factory.mktemp("venv-image") / "root"
    sif.extract(base_sif, root)
    files = {"opt/tool/bin/runner": "#!/bin/sh\n. /opt/tool/lib/grade.sh\n",
             "opt/tool/lib/grade.sh": "echo 0.25 > /logs/verifier/reward.txt\n",
             "app/bin/app-tool": "#!/bin/sh\necho image\n",
             "srv/work/bin/work-tool": "#!/bin/sh\necho image\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        (root / name).chmod(0o755)
    return sif.pack(root, root.parent / "venv.sif")


VENV_PATH = f"/opt/tool/bin:{HOST_PATH}"
"""The verifier's PATH for venv_sif: an image's ENV PATH with its venv first."""
RUNNER_SH = "echo 0 > /logs/verifier/reward.txt\nrunner\n"
"""A test.sh that leaves what the image's runner writes: 0.25."""


@pytest.mark.sandbox
@pytest.mark.parametrize("attack", [
    "cp /tmp/forge /opt/tool/bin/runner",
    "cp /tmp/forge /opt/tool/lib/grade.sh",  # the venv's library code, run by its program
    # the whole folder, and the folder holding it, replaced by links to the agent's copies
    ("cp -a /opt/tool /root/tool && cp /tmp/forge /root/tool/bin/runner && rm -rf /opt/tool"
     " && ln -s /root/tool /opt/tool"),
    ("cp -a /opt /root/opt && cp /tmp/forge /root/opt/tool/bin/runner && rm -rf /opt"
     " && ln -s /root/opt /opt"),
    ("rm -rf /opt/tool/bin && mkdir /root/bin && cp /tmp/forge /root/bin/runner"
     " && ln -s /root/bin /opt/tool/bin"),
], ids=["program", "library", "folder-linked", "parent-linked", "bin-linked"])
def test_the_verifier_runs_the_images_tools_on_its_path_outside_usr(attack, runtime, make,
                                                                     venv_sif, tmp_path):
    """The hole found on a real Terminal-Bench task: the image's ENV PATH starts with a venv
    in /opt, test.sh runs its pytest, and an agent that replaces that pytest (or the
    library code it runs, or the venv by a link to its own copy) with a script writing
    reward 1 scored 1. The verifier gets the image's copy of every folder its PATH names
    outside /usr (here /opt/tool, whole), so the image's runner writes its 0.25; the
    agent's own files are still there for the agent, set aside where they were links."""
    sid = make(image=venv_sif)
    forge = write_file("/tmp/forge", FORGE_SH, "755")
    check = ("rm -f /logs/verifier/reward.txt; /opt/tool/bin/runner 2>/dev/null; "
             "cat /logs/verifier/reward.txt 2>/dev/null; ls -a / /opt")
    assert run(runtime, sid, f"{forge} && {attack} && {check}").output.startswith("1\n")
    result, reward = verify(runtime, sid, tmp_path, RUNNER_SH, env={"PATH": VENV_PATH})
    assert (result.exit_code, reward) == (0, "0.25"), result.output
    # the agent keeps its files; a link where the image has a folder on the way to a mount
    # point (/opt, /opt/tool) is renamed beside it, and its target is untouched
    after = run(runtime, sid, check + "; ls /root/tool/bin /root/opt/tool/bin").output.split()
    aside = [n.rsplit("-", 1)[0] for n in after if n.startswith(".tmax-set-aside-")]
    if attack.endswith(("/opt/tool", "/opt")):
        assert aside == [f".tmax-set-aside-{attack.rsplit('/', 1)[1]}"], after
        assert "runner" in after, after
    else:
        assert (after[0], aside) == ("1", []), after


@pytest.mark.sandbox
def test_the_verifier_view_never_follows_an_agents_link_on_the_host(runtime, make, venv_sif,
                                                                    tmp_path):
    """/opt replaced by a link to an absolute path that exists on the host, not inside:
    the host makes the mount points (/opt, /opt/tool) real directories of the agent's tree
    one component at a time, so it never creates or renames anything through that link
    (here: in a host folder, which stays empty)."""
    host = tmp_path / "host-side"
    host.mkdir()
    sid = make(image=venv_sif)
    run(runtime, sid, f"rm -rf /opt && ln -s {host} /opt")
    result, reward = verify(runtime, sid, tmp_path, RUNNER_SH, env={"PATH": VENV_PATH})
    assert list(host.iterdir()) == []
    assert (result.exit_code, reward) == (0, "0.25"), result.output


@pytest.mark.sandbox
def test_the_workdir_and_top_level_folders_on_the_verifiers_path_stay_the_agents(
        runtime, make, venv_sif, tmp_path):
    """A PATH entry in a top-level folder (/app/bin: /app) or the workdir's (/srv/work/bin:
    /srv/work) names the agent's work, not a tool: the verifier sees the agent's version,
    while /opt/tool/bin on the same PATH is still the image's; without a PATH in ``env``
    nothing beyond /usr is the image's (the default PATH is all in it)."""
    sid = make(image=venv_sif, workdir="/srv/work")
    tools = {"/app/bin/app-tool": "#!/bin/sh\necho agent-app\n",
             "/srv/work/bin/work-tool": "#!/bin/sh\necho agent-work\n",
             "/app/solve": "#!/bin/sh\necho agent-solve\n",
             "/tmp/forge": FORGE_SH}
    run(runtime, sid, " && ".join(write_file(p, t, "755") for p, t in tools.items())
        + " && cp /tmp/forge /opt/tool/bin/runner")
    test_sh = "pwd\napp-tool\nwork-tool\nsolve\n" + RUNNER_SH
    path = f"/app:/app/bin:/srv/work/bin:{VENV_PATH}"
    result, reward = verify(runtime, sid, tmp_path, test_sh, env={"PATH": path})
    assert result.output.split() == ["/srv/work", "agent-app", "agent-work", "agent-solve"], \
        result.output
    assert reward == "0.25", result.output
    # no PATH given: nothing is bound beyond the system folders
    result, reward = verify(runtime, sid, tmp_path, "/opt/tool/bin/runner\n", env={})
    assert reward == "1", result.output


@pytest.mark.sandbox
def test_agent_system_opt_in_keeps_the_agents_tools_on_its_path(runtime, make, venv_sif,
                                                                 tmp_path):
    sid = make(image=venv_sif)
    run(runtime, sid, write_file("/tmp/forge", FORGE_SH, "755")
        + " && cp /tmp/forge /opt/tool/bin/runner")
    env = {"PATH": VENV_PATH}
    assert verify(runtime, sid, tmp_path, RUNNER_SH, env=env)[1] == "0.25"
    assert verify(runtime, sid, tmp_path, RUNNER_SH, env=env, agent_system=True)[1] == "1"


def test_path_roots_pick_the_folders_of_tools_outside_the_system_and_the_work():
    from sandfleet.runtime.local import path_roots

    image_path = ("/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    assert path_roots(image_path) == ["/opt/venv"]
    path = ("/root/.local/bin:/root/.cargo/bin:/opt/conda/bin:/opt/conda/condabin:"
            "/opt/venv//bin/:/opt/venv/lib/x/bin:/usr/lib/jvm/bin:/app/bin:/app:/opt/bin:"
            "bin:./x:/opt/x/../y/bin::/tmp/a/bin:/logs/x/bin:/tests/x:/run/x/bin:"
            "/.tmax/verifier/bin:/srv/work/bin:/srv/proj/.venv/bin:/home/u/work/tools/bin")
    assert path_roots(path, keep=["/srv/work", "/home/u/work/tools/sub/"]) == [
        "/opt/conda", "/opt/venv", "/root/.cargo", "/root/.local", "/srv/proj/.venv"]
    assert path_roots(None) == path_roots("") == []


@pytest.mark.sandbox
def test_FINDING_a_symlinked_etc_gives_the_verifier_the_agents_interpreter_config(
        runtime, make, tmp_path):
    """FINDING (works against the sealed runtime): ``_verifier_view`` swaps in the image's
    /etc entries (ld.so.preload, alternatives, python3.11, ...) only when the agent's /etc is
    a directory. An agent that replaces /etc with a symlink to a copy gets its whole /etc into
    the verifier: ``cp -a /etc /etc2; <edit /etc2/python3.11/sitecustomize.py>; rm -rf /etc;
    ln -s /etc2 /etc``. Debian's /usr/lib/python3.11/sitecustomize.py links to
    /etc/python3.11/sitecustomize.py, so every python3 the verifier runs executes the agent's
    code: an atexit hook writing 1 turns the verifier's 0.5 into 1."""
    sid = make()
    attack = ("cp -a /etc /etc2 && " + write_file("/etc2/python3.11/sitecustomize.py", FORGE_PY)
              + " && echo /tmp/agent-preload.so > /etc2/ld.so.preload"
              + " && rm -rf /etc && ln -s /etc2 /etc && echo swapped")
    assert run(runtime, sid, attack).output.endswith("swapped\n")
    test_sh = "python3 -c 'open(\"/logs/verifier/reward.txt\", \"w\").write(\"0.5\")'\n"
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    # both are the agent's: its sitecustomize forged the reward, its preload list was read
    assert (reward, "ld.so.preload" in result.output) == ("0.5", False), result.output


@pytest.mark.sandbox
def test_FINDING_files_at_the_root_reach_the_verifier_as_symlinks(runtime, make, tmp_path):
    """FINDING (works against the sealed runtime): a regular file the agent puts at / (a
    /conftest.py, a /pytest.ini) is left out of the verifier's root, but a *symlink* at /
    is recreated there as is: ``ln -s /tmp/c.py /conftest.py`` shows the verifier a
    /conftest.py with the agent's code, which pytest (rootdir conftest discovery from /tests
    up to /) would import."""
    sid = make()
    run(runtime, sid, write_file("/tmp/c.py", FORGE_PY) + " && ln -s /tmp/c.py /conftest.py && "
                      + write_file("/pytest.ini", "[pytest]\n"))
    test_sh = ("echo 0 > /logs/verifier/reward.txt\n"
               "for f in /conftest.py /pytest.ini; do test -e $f && echo visible $f; done\n"
               "if test -e /conftest.py; then python3 /conftest.py; fi\n")  # as pytest would
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert "visible" not in result.output and reward == "0", (reward, result.output)


@pytest.mark.sandbox
def test_the_verifiers_tests_are_a_plain_folder_it_can_move_away_and_back(runtime, make,
                                                                         tmp_path):
    """A real task's test.sh hides /tests while it runs the agent's program (mv /tests
    /tmp/tests.hidden, then back), as it could in Docker: /tests is a folder on the
    verifier's own root, not a mount point (which refused the move, or let `mv` copy it
    into itself). The agent's /app and /tmp are the verifier's: what one writes the other
    reads. The agent's own /tests is not the verifier's, and never sees the tests."""
    sid = make(workdir="/app")
    run(runtime, sid, "mkdir -p /app /tests && echo agent > /app/answer && "
                      "echo planted > /tests/test_outputs.py")
    test_sh = textwrap.dedent("""\
        set -e
        mv /tests /tmp/tests.hidden
        test ! -e /tests
        cat /app/answer
        echo graded > /app/graded
        mv /tmp/tests.hidden /tests
        ls /tests
        stat -c %m /tests
        rm -rf /tests && test ! -e /tests
        echo 1 > /logs/verifier/reward.txt
        """)
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert (reward, result.output.split()) == ("1", ["agent", "test.sh", "/"]), result.output
    assert run(runtime, sid, "cat /app/graded /tests/test_outputs.py; ls -a /tmp").output \
        .split() == ["graded", "planted", ".", ".."]


@pytest.mark.sandbox
def test_a_service_the_agent_started_answers_the_verifier(runtime, make, tmp_path):
    """FINDING (fails on the sealed runtime): the agent's server is frozen while the
    verifier runs (see test_a_verifier_with_more_output_than_a_pipe_holds_is_not_timed_out),
    so the verifier's request times out and the reward is empty."""
    sid = make()
    server = textwrap.dedent("""\
        import http.server
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"0.75")
        http.server.HTTPServer(("127.0.0.1", 8765), H).serve_forever()
        """)
    start = (write_file("/tmp/srv.py", server) + " && (setsid python3 /tmp/srv.py "
             "</dev/null >/dev/null 2>&1 &) && for i in $(seq 100); do "
             "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8765))' "
             "2>/dev/null && break; sleep 0.1; done && rm /tmp/srv.py && echo up")
    assert run(runtime, sid, start).output.endswith("up\n")
    test_sh = ("echo 0 > /logs/verifier/reward.txt\n"
               "python3 -c 'import urllib.request as u; "
               "print(u.urlopen(\"http://127.0.0.1:8765/\", timeout=5).read().decode())' "
               "> /logs/verifier/reward.txt\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert reward == "0.75", result.output


@pytest.mark.sandbox
def test_a_verifier_with_more_output_than_a_pipe_holds_is_not_timed_out(runtime, make,
                                                                        tmp_path):
    """FINDING (fails on the sealed runtime, a bug rather than an attack): ``verify``'s
    ``on_start`` waits for the verifier's bwrap child to exec (its comm to change from
    "bwrap") before it thaws the agent and lets ``run_capture`` read the output. Without
    ``--as-pid-1`` that child is bwrap's own pid 1 and stays "bwrap", so the wait lasts
    until the verifier exits or ``start_timeout_s`` (60 s by default) passes. Meanwhile
    nobody reads its output: a verifier printing more than 64 KiB blocks, and comes back
    timed out (exit 124; the rollout records a verifier timeout, a fake 0) after
    ``start_timeout_s``, though it had written its reward; the agent stays frozen the whole
    time (which is why the service tests fail too)."""
    sid = make()
    test_sh = "seq 1 50000\necho 1 > /logs/verifier/reward.txt\n"  # ~290 KB of output
    result, reward = verify(runtime, sid, tmp_path, test_sh, timeout=10)
    assert (result.timed_out, result.exit_code, reward) == (False, 0, "1")
    assert result.output.startswith("1\n2\n") and result.output.endswith("\n50000\n")


# ---- 8. nothing outlives a sandbox


@pytest.fixture
def private_sif(tmp_path, base_sif) -> Path:
    """The base image under a path of this test's own, so its loop devices are findable."""
    path = tmp_path / "image.sif"
    shutil.copyfile(base_sif, path)  # a copy: mount reuses a loop device of the same inode
    return path


SLOT_BASE = 3 << 30
"""uid_base of the lifecycle tests' runtimes: ranges no default-configured runtime uses."""


def lifecycle_runtime(root: Path, owner: str = OWNER):
    from sandfleet.runtime.local import LocalRuntime

    return LocalRuntime(root / "state", root / "cache", owner=owner, uid_base=SLOT_BASE,
                        uid_slots=8, uid_lock_dir=root / "slots")


def leftovers(runtime, root: Path, sandbox_id: str, sif: Path, slot: int) -> list[str]:
    home = runtime._dir(sandbox_id)
    found = [f"loop device: {line}" for line in loop_lines(str(home), str(sif))]
    found += [f"mount: {line}" for line in host_read("/proc/self/mountinfo").splitlines()
              if str(root) in line]
    found += [f"cgroup {p}" for p in runtime.cgroups.paths(runtime._cgroup_name(sandbox_id))
              .values() if p.exists()]
    if home.exists():
        found.append(f"state dir {home}")
    if not slot_free(root / "slots", slot):
        found.append(f"uid slot {slot} still locked")
    return found


@pytest.mark.sandbox
def test_stop_leaves_no_loop_device_mount_cgroup_slot_or_state(tmp_path, private_sif):
    from sandfleet.runtime.base import SandboxSpec

    rt = lifecycle_runtime(tmp_path)
    rt.start("life", SandboxSpec(image=private_sif, storage_mb=64))
    try:
        record = rt._live("life")
        slot = (record.uid_base - SLOT_BASE) >> 16
        assert loop_lines(str(private_sif)) and loop_lines(str(rt._dir("life")))  # seen
        assert not slot_free(tmp_path / "slots", slot)
        assert run(rt, "life", "echo x > /tmp/x && cat /tmp/x").output == "x\n"
    finally:
        rt.stop("life")
    assert wait_until(lambda: not leftovers(rt, tmp_path, "life", private_sif, slot), 10,
                      "the sandbox's resources to go") is True
    assert rt.list_running() == []


@pytest.mark.sandbox
def test_a_sandbox_whose_owner_is_sigkilled_dies_at_max_lifetime_and_reap_clears_it(
        tmp_path, private_sif):
    script = (
        "import sys; from pathlib import Path\n"
        "from tests.test_seal import lifecycle_runtime\n"
        "from sandfleet.runtime.base import SandboxSpec\n"
        f"rt = lifecycle_runtime(Path({str(tmp_path)!r}), {OWNER!r})\n"
        f"rt.start('orphan', SandboxSpec(image=Path({str(private_sif)!r}), storage_mb=64,"
        " max_lifetime_s=3))\n"
        "r = rt._live('orphan'); print(r.init[0], r.init[1], r.uid_base, flush=True)\n"
        "import time; time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             text=True, cwd=REPO)
    try:
        started = time.monotonic()
        pid, start, uid_base = map(int, owner.stdout.readline().split())
    finally:
        owner.kill()  # SIGKILL: no cleanup of any kind on the Python side
        owner.wait()
    from sandfleet.runtime.base import proc_start_time

    rt = lifecycle_runtime(tmp_path)
    slot = (uid_base - SLOT_BASE) >> 16
    try:
        assert "orphan" in rt.list_running()
        assert run(rt, "orphan", "echo alive").output == "alive\n"
        wait_until(lambda: proc_start_time(pid) != start, 15, "max lifetime")
        # pid 1 counts in bash's whole SECONDS: a 3 s lifetime lasts more than 2 s
        assert time.monotonic() - started > 2.0
        # the tree is gone: its mounts and loop devices went with its mount namespace and
        # its uid range is free; only the state dir and cgroups wait for the reap
        wait_until(lambda: not loop_lines(str(rt._dir("orphan")), str(private_sif)), 10,
                   "the loop devices to detach")
        wait_until(lambda: slot_free(tmp_path / "slots", slot), 10, "the uid slot")
        assert rt.reap(keep=()) == ["orphan"]
        assert leftovers(rt, tmp_path, "orphan", private_sif, slot) == []
    finally:
        rt.reap(keep=())


# ---- 9. refusal


def test_host_problems_names_what_is_missing(tmp_path, monkeypatch):
    from sandfleet.runtime import local

    assert local.host_problems(local.Cgroups()) == []  # this machine has it all
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    problems = local.host_problems(local.Cgroups())
    assert len(problems) == 1 and "needs root" in problems[0], problems
    monkeypatch.undo()
    for ctrl in ("memory", "cpuset"):  # pids and freezer missing
        (tmp_path / ctrl).mkdir()
        (tmp_path / ctrl / "cgroup.procs").write_text("")
        if ctrl == "cpuset":
            for name in ("cpuset.cpus", "cpuset.mems"):
                (tmp_path / ctrl / name).write_text("0\n")
    problems = local.host_problems(local.Cgroups(root=tmp_path))
    required = "(memory, pids and freezer limits are required)"
    assert [p for p in problems if "cgroup" in p] == [
        f"no cgroup v1 pids hierarchy at {tmp_path / 'pids'} {required}",
        f"no cgroup v1 freezer hierarchy at {tmp_path / 'freezer'} {required}"]
    monkeypatch.setattr(local.shutil, "which", lambda name, path=None:
                        None if name == "bwrap" else f"/usr/bin/{name}")
    assert any("missing tools: bwrap" in p for p in local.host_problems(local.Cgroups()))


def test_the_local_runtime_refuses_to_start_without_its_guarantees(tmp_path, monkeypatch):
    from sandfleet.runtime import local

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(local.RuntimeUnavailable, match="needs root on the node"):
        local.LocalRuntime(tmp_path / "s", tmp_path / "c", owner=OWNER)
    monkeypatch.undo()
    empty = tmp_path / "no-cgroups"
    empty.mkdir()

    class NoCgroups(local.Cgroups):
        def __init__(self, parent: str = "sandfleet", root: Path = empty):
            super().__init__(parent, root=empty)

    monkeypatch.setattr(local, "Cgroups", NoCgroups)
    with pytest.raises(local.RuntimeUnavailable) as err:
        local.LocalRuntime(tmp_path / "s", tmp_path / "c", owner=OWNER)
    for ctrl in ("memory", "pids", "freezer"):
        assert f"no cgroup v1 {ctrl} hierarchy at {empty / ctrl}" in str(err.value)
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").rglob("*.json"))


# ---- 6 and 7. through the fleet and the rollout path


HELLO = EXAMPLES / "hello-world-file"
CSV = EXAMPLES / "csv-sales-aggregate"


def roll(task_dir: Path, commands: list[str], example_store, example_fleet, *,
         task_id: str | None = None):
    """One rollout of ``task_dir`` through the example fleet by a policy that runs
    ``commands`` and then submits; its trajectory."""
    from tmax.agent.config import load_agent_config
    from tmax.agent.policies.simple import ScriptedPolicy
    from tmax.fleet import open_fleet
    from tmax.rollout.run import TaskImages, rollout
    from tmax.tasks import load_task

    task = load_task(task_dir, task_id=task_id)

    async def go():
        async with open_fleet(example_fleet.state) as client:
            return await rollout(task, ScriptedPolicy(commands, name="attacker"), client,
                                 TaskImages(example_store.root), load_agent_config())

    return asyncio.run(go())


def outputs(traj) -> str:
    return "\n".join(str(m.get("content") or "") for m in traj.messages
                     if m.get("role") in ("tool", "user"))


def scored(traj) -> tuple:
    return (traj.reward, traj.infra_failure, traj.verifier_error, traj.end_reason)


def copy_task(src: Path, tmp_path: Path, *, test_sh: str, verifier: str = "") -> Path:
    """A copy of example task ``src`` (same folder name, so the same built image) with its
    own tests/test.sh and extra [verifier] keys."""
    dest = tmp_path / src.name
    shutil.copytree(src, dest)
    (dest / "tests" / "test.sh").write_text(test_sh)
    if verifier:
        toml = (dest / "task.toml").read_text()
        (dest / "task.toml").write_text(toml.replace("[verifier]\n", f"[verifier]\n{verifier}\n"))
    return dest


WATCHER = textwrap.dedent("""\
    while :; do
      for d in /proc/[0-9]*; do
        p=${d#/proc/}
        c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null) || continue
        case "$c" in
          *test.sh*|*check.py*)
            echo 1 > $d/root/logs/verifier/reward.txt
            kill -STOP $p ;;
        esac
      done
    done
    """)
ATTACKS = {
    # (a) pre-created, read-only and (where the kernel lets it) immutable
    "pre-created": (HELLO, [
        ("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
         "echo '{\"reward\": 1}' > /logs/verifier/reward.json && "
         "chattr +i /logs/verifier/reward.txt /logs/verifier/reward.json /logs/verifier; "
         "chmod -R a-w /logs; true")], 0.0),
    # (b) a background loop keeps writing it (atomically: a reader never sees it empty)
    "rewriting-loop": (HELLO, [
        write_file("/opt/loop.sh", "while :; do mkdir -p /logs/verifier; echo 1 > "
                   "/logs/verifier/.r && mv -f /logs/verifier/.r /logs/verifier/reward.txt; "
                   "done\n") + " && " + daemon("/opt/loop.sh")], 0.0),
    # (c) a read-only folder holding reward 1 bind-mounted over /logs/verifier
    "bind-mount": (HELLO, [
        ("mkdir -p /opt/fake /logs/verifier && echo 1 > /opt/fake/reward.txt && "
         "if mount --bind /opt/fake /logs/verifier && mount -o remount,ro,bind /logs/verifier;"
         " then echo BIND-MOUNTED; else echo BIND-REFUSED; fi")], 0.0),
    # (d) the verifier's interpreter replaced, over real work worth 0.4
    "python3-replaced": (CSV, [
        write_file("/app/summary.csv", CORRECT_CSV_ROWS),
        write_file("/opt/forge", FORGE_SH, "755") + " && for p in /usr/bin/python3 "
        "/usr/bin/python3.11 /usr/local/bin/python3; do rm -f $p; cp /opt/forge $p; done"],
        0.4),
    # (d) the verifier's shell replaced
    "bash-replaced": (HELLO, [
        write_file("/opt/forge", FORGE_SH, "755") + " && cp /opt/forge /usr/bin/bash.new && "
        "mv -f /usr/bin/bash.new /usr/bin/bash"], 0.0),
    # (e) a watcher that waits for test.sh/check.py to forge through /proc/PID/root and stop
    "proc-watcher": (HELLO, [write_file("/opt/watch.sh", WATCHER) + " && "
                             + daemon("/opt/watch.sh")], 0.0),
    # (f) the loader's preload list and python's site customisation (the image's, in /etc)
    "etc-preload-sitecustomize": (CSV, [
        write_file("/app/summary.csv", CORRECT_CSV_ROWS),
        "echo /opt/agent-preload.so > /etc/ld.so.preload && "
        + write_file("/etc/python3.11/sitecustomize.py", FORGE_PY) + " && "
        + write_file("/usr/lib/python3/dist-packages/zz-forge.pth",
                     "import atexit; atexit.register(lambda: open('/logs/verifier/reward.txt',"
                     " 'w').write('1'))\n")], 0.4),
}


@pytest.mark.sandbox
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_forged_reward_gives_the_verifiers_reward(attack, example_store, example_fleet):
    task_dir, commands, expected = ATTACKS[attack]
    traj = roll(task_dir, commands, example_store, example_fleet)
    assert scored(traj) == (expected, None, None, "submitted"), \
        (scored(traj), traj.verifier_output[-1500:], outputs(traj)[-1500:])
    if attack == "bind-mount":
        assert "BIND-REFUSED" in outputs(traj) and "BIND-MOUNTED" not in outputs(traj)
    assert "ld.so.preload" not in traj.verifier_output


@pytest.mark.sandbox
def test_FINDING_a_symlinked_etc_forges_the_reward_through_the_rollout(example_store,
                                                                       example_fleet):
    """FINDING (works against the sealed runtime; see
    test_FINDING_a_symlinked_etc_gives_the_verifier_the_agents_interpreter_config): on
    csv-sales-aggregate, 2 of 5 rows right (0.4) plus ``cp -a /etc /etc2``, a sitecustomize
    in /etc2/python3.11 with an atexit hook writing reward 1, ``rm -rf /etc; ln -s /etc2
    /etc`` scores 1.0."""
    commands = [write_file("/app/summary.csv", CORRECT_CSV_ROWS),
                "cp -a /etc /etc2 && " + write_file("/etc2/python3.11/sitecustomize.py",
                                                    FORGE_PY)
                + " && rm -rf /etc && ln -s /etc2 /etc && echo swapped"]
    traj = roll(CSV, commands, example_store, example_fleet)
    assert "swapped" in outputs(traj)
    assert scored(traj) == (0.4, None, None, "submitted"), traj.verifier_output[-1500:]


@pytest.mark.sandbox
@pytest.mark.parametrize("opt_in,reward", [(True, 1.0), (False, 0.0)],
                         ids=["agent_system", "image_system"])
def test_a_task_opting_in_to_agent_system_sees_the_agents_usr(opt_in, reward, tmp_path,
                                                               example_store, example_fleet):
    test_sh = ("#!/bin/bash\nmkdir -p /logs/verifier\necho 0 > /logs/verifier/reward.txt\n"
               "agent-tool > /tmp/r && mv /tmp/r /logs/verifier/reward.txt\n")
    task = copy_task(HELLO, tmp_path, test_sh=test_sh,
                     verifier="agent_system = true" if opt_in else "")
    traj = roll(task, [write_file("/usr/local/bin/agent-tool", "#!/bin/sh\necho 1\n", "755")],
                example_store, example_fleet)
    assert scored(traj) == (reward, None, None, "submitted"), traj.verifier_output


@pytest.mark.sandbox
def test_a_service_started_by_the_agent_is_graded_by_querying_it(tmp_path, example_store,
                                                                  example_fleet):
    """The agent starts ``python3 -m http.server`` on localhost (the task has no network: the
    sandbox's own network namespace, which the verifier shares) and the verifier grades
    what it serves over HTTP.

    FINDING (fails on the sealed runtime): the server is frozen for the whole verification
    (see test_a_verifier_with_more_output_than_a_pipe_holds_is_not_timed_out): the request
    times out and the task scores 0."""
    test_sh = textwrap.dedent("""\
        #!/bin/bash
        mkdir -p /logs/verifier
        echo 0 > /logs/verifier/reward.txt
        python3 - <<'EOF' > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
        import urllib.request
        url = "http://127.0.0.1:8766/answer.txt"
        print(urllib.request.urlopen(url, timeout=5).read().decode().strip())
        EOF
        """)
    task = copy_task(HELLO, tmp_path, test_sh=test_sh)
    start = ("mkdir -p /srv/www && echo 1 > /srv/www/answer.txt && cd /srv/www && "
             "(setsid python3 -m http.server 8766 --bind 127.0.0.1 </dev/null >/dev/null 2>&1 &)"
             " && for i in $(seq 100); do python3 -c 'import urllib.request as u; "
             "u.urlopen(\"http://127.0.0.1:8766/\")' 2>/dev/null && break; sleep 0.1; done"
             " && echo up")
    traj = roll(task, [start], example_store, example_fleet)
    assert "up" in outputs(traj)
    assert scored(traj) == (1.0, None, None, "submitted"), traj.verifier_output


@pytest.mark.sandbox
def test_FINDING_filling_dev_shm_ends_the_episode_as_an_infra_failure(example_store,
                                                                      example_fleet):
    """FINDING (works against the sealed runtime; see
    test_FINDING_filling_dev_shm_kills_the_sandbox): an agent that cannot solve the task
    submits with ``echo TMAX_TASK_COMPLETE; dd if=/dev/zero of=/dev/shm/fill bs=1M``. The
    harness sees the submit marker, the verifier finds the sandbox dead, and the episode is
    recorded as an infrastructure failure (masked in training; re-run, and left unscored
    when it keeps happening, in evaluation) instead of the 0 the agent earned."""
    from tmax.agent.config import SUBMIT_MARKER

    commands = [f"echo {SUBMIT_MARKER}; dd if=/dev/zero of=/dev/shm/fill bs=1M status=none"]
    traj = roll(HELLO, commands, example_store, example_fleet)
    assert traj.infra_failure is None, traj.infra_failure
    assert (traj.reward, traj.end_reason) == (0.0, "submitted")


@pytest.mark.sandbox
def test_FINDING_a_full_disk_ends_the_episode_as_an_infra_failure(tmp_path, example_store,
                                                                  example_fleet):
    """FINDING (works against the sealed runtime): the verifier's folders are made on the
    sandbox's own disk (``verify``: ``there.mkdir()`` under ``<home>/disk``). An agent that
    fills its ``storage_mb`` (blocks with dd, then inodes with empty files) before it
    submits makes ``verify`` raise OSError ENOSPC on the host: the episode is recorded as an
    infrastructure failure instead of the reward its work earns (here 0). Expected: room
    for the verifier that the agent cannot take (or a verifier error, scored 0)."""
    task = copy_task(HELLO, tmp_path, test_sh=(HELLO / "tests" / "test.sh").read_text())
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml.replace("[environment]\n",
                                                 "[environment]\nstorage_mb = 64\n"))
    fill = ("dd if=/dev/zero of=/fill bs=1M status=none; python3 -c '\n"
            "i = 0\n"
            "while True:\n"
            "    try:\n"
            "        open(f\"/i{i}\", \"w\").close(); i += 1\n"
            "    except OSError as e:\n"
            "        print(\"files\", i, e.strerror); break\n'")
    traj = roll(task, [fill], example_store, example_fleet)
    assert "No space left on device" in outputs(traj)
    assert scored(traj) == (0.0, None, None, "submitted"), \
        (scored(traj), traj.verifier_output[-500:])


@pytest.mark.sandbox
def test_FINDING_many_names_at_the_root_end_the_episode_as_an_infra_failure(example_store,
                                                                           example_fleet):
    """FINDING (works against the sealed runtime): ``_verifier_view`` binds every top-level
    entry of the agent's root (and every entry of its /etc) one by one on bwrap's command
    line. 6000 folders with 200-character names at / make that command line longer than
    the kernel takes: ``verify`` raises OSError E2BIG ("Argument list too long: 'sh'") and
    the episode is recorded as an infrastructure failure instead of its 0. Expected: a
    command line that does not grow with the agent's files (bind the agent's root once and
    mount the image's parts over it, or pass the mounts through a file)."""
    make = ("python3 -c 'import os\n"
            "for i in range(6000): os.mkdir(\"/\" + \"x\" * 200 + str(i))' && ls / | wc -l")
    traj = roll(HELLO, [make], example_store, example_fleet)
    assert scored(traj) == (0.0, None, None, "submitted"), \
        (scored(traj), traj.verifier_output[-500:])


def test_trusted_first_puts_the_agents_path_folders_behind_the_images():
    from sandfleet.runtime.local import trusted_first

    path = "/go/bin:/usr/local/go/bin:/app:/opt/venv/bin:/usr/bin:/bin:rel:/opt/venv/../x/bin"
    assert trusted_first(path, ["/usr", "/bin", "/opt/venv", "/tests"]) == (
        "/usr/local/go/bin:/opt/venv/bin:/usr/bin:/bin:/go/bin:/app:rel:/opt/venv/../x/bin")
    assert trusted_first("/a:/b", []) == "/a:/b"


@pytest.mark.sandbox
def test_a_program_the_agent_plants_first_on_the_verifiers_path_does_not_shadow_the_images(
        runtime, make, venv_sif, tmp_path):
    """A top-level folder first on the image's PATH (the golang images' /go/bin) or one the
    image has not (/root/.local/bin before anything is installed there) is the agent's; a
    `runner` it plants there would run instead of the image's /opt/tool/bin/runner. The
    verifier's PATH puts the agent's folders behind the image's, so the image's runs, and
    a tool only the agent has (agent-only) is still found."""
    sid = make(image=venv_sif)
    run(runtime, sid, write_file("/tmp/forge", FORGE_SH, "755")
        + " && mkdir -p /go/bin /root/.local/bin && cp /tmp/forge /go/bin/runner"
        + " && cp /tmp/forge /root/.local/bin/runner && "
        + write_file("/go/bin/agent-only", "#!/bin/sh\necho agent-only\n", "755"))
    test_sh = "agent-only\n" + RUNNER_SH
    env = {"PATH": f"/go/bin:/root/.local/bin:{VENV_PATH}"}
    result, reward = verify(runtime, sid, tmp_path, test_sh, env=env)
    assert (reward, result.output.split()[:1]) == ("0.25", ["agent-only"]), result.output
    assert verify(runtime, sid, tmp_path, test_sh, env=env, agent_system=True)[1] == "1"


@pytest.mark.sandbox
def test_the_verifier_writes_into_the_images_path_folders_on_a_layer_of_its_own(
        runtime, make, venv_sif, tmp_path):
    """The image's copy of a PATH folder is writable for the verifier (a `pip install` into
    the venv, cargo's lock in ~/.cargo), on a layer that goes with it: the agent's tree and
    the image keep what they had, and the agent's replacement stays out."""
    sid = make(image=venv_sif)
    run(runtime, sid, write_file("/tmp/forge", FORGE_SH, "755")
        + " && cp /tmp/forge /opt/tool/bin/runner")
    test_sh = ("echo verifier > /opt/tool/lib/added && cat /opt/tool/lib/added && "
               "echo 'echo 0.5 > /logs/verifier/reward.txt' > /opt/tool/lib/grade.sh && runner\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh, env={"PATH": VENV_PATH})
    assert (result.exit_code, reward, result.output.split()[:1]) == (0, "0.5", ["verifier"]), \
        result.output
    after = run(runtime, sid, "ls /opt/tool/lib; cat /opt/tool/bin/runner").output
    assert "added" not in after and "echo 1" in after, after  # (FORGE_SH: the agent's)
    result, reward = verify(runtime, sid, tmp_path, RUNNER_SH, env={"PATH": VENV_PATH})
    assert reward == "0.25", result.output  # a fresh layer: the image's grade.sh again


@pytest.mark.sandbox
def test_localhost_and_the_sandboxs_name_resolve_for_the_agent_and_the_verifier(
        runtime, make, tmp_path):
    """A debootstrapped image's /etc/hosts is empty, and `localhost` then resolves nowhere
    (a real Harbor task's tests failed on it); the sandbox gets Docker's lines in its own
    layer, which the agent may change as in a container."""
    sid = make()
    v4 = "python3 -c 'import socket; print(socket.gethostbyname(\"localhost\"))'"
    out = run(runtime, sid, f"{v4}; getent hosts \"$(hostname)\" | cut -d' ' -f1; "
                            "ls -l /etc/hosts | cut -d' ' -f3").output.split()
    assert out == ["127.0.0.1", "127.0.1.1", "root"], out
    result, reward = verify(runtime, sid, tmp_path, f"{v4} > /logs/verifier/reward.txt\n")
    assert reward.strip() == "127.0.0.1", result.output


def test_an_images_own_hosts_file_is_kept_and_a_link_is_not_followed(tmp_path):
    from sandfleet.runtime.helper import localhost

    lower, upper = tmp_path / "lower", tmp_path / "upper"
    (lower / "etc").mkdir(parents=True)
    upper.mkdir()
    (lower / "etc" / "hosts").write_text("127.0.0.1 localhost\n10.0.0.9 db\n")
    localhost(str(lower), str(upper), os.getuid(), "box")
    assert not (upper / "etc").exists()  # the image's names localhost: kept as it is
    (lower / "etc" / "hosts").write_text("10.0.0.9 db\n")
    localhost(str(lower), str(upper), os.getuid(), "box")
    assert (upper / "etc" / "hosts").read_text() == (
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tbox\n"
        "10.0.0.9 db\n")
    secret = tmp_path / "host-secret"
    secret.write_text("127.0.0.1 not-for-the-sandbox\n")
    (lower / "etc" / "hosts").unlink()
    (lower / "etc" / "hosts").symlink_to(secret)
    (upper / "etc" / "hosts").unlink()
    (upper / "etc").rmdir()
    localhost(str(lower), str(upper), os.getuid(), "box")
    assert "not-for-the-sandbox" not in (upper / "etc" / "hosts").read_text()


def test_a_networked_sandbox_gets_the_nodes_resolver_where_the_image_has_none(tmp_path):
    from sandfleet.runtime.helper import resolver

    lower, upper, host = tmp_path / "lower", tmp_path / "upper", tmp_path / "resolv.conf"
    (lower / "etc").mkdir(parents=True)
    upper.mkdir()
    host.write_text("nameserver 10.1.2.3\n")
    (lower / "etc" / "resolv.conf").write_text("nameserver 9.9.9.9\n")
    resolver(str(lower), str(upper), os.getuid(), str(host))
    assert not (upper / "etc").exists()  # the image's own: kept
    (lower / "etc" / "resolv.conf").write_text("")
    resolver(str(lower), str(upper), os.getuid(), str(host))
    assert (upper / "etc" / "resolv.conf").read_text() == "nameserver 10.1.2.3\n"
