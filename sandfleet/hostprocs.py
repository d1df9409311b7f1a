"""A sandbox's processes read from the host's /proc, for sandboxes whose own procfs the
host cannot open.

The persistent shell reads a sandbox's processes through ``/proc/<pid>/root/proc``. A
rootless Apptainer instance's root is a FUSE mount (fuse-overlayfs) made inside its user
namespace, and FUSE refuses every process outside that namespace, the worker included
(EACCES). ``HostProcs`` gives the same view from the host's /proc instead: the processes
in the pid namespace of a given process (or in namespaces below it, found by walking up
with ``NS_GET_PARENT``), with their pid, process group and session as that namespace
numbers them (``NSpid``/``NSpgid``/``NSsid`` of /proc/<pid>/status). Signals go through
pid file descriptors checked against the start time, so a reused pid is never hit.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Callable
from typing import NamedTuple

NS_GET_PARENT = 0xB702  # _IO(0xb7, 0x2)


class ProcStat(NamedTuple):
    """A process as a sandbox's procfs shows it (``sandfleet.shell_procs`` reads them too)."""

    state: str
    ppid: int  # (from the host's /proc here: the host's number; no caller picks by it)
    pgid: int
    sid: int
    start: int


class Seen(NamedTuple):
    host_pid: int
    state: str
    ppid: int  # the host's number (not used to pick processes)
    pgid: int
    sid: int
    start: int


def _status_ids(host_pid: int) -> tuple[list[int], list[int], list[int]] | None:
    ids: dict[str, list[int]] = {}
    try:
        with open(f"/proc/{host_pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("NSpid", "NSpgid", "NSsid"):
                    ids[key] = [int(p) for p in rest.split()]
    except (OSError, ValueError):
        return None
    if len(ids) != 3:
        return None
    return ids["NSpid"], ids["NSpgid"], ids["NSsid"]


def _stat(host_pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{host_pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return rest[0].decode(), int(rest[1]), int(rest[19])


def _ns_at(host_pid: int, up: int) -> int | None:
    """The inode of the pid namespace ``up`` levels above that of ``host_pid``."""
    try:
        fd = os.open(f"/proc/{host_pid}/ns/pid", os.O_RDONLY)
    except OSError:
        return None
    try:
        for _ in range(up):
            parent = fcntl.ioctl(fd, NS_GET_PARENT)
            os.close(fd)
            fd = parent
        return os.fstat(fd).st_ino
    except OSError:
        return None
    finally:
        os.close(fd)


class HostProcs:
    """The face of ``shell.SandboxProcs`` (pids, stat, snapshot, kill, check, close) over
    the host's /proc, for the pid namespace host process ``host_pid`` is pid ``ns_pid`` in."""

    def __init__(self, host_pid: int, ns_pid: int):
        ids = _status_ids(host_pid)
        if ids is None or ids[0][-1] != ns_pid:
            raise OSError(f"host pid {host_pid} is not pid {ns_pid} of a namespace below ours")
        self.depth = len(ids[0])
        ino = _ns_at(host_pid, 0)
        if ino is None:
            raise OSError(f"cannot read the pid namespace of host pid {host_pid}")
        self.ns = ino
        self._known: dict[tuple[int, int], bool] = {}  # (pid, start) -> in the sandbox

    def check(self, host_pid: int, ns_pid: int) -> None:
        ids = _status_ids(host_pid)
        if ids is None or len(ids[0]) != self.depth or ids[0][-1] != ns_pid or \
                _ns_at(host_pid, 0) != self.ns:
            raise OSError(f"host pid {host_pid} is not pid {ns_pid} of this sandbox")

    def _member(self, host_pid: int) -> tuple[list[int], list[int], list[int]] | None:
        """The process's ids if it is in this sandbox's pid namespace or one below it."""
        ids = _status_ids(host_pid)
        if ids is None or len(ids[0]) < self.depth or \
                _ns_at(host_pid, len(ids[0]) - self.depth) != self.ns:
            return None
        return ids

    def _scan(self) -> dict[int, Seen]:
        """One pass over the host's /proc: a stat read per process; whether a process is
        the sandbox's is looked up once per (pid, start time) and kept."""
        seen, known = {}, {}
        level = self.depth - 1
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            host_pid = int(name)
            st = _stat(host_pid)
            if st is None:
                continue
            key = (host_pid, st[2])
            member = self._known.get(key)
            if member is None:
                member = self._member(host_pid) is not None
            known[key] = member
            if not member:
                continue
            ids = _status_ids(host_pid)  # its group and session may have changed
            if ids is None or len(ids[0]) < self.depth:
                continue
            seen[ids[0][level]] = Seen(host_pid, st[0], st[1], ids[1][level], ids[2][level],
                                       st[2])
        self._known = known
        return seen

    def pids(self) -> list[int]:
        return list(self._scan())

    def stat(self, pid: int) -> ProcStat | None:
        got = self._scan().get(pid)
        return None if got is None else ProcStat(got.state, got.ppid, got.pgid, got.sid,
                                                 got.start)

    def snapshot(self) -> dict[int, tuple[int, int]]:
        return {pid: (s.start, s.pgid) for pid, s in self._scan().items()
                if s.state not in ("Z", "X")}

    def kill(self, chosen: Callable[[int, ProcStat], bool], sig: int = signal.SIGKILL, *,
             settle_s: float = 0.0) -> int:
        total, give_up, attempt = 0, time.monotonic() + settle_s, 0
        while True:
            hit = 0
            for pid, s in self._scan().items():
                if s.state in ("Z", "X") or not chosen(
                        pid, ProcStat(s.state, s.ppid, s.pgid, s.sid, s.start)):
                    continue
                try:
                    pidfd = os.pidfd_open(s.host_pid)
                except OSError:
                    continue
                try:
                    again = _stat(s.host_pid)
                    if again is not None and again[2] == s.start:
                        signal.pidfd_send_signal(pidfd, sig)
                        hit += 1
                except OSError:
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
        pass
