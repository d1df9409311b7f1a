"""Per-sandbox memory limits for rootless Apptainer, where Apptainer applies none.

Apptainer applies ``--memory`` through cgroups: as root always, as an ordinary user only on
cgroup v2 with a systemd user session that delegates the memory controller
(``cgroup_v2_delegated``; the runtime then passes ``--memory`` as it does for root). On a
cgroup v1 node (or v2 without that session), an ordinary user can make no cgroup at all, so
``MemoryWatcher`` enforces ``memory_mb`` instead, the way Slurm's
``JobAcctGatherParams=OverMemoryKill`` does: by polling.

Every ``interval_s`` (0.25 s) one thread per runtime lists the worker's own processes in
/proc (its uid's, and its ``/etc/subuid`` range's, which ``--fakeroot`` maps inside where
the node has one) and takes, for each sandbox, those whose pid namespace is its instance's (commands
run through ``apptainer exec instance://`` are in it without descending from its pid 1),
or whose parent chain reaches one (a pid namespace the agent nests inside). Their memory is
summed as **PSS** (``smaps_rollup``): a page shared by N processes counts 1/N to each, so
the read-only image's libraries mapped by twenty processes, or a parent's pages shared
copy-on-write with forked children, count once, as a cgroup charges them; RSS would count
them twenty times and make a small sandbox look big. PSS walks page tables, so the RSS sum
(counters in ``statm``, an upper bound) is read first and PSS only when RSS is past the
limit: an idle sandbox costs a few small reads per poll.

Past ``memory_mb``, every process of the sandbox except its pid 1 gets SIGKILL (through a
pidfd checked to be in the namespace still: no pid reuse race), and the sandbox's OOM count
goes up by one: as on the local runtime, the command that ran gets ``oom`` True (and 137),
and the sandbox lives on (its pid 1 kept, as the local runtime keeps it from the OOM
killer). Unlike the kernel's OOM killer, which picks one process, all go (as with cgroup
v2's ``memory.oom.group``): a background job, the persistent shell (which is restarted).

Between two polls a fast allocation overshoots. ``data_rlimit_argv`` bounds one process:
each command enters with ``RLIMIT_DATA`` at ``DATA_FACTOR`` (2) times ``memory_mb`` (at
least ``DATA_FLOOR_MB``, which Apptainer's own Go front end needs to start), which the agent
cannot raise (that needs ``CAP_SYS_RESOURCE`` of the host's user namespace): an allocation
past it fails with ENOMEM, one that grows past ``memory_mb`` is killed at the next poll, as
the kernel's OOM killer would kill it (at 1x, every single process would meet ENOMEM just
short of the limit and never be killed). It counts writable private mappings, touched or
not: a JVM whose initial heap (1/64 of the node's RAM by default, ``-Xms``) is over twice
``memory_mb`` does not start (measured: ``-Xms8g`` under 2 GiB fails; java 17, node, gcc
and python with their defaults start under 512 MiB on this 24 GiB machine, java not under
256 MiB); ``ApptainerRuntime(data_rlimit=False)`` leaves it off. Several processes each
under it can still overshoot together until the next poll, and a spike shorter than a
poll (a process that allocates 400 MiB and exits within 0.2 s) may not be seen at all.

Files in a tmpfs (the instance's ``/dev/shm``, up to half the node's RAM, and any the agent
mounts, root in its user namespace) or an unmapped memfd belong to no process and are not
counted: the worker cannot even stat them (FUSE's ``allow_other`` refuses processes outside
the instance's user namespace the way through its root). The Slurm job's cgroup bounds all
of a worker's sandboxes together in every case.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

INTERVAL_S = 0.25
DATA_FACTOR = 2
DATA_FLOOR_MB = 256
"""The smallest RLIMIT_DATA a command enters with: Apptainer 1.4.5's ``exec`` (Go) did not
start under 64 MiB here and did under 128 MiB."""
KILL_ROUNDS = 8
"""Passes of SIGKILL over a sandbox's processes (they may fork while we look)."""

