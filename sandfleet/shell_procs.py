"""A sandbox's processes seen from the host, for the persistent shell (``sandfleet.shell``):
its own procfs (``SandboxProcs``, or ``HostProcs`` where the host cannot enter its root),
a snapshot of them, which ones a command started (``spawned_since``), and the host pid of a
process in the sandbox's pid namespace (``find_host_pid``)."""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable

from sandfleet.hostprocs import HostProcs, ProcStat
from sandfleet.runtime.base import read_small


def read_stat(dir_fd: int | None, path: str) -> ProcStat | None:
    """``<path>/stat`` (relative to ``dir_fd``) parsed; None when the process is gone."""
    text = read_small(f"{path}/stat" if path else "stat", dir_fd)
    if text is None:
        return None
    rest = text.rsplit(b")", 1)[1].split()
    return ProcStat(rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]))


Snapshot = dict[int, tuple[int, int]]
"""pid -> (start time, process group) of the live processes of a sandbox."""


def spawned_since(before: Snapshot, bash_pid: int, bash_pgid: int
                  ) -> Callable[[int, ProcStat], bool]:
    """Which processes a command started, given the snapshot taken just before it was sent
    (see docs/shell.md): new processes in new groups or in bash's own group."""
    old_groups = {pgid for _, pgid in before.values()}

    def started(pid: int, st: ProcStat) -> bool:
        if pid in (1, bash_pid) or before.get(pid, (None,))[0] == st.start:
            return False
        if st.pgid in (0, 1):  # a group led from outside the sandbox (exec calls), or init's
            return False
        return st.pgid == bash_pgid or st.pgid not in old_groups

    return started


class SandboxProcs:
    """A sandbox's processes as its own procfs shows them, read and signalled from the host.

    The handle is ``/proc/<pid>/root/proc`` of a process in the sandbox, the procfs of the
    sandbox's pid namespace, checked against the host's view of that process. Signals go
    through pid file descriptors opened from it, so a pid is never reused under us.
    """

    def __init__(self, host_pid: int, ns_pid: int):
        self.fd = os.open(f"/proc/{host_pid}/root/proc", os.O_RDONLY | os.O_DIRECTORY)
        try:
            self.check(host_pid, ns_pid)
        except OSError:
            os.close(self.fd)
            raise

    def check(self, host_pid: int, ns_pid: int) -> None:
        """OSError unless host process ``host_pid`` is ``ns_pid`` in this procfs."""
        inside, outside = read_stat(self.fd, str(ns_pid)), read_stat(None, f"/proc/{host_pid}")
        if inside is None or outside is None or inside.start != outside.start:
            raise OSError(errno.ESRCH, f"pid {ns_pid} of the procfs is not host pid {host_pid}")

    def pids(self) -> list[int]:
        return [int(name) for name in os.listdir(self.fd) if name.isdigit()]

    def stat(self, pid: int) -> ProcStat | None:
        return read_stat(self.fd, str(pid))

    def snapshot(self) -> Snapshot:
        taken = {}
        for pid in self.pids():
            st = read_stat(self.fd, str(pid))
            if st is not None and st.state not in ("Z", "X"):
                taken[pid] = (st.start, st.pgid)
        return taken

    def kill(self, chosen: Callable[[int, ProcStat], bool], sig: int = signal.SIGKILL,
             *, settle_s: float = 0.0) -> int:
        """Send ``sig`` to every live process ``chosen`` picks, pass after pass until one
        finds none (they may fork while we look), for up to ``settle_s`` (SIGKILL takes a
        moment); how many were signalled."""
        total, give_up = 0, time.monotonic() + settle_s
        attempt = 0
        while True:
            hit = 0
            for pid in self.pids():
                try:
                    pidfd = os.open(str(pid), os.O_RDONLY | os.O_DIRECTORY, dir_fd=self.fd)
                except OSError:
                    continue
                try:
                    st = read_stat(pidfd, "")  # through the pidfd: surely the same process
                    if st is not None and st.state not in ("Z", "X") and chosen(pid, st):
                        signal.pidfd_send_signal(pidfd, sig)
                        hit += 1
                except OSError:  # gone meanwhile (or not a process: nothing to signal)
                    pass
                finally:
                    os.close(pidfd)
            total += hit
            if not hit or (attempt >= 10 and time.monotonic() > give_up):
                return total
            if attempt >= 10:
                time.sleep(0.002)
            attempt += 1

    def close(self) -> None:
        os.close(self.fd)


Procs = SandboxProcs | HostProcs
"""A sandbox's processes: through its own procfs, or the host's (see ``hostprocs``)."""


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _ns_pids(pid: int) -> list[int]:
    """A process's pid in each pid namespace it is in, ours first."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(p) for p in line.split()[1:]]
    except OSError:
        pass
    return []


def find_host_pid(root: int, ns_pid: int) -> int | None:
    """The host pid of the descendant of ``root`` that is pid ``ns_pid`` in a pid namespace
    below ours; None if there is none."""
    depth = len(_ns_pids(os.getpid()))
    queue, seen = [root], set()
    while queue:
        pid = queue.pop(0)
        if pid not in seen:
            seen.add(pid)
            ns = _ns_pids(pid)
            if len(ns) > depth and ns[-1] == ns_pid:
                return pid
            queue.extend(_children(pid))
    return None

