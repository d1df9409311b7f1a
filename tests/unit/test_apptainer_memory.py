"""sandfleet.runtime.apptainer_memory: the accounting from a fake /proc tree (hand-computed
sums), the cgroup v2 delegation check on a fake /sys/fs/cgroup (this machine is cgroup v1:
the real rootless ``--memory`` cannot run here), and RLIMIT_DATA and the kills on real
processes in a pid namespace of their own. The watcher against a real rootless Apptainer:
tests/integration/test_apptainer_real.py (``test_memory_limit_of_an_ordinary_users_instance``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandfleet.runtime.apptainer_memory import (
    DATA_FLOOR_MB,
    MemoryWatcher,
    cgroup_v2_delegated,
    data_rlimit_argv,
    group_by_sandbox,
    own_processes,
    pss_bytes,
    rss_bytes,
    user_ids,
)

# fake pids above this machine's pid_max (32768) and Linux's (4194304): never a real process,
# so a kill the watcher sends to one fails (pidfd_open) instead of reaching anything
BASE = 5_000_000
SUBUID = 700_000
UIDS = [(os.getuid(), 1), (SUBUID, 65536)]


def fake_proc(root: Path, pid: int, *, ns: int, ppid: int, pss_kb: int, uid: int | None = None,
              flags: int = 0x400100) -> None:
    d = root / str(pid)
    (d / "ns").mkdir(parents=True)
    os.symlink(f"pid:[{ns}]", d / "ns" / "pid")
    (d / "stat").write_text(f"{pid} (a (b) c) S {ppid} {pid} {pid} 0 -1 {flags} 1 0 0 0\n")
    (d / "smaps_rollup").write_text(
        "00400000-7ffd0000 ---p 00000000 00:00 0    [rollup]\n"
        f"Rss:  {pss_kb * 3} kB\nPss:  {pss_kb} kB\nPss_Anon:  {pss_kb // 2} kB\n"
        f"Pss_File:  {pss_kb - pss_kb // 2} kB\nShared_Clean:  12 kB\n")
    pages = pss_kb * 3 * 1024 // os.sysconf("SC_PAGE_SIZE")
    (d / "statm").write_text(f"{pages * 4} {pages} {pages // 2} 100 0 {pages} 0\n")
    if uid is not None:
        os.chown(d, uid, -1)


@pytest.fixture
def proc(tmp_path) -> Path:
    """Two sandboxes (pid namespaces 100 and 101) and the host's (1):

    - 10: sandbox A's pid 1 (1000 kB); 11: a command run through ``exec instance://``, in
      A's namespace but the child of 5, apptainer's host-side process (2000 kB); 12: in a
      namespace A's agent nested (200), child of 11 (3000 kB); 13: its child (500 kB);
      14: an orphan of 200 whose parent is gone (ppid 0 as seen here: not counted, it has
      no way to be tied to A but its namespace, which is not A's)
    - 20: sandbox B's pid 1 (400 kB)
    - 5: the host side of the exec (99999 kB), 6: the worker (50000 kB): not a sandbox's
    - 30: in A's namespace but another user's (no such process can be; ignored)
    - 31: in A's namespace, as a uid of the worker's /etc/subuid range (``--fakeroot``
      maps it where the node has one: a process inside switched users), 250 kB: counted
    - 15: in A's namespace, killed and freeing its 400000 kB (PF_EXITING): not counted
    - 16: in A's namespace, its leader thread exited (PF_EXITING, no memory of its own)
      while its thread 17 runs on, holding 900 kB: counted, from the thread's files
    """
    root = tmp_path / "proc"
    for pid, ns, ppid, kb in [(10, 100, 1, 1000), (11, 100, 5, 2000), (12, 200, 11, 3000),
                              (13, 200, 12, 500), (14, 200, 0, 700), (20, 101, 1, 400),
                              (5, 1, 6, 99999), (6, 1, 1, 50000)]:
        fake_proc(root, BASE + pid, ns=ns, ppid=BASE + ppid if ppid else 0, pss_kb=kb)
    fake_proc(root, BASE + 30, ns=100, ppid=BASE + 10, pss_kb=8000, uid=12345)
    fake_proc(root, BASE + 31, ns=100, ppid=BASE + 10, pss_kb=250, uid=SUBUID + 999)
    fake_proc(root, BASE + 15, ns=100, ppid=BASE + 10, pss_kb=400000, flags=0x400104)
    fake_proc(root, BASE + 16, ns=100, ppid=BASE + 10, pss_kb=0, flags=0x400104)
    fake_proc(root / str(BASE + 16) / "task", BASE + 16, ns=100, ppid=BASE + 10, pss_kb=0,
              flags=0x400104)
    fake_proc(root / str(BASE + 16) / "task", BASE + 17, ns=100, ppid=BASE + 10, pss_kb=900)
    (root / "self").mkdir()
    (root / "loadavg").write_text("0.00\n")
    return root


def test_user_ids_from_subuid(tmp_path):
    subuid = tmp_path / "subuid"
    subuid.write_text(f"other:200000:65536\n{os.getuid()}:{SUBUID}:65536\nbad line\n")
    assert user_ids(os.getuid(), str(subuid)) == [(os.getuid(), 1), (SUBUID, 65536)]
    assert user_ids(os.getuid(), str(tmp_path / "none")) == [(os.getuid(), 1)]


def watcher_of(proc: Path) -> MemoryWatcher:
    watcher = MemoryWatcher(proc=str(proc))
    watcher.uids = UIDS
    return watcher


def test_processes_are_grouped_by_namespace_and_parent_chain(proc):
    procs = own_processes(str(proc), UIDS)
    assert BASE + 30 not in procs and set(procs) == {
        BASE + p for p in (10, 11, 12, 13, 14, 15, 16, 20, 5, 6, 31)}
    assert procs[BASE + 12] == ("pid:[200]", BASE + 11, False, str(BASE + 12))
    assert procs[BASE + 15] == ("pid:[100]", BASE + 10, True, str(BASE + 15))
    assert procs[BASE + 16] == ("pid:[100]", BASE + 10, False, f"{BASE + 16}/task/{BASE + 17}")
    groups = group_by_sandbox(procs, {"pid:[100]": "A", "pid:[101]": "B"})
    assert sorted(groups["A"]) == [BASE + p for p in (10, 11, 12, 13, 16, 31)]
    assert groups["B"] == [BASE + 20]


def test_pss_and_rss_read(proc):
    assert pss_bytes(str(proc), BASE + 11) == 2000 * 1024
    assert rss_bytes(str(proc), BASE + 11) == 3 * 2000 * 1024
    assert pss_bytes(str(proc), BASE + 99) == 0 == rss_bytes(str(proc), BASE + 99)  # gone


def test_usage_sums_pss_per_sandbox(proc):
    watcher = watcher_of(proc)
    watcher.watch("A", BASE + 10, memory_mb=16)
    watcher.watch("B", BASE + 20, memory_mb=16)
    try:
        usage = watcher.usage()
        # A's RSS (3 x 7650 kB = 22950 kB) is past 16 MiB, so its PSS is summed:
        # 1000 + 2000 + 3000 + 500 + 900 + 250 kB; B's RSS (1200 kB) is under: its figure
        assert {sid: used for sid, (used, _) in usage.items()} == {
            "A": 7650 * 1024, "B": 1200 * 1024}
        assert watcher.poll() == [] and watcher.kills("A") == 0 and watcher.kills("B") == 0
    finally:
        watcher.close()


def test_over_the_limit_counts_one_kill_and_only_that_sandbox(proc):
    watcher = watcher_of(proc)
    watcher.watch("A", BASE + 10, memory_mb=7)  # 7168 kB < 7650 kB
    watcher.watch("B", BASE + 20, memory_mb=16)
    try:
        assert watcher.poll() == ["A"]
        assert (watcher.kills("A"), watcher.kills("B")) == (1, 0)
        assert watcher.peaks["A"] == 7650 * 1024
        watcher.forget("A")  # a verify restarts the instance: its count stays
        assert watcher.kills("A") == 1 and watcher.poll() == []
        watcher.drop("A")
        assert watcher.kills("A") is None
    finally:
        watcher.close()


def test_watch_refuses_a_gone_instance(proc):
    with pytest.raises(ProcessLookupError, match="instance pid .* of A is gone"):
        watcher_of(proc).watch("A", BASE + 77, memory_mb=64)


# ---- cgroup v2 delegation (fake trees; this machine has cgroup v1)


def cgroup_tree(tmp_path: Path, *, v2=True, service=True, controllers="cpuset cpu io memory "
                "pids", owner: int | None = None) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    if v2:
        (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma\n")
    if service:
        svc = root / "user.slice" / "user-1000.slice" / "user@1000.service"
        svc.mkdir(parents=True)
        (svc / "cgroup.controllers").write_text(controllers + "\n")
        os.chown(svc, 1000 if owner is None else owner, -1)
    return root


SESSION = {"XDG_RUNTIME_DIR": "/run/user/1000",
           "DBUS_SESSION_BUS_ADDRESS": "unix:path=/run/user/1000/bus"}


def test_cgroup_v2_delegation_detected(tmp_path):
    assert cgroup_v2_delegated(cgroup_tree(tmp_path), 1000, SESSION) is None


@pytest.mark.parametrize("tree, env, why", [
    ({"v2": False}, SESSION, "is not cgroup v2"),
    ({"service": False}, SESSION, "no systemd user session delegating cgroups"),
    ({"owner": 0}, SESSION, "is not this user's"),
    ({"controllers": "cpuset io pids"}, SESSION, "no memory or cpu controller delegated"),
    ({"controllers": "memory pids"}, SESSION, "no cpu controller delegated"),
    ({}, {}, "no user session bus"),
])
def test_cgroup_v2_delegation_refused_says_why(tmp_path, tree, env, why):
    got = cgroup_v2_delegated(cgroup_tree(tmp_path, **tree), 1000, env)
    assert got is not None and why in got, got


def test_doctor_says_memory_is_polled_and_why_not_through_cgroups():
    from sandfleet.runtime.apptainer_setup import unenforced_limits

    assert unenforced_limits(True) == []
    memory, cpus = unenforced_limits(False, "/sys/fs/cgroup is not cgroup v2")
    assert memory.startswith("memory_mb through cgroups: polled instead (every 0.25 s")
    assert "RLIMIT_DATA at 2x memory_mb" in memory and "not counted" in memory
    assert memory.endswith("Apptainer's own --memory is not used: /sys/fs/cgroup is not "
                           "cgroup v2")
    assert cpus.startswith("cpus: pinned with taskset")


# ---- real processes


def test_rlimit_data_fails_one_big_allocation_and_passes_a_small_one():
    floor = DATA_FLOOR_MB << 20
    assert data_rlimit_argv(16) == ["prlimit", f"--data={floor}:{floor}", "--"]
    assert data_rlimit_argv(1024) == ["prlimit", f"--data={2 << 30}:{2 << 30}", "--"]
    big = subprocess.run([*data_rlimit_argv(150), sys.executable, "-c",
                          "bytearray(400 << 20)"], capture_output=True, text=True, timeout=60)
    assert big.returncode == 1 and "MemoryError" in big.stderr, big.stderr
    small = subprocess.run([*data_rlimit_argv(150), sys.executable, "-c",
                            "print(len(bytearray(250 << 20)))"], capture_output=True, text=True,
                           timeout=60)
    assert small.stdout == f"{250 << 20}\n", small.stderr
    # the agent cannot raise its hard limit (that needs CAP_SYS_RESOURCE of the host's userns)
    raise_ = subprocess.run([*data_rlimit_argv(300), "unshare", "--user", "--map-root-user",
                             "prlimit", "--pid", "0", f"--data={1 << 40}:{1 << 40}"],
                            capture_output=True, text=True, timeout=60)
    assert raise_.returncode != 0, raise_


def ns_init(holder: subprocess.Popen) -> int:
    """The pid 1 of the pid namespace ``unshare --fork`` (``holder``) made."""
    for _ in range(500):
        children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError("unshare started no child")


def test_a_namespace_over_its_limit_loses_every_process_but_its_pid_1(tmp_path):
    """A pid namespace (``unshare --user --pid``, as any user can) standing in for an
    instance: its pid 1 a sleep, a sleeping job, and pythons holding 60 MiB each (under a
    limit of 100 MiB alone, over it together); one more in a namespace nested inside."""
    hold = "import time; b = bytearray(60 << 20); open(%r, 'a').write('x'); time.sleep(300)"
    ready = tmp_path / "ready"
    script = (f"sleep 300 & {sys.executable} -c \"{hold % str(ready)}\" & "
              f"unshare --pid --fork {sys.executable} -c \"{hold % str(ready)}\" & "
              "exec sleep 301")  # pid 1 forks nothing after the kill
    holder = subprocess.Popen(["unshare", "--user", "--map-root-user", "--pid", "--fork",
                               "sh", "-c", script], start_new_session=True)
    watcher = MemoryWatcher()
    try:
        init = ns_init(holder)
        for _ in range(3000):
            if ready.exists() and len(ready.read_text()) == 2:
                break
            time.sleep(0.01)
        watcher.watch("ns", init, memory_mb=100)
        used, pids = watcher.usage()["ns"]
        assert 120 << 20 < used < 200 << 20, used >> 20
        assert init in pids and len(pids) == 5, pids  # sleep, sleep, python, unshare, python
        assert watcher.poll() == ["ns"] and watcher.kills("ns") == 1
        for _ in range(500):  # SIGKILLed: gone once their parents reap them
            left = [p for p in watcher.usage()["ns"][1] if p != init]
            if not left:
                break
            time.sleep(0.01)
        assert left == [] and Path(f"/proc/{init}").exists()
        assert watcher.usage()["ns"][0] < 100 << 20 and watcher.poll() == []
    finally:
        watcher.close()
        os.killpg(holder.pid, 9)
        holder.wait(timeout=30)


def test_a_process_whose_main_thread_exited_is_still_counted_and_killed(tmp_path):
    """The leader thread gone (a zombie showing no memory) while another thread holds
    150 MiB: found through that thread, over a 100 MiB limit, killed."""
    ready = tmp_path / "ready"
    script = ("import ctypes, threading, time\n"
              "def hold():\n"
              "    time.sleep(0.5)\n"
              "    b = bytearray(150 << 20)\n"
              f"    open({str(ready)!r}, 'w').write('x')\n"
              "    time.sleep(300)\n"
              "threading.Thread(target=hold).start()\n"
              "ctypes.CDLL(None).pthread_exit(None)\n")
    holder = subprocess.Popen(["unshare", "--user", "--map-root-user", "--pid", "--fork",
                               "sh", "-c", f"{sys.executable} -c \"$0\" & wait; sleep 300",
                               script], start_new_session=True)
    watcher = MemoryWatcher()
    try:
        init = ns_init(holder)
        for _ in range(3000):
            if ready.exists():
                break
            time.sleep(0.01)
        (python,) = [int(p) for p in Path(f"/proc/{init}/task/{init}/children").read_text(
            ).split()]
        assert Path(f"/proc/{python}/stat").read_text().split(") ")[1][0] == "Z"  # leader
        watcher.watch("ns", init, memory_mb=100)
        used, pids = watcher.usage()["ns"]
        assert used > 150 << 20 and python in pids, (used >> 20, pids)
        assert watcher.poll() == ["ns"]
        for _ in range(500):
            if not Path(f"/proc/{python}").exists():
                break
            time.sleep(0.01)
        assert not Path(f"/proc/{python}").exists()
    finally:
        watcher.close()
        os.killpg(holder.pid, 9)
        holder.wait(timeout=30)


def test_the_thread_ends_by_itself_when_nothing_is_watched():
    holder = subprocess.Popen(["unshare", "--user", "--map-root-user", "--pid", "--fork",
                               "sleep", "300"], start_new_session=True)
    watcher = MemoryWatcher(interval_s=0.01)
    try:
        watcher.watch("ns", ns_init(holder), memory_mb=64)
        thread = watcher._thread
        assert thread is not None and thread.is_alive()
        watcher.forget("ns")
        thread.join(timeout=30)
        assert not thread.is_alive() and watcher._thread is None
    finally:
        watcher.close()
        os.killpg(holder.pid, 9)
        holder.wait(timeout=30)