NOTE = ("memory_mb through cgroups: polled instead (every 0.25 s, the sum of the sandbox's "
        "process PSS; past it every process but its pid 1 is killed, oom reported) and "
        "RLIMIT_DATA at 2x memory_mb per process (an allocation past that fails with "
        "ENOMEM; a JVM whose -Xms is over it does not start); "
        "processes each under it may together overshoot for up to one poll, and files in "
        "a tmpfs (/dev/shm, one the agent mounts) or a memfd are not counted (the Slurm "
        "job's cgroup bounds those, for all of a worker's sandboxes together)")


# ---- cgroup v2 delegation: where Apptainer's own rootless --memory works


def cgroup_v2_delegated(root: Path = Path("/sys/fs/cgroup"), uid: int | None = None,
                        env: dict[str, str] | None = None) -> str | None:
    """None when rootless Apptainer can apply ``--memory``/``--cpus`` here (cgroup v2
    mounted at ``root``, a systemd user session whose ``user@UID.service`` cgroup is this
    user's and has the memory and cpu controllers, and that session's bus in the
    environment); else why not."""
    uid = os.getuid() if uid is None else uid
    environ: Mapping[str, str] = os.environ if env is None else env
    if not (root / "cgroup.controllers").is_file():
        return f"{root} is not cgroup v2 (no cgroup.controllers)"
    service = root / "user.slice" / f"user-{uid}.slice" / f"user@{uid}.service"
    try:
        owner = service.stat().st_uid
        controllers = (service / "cgroup.controllers").read_text().split()
    except OSError:
        return f"no systemd user session delegating cgroups ({service} missing)"
    if owner != uid:
        return f"{service} is not this user's (uid {owner}, not {uid})"
    missing = [c for c in ("memory", "cpu") if c not in controllers]
    if missing:
        return f"{service} has no {' or '.join(missing)} controller delegated"
    runtime_dir = environ.get("XDG_RUNTIME_DIR", "")
    if not runtime_dir or not (environ.get("DBUS_SESSION_BUS_ADDRESS")
                               or Path(runtime_dir, "bus").exists()):
        return "no user session bus (XDG_RUNTIME_DIR, DBUS_SESSION_BUS_ADDRESS) in the env"
    return None


def data_rlimit_argv(memory_mb: int) -> list[str]:
    """The prefix that starts a command with RLIMIT_DATA (soft and hard) at ``DATA_FACTOR``
    times ``memory_mb`` (at least ``DATA_FLOOR_MB``)."""
    limit = max(DATA_FACTOR * memory_mb, DATA_FLOOR_MB) << 20
    return ["prlimit", f"--data={limit}:{limit}", "--"]


# ---- accounting, from a /proc tree


def _ns(proc: str, pid: str, kind: str) -> str | None:
    try:
        return os.readlink(f"{proc}/{pid}/ns/{kind}")
    except OSError:
        return None


PF_EXITING = 0x4
"""In ``/proc/<pid>/stat``'s flags: the process is exiting (its memory is being freed)."""


class Proc(NamedTuple):
    pidns: str
    ppid: int
    exiting: bool
    """Killed or ended, freeing its memory: neither counted nor signalled again (a killed
    process freeing 500 MiB must not get the next command killed too)."""
    where: str
    """Its folder under /proc: ``PID``, or ``PID/task/TID`` of a live thread when its
    leader thread has exited and others run on (that leader's own files show no memory)."""


def _stat(proc: str, pid: str) -> tuple[int, bool]:
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return int(rest[1]), bool(int(rest[6]) & PF_EXITING)
    except (OSError, ValueError, IndexError):
        return 0, True


