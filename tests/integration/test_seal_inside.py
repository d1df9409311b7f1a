"""The sandbox attacked from inside by the agent's root, on the local and the apptainer
runtime (issues 11 and 32).

Every test runs real sandboxes and tries what an agent (or an RL policy looking for reward)
would: host kernel settings, capabilities, mounts and nested namespaces, raising its own
limits, filling the node's disk or /dev/shm, reaching another sandbox. Each asserts what a
broken seal gets wrong: on the old local runtime (commit 2dfe18e: uid 0 inside was host
uid 0 with a full capability set, no disk quota) every one of them failed. An attack the
apptainer runtime (as root, as CI runs it) does not stop is a strict expected failure there,
naming the guarantee it lacks (tests/seal_helpers.py; the guarantee table of
docs/sandbox.md, "The apptainer runtime"). The local runtime's own mechanics (loop devices,
uid slots, cgroups, refusals) are in tests/integration/test_seal_local.py.

Nothing here changes a host value: kernel settings are written with the value already there,
/proc/sysrq-trigger is only opened, never written, and cgroup files are written only in the
sandbox's own cgroup.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.seal_helpers import (  # noqa: F401  (fixtures)
    FORBIDDEN_CAPS,
    HOST_CGROUPS,
    HOST_SYSCTLS,
    NO_USERS,
    ROOT_IS_HOST_ROOT,
    TMPFS_KILLS,
    cap_sets,
    daemon,
    host_read,
    kind,
    on_both_runtimes,
    run,
    sealed_make,
    sealed_runtime,
    uid_maps,
    write_file,
)

pytestmark = pytest.mark.sandbox


# ---- 1. host kernel settings


@on_both_runtimes(apptainer_lacks=HOST_SYSCTLS)
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


@on_both_runtimes(apptainer_lacks=ROOT_IS_HOST_ROOT)
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


@on_both_runtimes(apptainer_lacks=ROOT_IS_HOST_ROOT)
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
    allowed = []
    for name, command in attempts.items():
        result = run(runtime, sid, f"{command} && echo ALLOWED")
        if result.exit_code == 0 or "ALLOWED" in result.output:
            allowed.append(name)
    assert allowed == [], f"allowed inside: {allowed}"
    assert run(runtime, sid, "ls -A /sys 2>/dev/null | wc -l").output.strip() == "0"
    for path in ("/proc/sys/kernel/printk_ratelimit", "/proc/sys/vm/drop_caches"):
        assert run(runtime, sid, f"test -w {path} && echo W").output == "", path


@on_both_runtimes(apptainer_lacks=NO_USERS)
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


def memory_limit_file(runtime, sid) -> Path:
    """The host's file holding the sandbox's memory limit (cgroup v1)."""
    if kind(runtime) == "local":
        return next(Path(p) for p in runtime._live(sid).cgroups
                    if Path(p).parent == runtime.cgroups.parents["memory"]) \
            / "memory.limit_in_bytes"
    pid = runtime._live(sid).instance[0]
    path = next(line.split(":", 2)[2] for line in host_read(f"/proc/{pid}/cgroup").splitlines()
                if "memory" in line.split(":")[1].split(","))
    return Path(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")


# its own cgroup's files, wherever a cgroup hierarchy is (mounted by it, or there already)
RAISE_IT = ("mkdir -p /tmp/cgm /tmp/cgp;"
            "mount -t cgroup -o memory none /tmp/cgm && echo 4294967296 > "
            "/tmp/cgm/memory.limit_in_bytes; mount -t cgroup -o pids none /tmp/cgp && "
            "echo max > /tmp/cgp/pids.max;"
            "m=$(sed -n 's/^[0-9]*:memory:\\(.*\\)/\\1/p' /proc/self/cgroup);"
            "p=$(sed -n 's/^[0-9]*:pids:\\(.*\\)/\\1/p' /proc/self/cgroup);"
            "echo 4294967296 > /sys/fs/cgroup/memory$m/memory.limit_in_bytes;"
            "echo max > /sys/fs/cgroup/pids$p/pids.max; true")


@on_both_runtimes(apptainer_lacks=HOST_CGROUPS)
def test_the_memory_limit_holds_and_cannot_be_raised_from_inside(runtime, make):
    if kind(runtime) == "local" and "memory" not in runtime.cgroups.parents:
        pytest.fail("no memory cgroup: the runtime should have refused to start")
    sid = make(memory_mb=200)
    memory = memory_limit_file(runtime, sid)
    limit = memory.read_text()
    assert int(limit) == 200 << 20
    if kind(runtime) == "local":
        pids = next(Path(p) for p in runtime._live(sid).cgroups
                    if Path(p).parent == runtime.cgroups.parents["pids"]) / "pids.max"
        pids_max = pids.read_text()
    run(runtime, sid, RAISE_IT)
    result = run(runtime, sid, ["python3", "-c",
                                "b = bytearray(400 << 20); print('survived', len(b))"])
    assert memory.read_text() == limit
    assert result.oom and result.exit_code == 137 and "survived" not in result.output
    if kind(runtime) == "local":
        assert pids.read_text() == pids_max
    assert run(runtime, sid, "echo still-up").output == "still-up\n"


@on_both_runtimes(apptainer_lacks=HOST_CGROUPS)
def test_a_sandbox_cannot_write_the_cgroups_of_another(runtime, make):
    """Sandbox b looks for cgroup files it may write outside its own cgroups (another
    sandbox's limits and process lists, their common parent's): none. Nothing is written."""
    make()
    b = make()
    find = ("own=$(cut -d: -f3 /proc/self/cgroup | sort -u);"
            "find /sys/fs/cgroup -name cgroup.procs -writable 2>/dev/null | while read f; do"
            "  d=${f%/cgroup.procs}; d=/${d#/sys/fs/cgroup/*/}; mine=;"
            "  for o in $own; do [ \"$d\" = \"$o\" ] && mine=1; done;"
            "  [ -z \"$mine\" ] && echo $f; done; true")
    assert run(runtime, b, find).output == ""


# ---- 4. disk quota


@on_both_runtimes()
def test_writes_past_storage_mb_fail_inside_and_the_node_disk_is_untouched(runtime, make):
    a, b = make(storage_mb=64), make(storage_mb=64)
    assert int(run(runtime, a, "df -k --output=size / | tail -1").output) < 70 * 1024
    free = os.statvfs(runtime.state_dir)
    before = free.f_bavail * free.f_frsize
    result = run(runtime, a, "dd if=/dev/zero of=/var/fill bs=1M count=1024 status=none; "
                             "echo rc=$?")
    assert "No space left on device" in result.output and "rc=0" not in result.output
    free = os.statvfs(runtime.state_dir)
    dropped = before - free.f_bavail * free.f_frsize
    assert dropped < 512 << 20, f"the node lost {dropped >> 20} MiB for 1024 attempted"
    # the other sandbox has its own quota
    other = run(runtime, b, "dd if=/dev/zero of=/var/f bs=1M count=32 status=none && "
                            "stat -c %s /var/f")
    assert other.exit_code == 0 and other.output == f"{32 << 20}\n", other.output


@on_both_runtimes(apptainer_lacks=TMPFS_KILLS)
def test_filling_dev_shm_or_tmp_does_not_kill_the_sandbox(runtime, make):
    """/dev/shm (and, on Apptainer before ``--no-mount tmp``, /tmp) is a tmpfs outside the
    ``storage_mb`` quota; only the memory limit bounds it, and its pages cannot be reclaimed. Filling it once
    killed pid 1 of a local sandbox (the OOM killer went on after dd) and the episode
    ended as an infrastructure failure. Expected: the writes fail (ENOSPC) or
    are killed, and the sandbox goes on."""
    sid = make(memory_mb=200, storage_mb=256)
    for folder in ("/dev/shm", "/tmp"):
        fill = run(runtime, sid, f"dd if=/dev/zero of={folder}/fill bs=1M count=400 "
                                 "status=none")
        assert fill.exit_code != 0, folder
        time.sleep(1)
        after = run(runtime, sid, f"rm -f {folder}/fill; echo still-up")
        assert (after.exit_code, after.output) == (0, "still-up\n"), (folder, after.output)


# ---- 5. two sandboxes


@on_both_runtimes(apptainer_lacks=ROOT_IS_HOST_ROOT)
def test_two_sandboxes_have_disjoint_uid_ranges(runtime, make):
    a, b = make(), make()
    maps = [uid_maps(run(runtime, s, "cat /proc/self/uid_map").output)[0] for s in (a, b)]
    assert maps[0] != maps[1]
    (_, base_a, count_a), (_, base_b, count_b) = maps
    assert base_a + count_a <= base_b or base_b + count_b <= base_a, maps


@on_both_runtimes()
def test_two_sandboxes_cannot_see_or_signal_each_other(runtime, make):
    a, b = make(), make()
    run(runtime, a, "echo secret-a > /root/secret-a; "
                    + write_file("/var/tmp/a-loop.sh", "exec -a a-marker-proc sleep 300\n")
                    + "; " + daemon("/var/tmp/a-loop.sh"))
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