def user_ids(uid: int, subuid: str = "/etc/subuid") -> list[tuple[int, int]]:
    """(first, count) ranges of the host uids this user's processes can have: its own, and
    its ``/etc/subuid`` ranges, which ``--fakeroot`` maps inside where they exist (a process
    that switches to uid 1000 inside runs as one of those on the host)."""
    ranges = [(uid, 1)]
    try:
        import pwd

        name = pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        name = str(uid)
    try:
        with open(subuid) as f:
            for line in f:
                parts = line.strip().split(":")
                if len(parts) == 3 and parts[0] in (name, str(uid)):
                    ranges.append((int(parts[1]), int(parts[2])))
    except (OSError, ValueError):
        pass
    return ranges


def own_processes(proc: str, uids: list[tuple[int, int]]) -> dict[int, Proc]:
    """{pid: (pid namespace, parent pid, exiting, folder)} of the processes in ``proc``
    owned by a uid in ``uids`` (``user_ids``)."""
    found = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            owner = entry.stat().st_uid
        except OSError:
            continue
        if not any(first <= owner < first + count for first, count in uids):
            continue
        ns = _ns(proc, entry.name, "pid")
        if ns is None:
            continue
        ppid, exiting = _stat(proc, entry.name)
        where = _live_thread(proc, entry.name) if exiting else None
        found[int(entry.name)] = Proc(ns, ppid, exiting and where is None,
                                      where or entry.name)
    return found


def _live_thread(proc: str, pid: str) -> str | None:
    """``PID/task/TID`` of a thread of ``pid`` not exiting, or None."""
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        if tid != pid and not _stat(proc, f"{pid}/task/{tid}")[1]:
            return f"{pid}/task/{tid}"
    return None


def group_by_sandbox(procs: dict[int, Proc], sandboxes: dict[str, str]
                     ) -> dict[str, list[int]]:
    """{sandbox: its live pids (not exiting)}: a process is a sandbox's when its pid
    namespace is that sandbox's (``sandboxes``: {pid namespace: sandbox}), or when its
    parent chain reaches such a process first (a namespace nested inside: its parents lead
    out through the sandbox's, the only way out of it)."""
    memo: dict[int, str | None] = {}

    def owner(pid: int) -> str | None:
        chain = []
        while pid in procs and pid not in memo:
            chain.append(pid)
            ns, parent, _, _ = procs[pid]
            if ns in sandboxes:
                memo[pid] = sandboxes[ns]
                break
            pid = parent
            if len(chain) > 4096:
                break
        found = memo.get(pid)
        for p in chain:
            memo[p] = found
        return found

    groups: dict[str, list[int]] = {sid: [] for sid in sandboxes.values()}
    for pid, p in procs.items():
        sid = owner(pid)
        if sid is not None and not p.exiting:
            groups[sid].append(pid)
    return groups


def pss_bytes(proc: str, pid: int | str) -> int:
    """A process's proportional set size (0 when it is gone or unreadable); ``pid`` may be
    a ``Proc.where``."""
    try:
        with open(f"{proc}/{pid}/smaps_rollup", "rb") as f:
            for line in f.read().splitlines():
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(proc: str, pid: int | str) -> int:
    """A process's resident set size (``statm``: counters, no page walk; >= its PSS)."""
    try:
        with open(f"{proc}/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def sandbox_bytes(proc: str, pids: list[int | str], limit: int) -> int:
    """The sum of ``pids``' PSS, or of their RSS when that is no more than ``limit``: RSS
    is an upper bound read from counters, PSS walks every page table (``smaps_rollup``),
    which only a sandbox near its limit needs."""
    rss = sum(rss_bytes(proc, pid) for pid in pids)
    return rss if rss <= limit else sum(pss_bytes(proc, pid) for pid in pids)


# ---- the watcher


@dataclass
class Watched:
    sandbox_id: str
    init_pid: int
    pidns: str
    limit_bytes: int


class MemoryWatcher:
    """One thread enforcing every watched sandbox's memory limit (see the module doc). It
    runs while something is watched and ends by itself when nothing is; ``close`` ends it
    now. ``kills`` counts per sandbox id and survives ``forget`` (a verify restarts the
    instance) until ``drop``."""

    def __init__(self, *, interval_s: float = INTERVAL_S, proc: str = "/proc",
                 uid: int | None = None):
        self.interval_s, self.proc = interval_s, proc
        self.uids = user_ids(os.getuid() if uid is None else uid)
        self._watched: dict[str, Watched] = {}
        self._kills: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        """The largest sum seen per sandbox at a kill (for measurements and logs)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, sandbox_id: str, init_pid: int, memory_mb: int) -> None:
        """Enforce ``memory_mb`` on the sandbox whose instance's pid 1 is ``init_pid``."""
        pidns = _ns(self.proc, str(init_pid), "pid")
        if pidns is None:
            raise ProcessLookupError(f"instance pid {init_pid} of {sandbox_id} is gone")
        with self._lock:
            self._watched[sandbox_id] = Watched(sandbox_id, init_pid, pidns, memory_mb << 20)
            self._kills.setdefault(sandbox_id, 0)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="sandfleet-memory-watch")
                self._thread.start()

    def forget(self, sandbox_id: str) -> None:
        """Stop watching (its instance ends); its count stays."""
        with self._lock:
            self._watched.pop(sandbox_id, None)

    def drop(self, sandbox_id: str) -> None:
        with self._lock:
            self._watched.pop(sandbox_id, None)
            self._kills.pop(sandbox_id, None)
            self.peaks.pop(sandbox_id, None)

    def kills(self, sandbox_id: str) -> int | None:
        """Times the sandbox went past its limit and was killed; None if never watched."""
        with self._lock:
            return self._kills.get(sandbox_id)

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                if not self._watched:
                    self._thread = None
                    return
            try:
                self.poll()
            except Exception:  # a bug here must not end enforcement silently for good
                log.exception("memory watcher: a poll failed")

    def usage(self) -> dict[str, tuple[int, list[int]]]:
        """{sandbox id: (bytes, its pids)} now: the PSS sum (``sandbox_bytes``; the RSS sum
        where that is under the limit)."""
        with self._lock:
            watched = {w.sandbox_id: w for w in self._watched.values()}
        if not watched:
            return {}
        procs = own_processes(self.proc, self.uids)
        groups = group_by_sandbox(procs, {w.pidns: sid for sid, w in watched.items()})
        return {sid: (sandbox_bytes(self.proc, [procs[pid].where for pid in pids],
                                    watched[sid].limit_bytes), pids)
                for sid, pids in groups.items()}

    def poll(self) -> list[str]:
        """One pass: the sandboxes found past their limit (and killed)."""
        over = []
        for sid, (used, _) in self.usage().items():
            with self._lock:
                w = self._watched.get(sid)
            if w is None or used <= w.limit_bytes:
                continue
            log.warning("sandbox %s: %d MiB in use, over its memory_mb %d: killing its "
                        "processes", sid, used >> 20, w.limit_bytes >> 20)
            with self._lock:
                if sid in self._kills:
                    self._kills[sid] += 1
                self.peaks[sid] = max(self.peaks.get(sid, 0), used)
            self.kill_all(w)
            over.append(sid)
        return over

    def kill_all(self, w: Watched) -> int:
        """SIGKILL every process of ``w`` but its pid 1; how many were signalled."""
        count = 0
        for _ in range(KILL_ROUNDS):
            procs = own_processes(self.proc, self.uids)
            pids = [pid for pid in group_by_sandbox(procs, {w.pidns: w.sandbox_id})[
                w.sandbox_id] if pid != w.init_pid]
            if not pids:
                break
            count += sum(_kill_in(self.proc, pid, procs[pid].pidns) for pid in pids)
            time.sleep(0.01)
        return count


def _kill_in(proc: str, pid: int, pidns: str) -> bool:
    """SIGKILL ``pid`` through a pidfd, if it is still in pid namespace ``pidns`` (as
    found by the scan: a pid reused since is some other process)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:  # the pidfd pins the process: a check after it is about that process
        if _ns(proc, str(pid), "pid") != pidns:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
