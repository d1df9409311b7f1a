"""The local cluster's daemons as processes: identity (pid and start time), signalling
their process groups, sweeping orphaned job steps; running commands with a timeout;
writing files atomically."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tmax-local-slurm")


RECORD = "cluster.json"
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
STOP_GRACE_S = 10.0
CMD_TIMEOUT_S = 30.0

EXIT_ERROR = 1
EXIT_REFUSED = 2
EXIT_PARTLY_DEAD = 3


class LocalSlurmError(Exception):
    """An error with the exit code the CLI should return."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR):
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------- processes


@dataclass
class Daemon:
    name: str  # "munged", "slurmctld", "slurmd-n1"
    pid: int
    start_time: int  # clock ticks since boot, /proc/<pid>/stat field 22
    argv: list[str]


@dataclass
class Record:
    dir: str
    uid: int
    host: str
    conf: str
    nodes: int
    cpus: int
    memory_mb: int
    daemons: list[Daemon] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict) -> Record:
        daemons = [Daemon(**d) for d in data.pop("daemons", [])]
        return cls(**data, daemons=daemons)


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, start_time) of a pid, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may hold spaces and parens: split after its last ')'.
    rest = raw[raw.rindex(")") + 2 :].split()
    return rest[0], int(rest[2]), int(rest[19])


def pid_alive(pid: int) -> bool:
    """Any live process with this pid (zombies count as dead: nobody may reap them here)."""
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def is_alive(d: Daemon) -> bool:
    """The recorded daemon itself is alive: same pid and same start time."""
    st = proc_stat(d.pid)
    return st is not None and st[0] not in ("Z", "X") and st[2] == d.start_time


def group_members(pgid: int, since: int = 0) -> list[int]:
    """Live pids in process group pgid started at or after `since` (clock ticks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st is not None and st[1] == pgid and st[0] not in ("Z", "X") and st[2] >= since:
                pids.append(int(entry.name))
    return pids


def signal_daemon(d: Daemon, sig: int) -> None:
    """Signal the daemon's process group, re-checking its identity first."""
    if not is_alive(d):
        return
    st = proc_stat(d.pid)
    with contextlib.suppress(ProcessLookupError):
        if st is not None and st[1] == d.pid:
            os.killpg(d.pid, sig)
        else:
            os.kill(d.pid, sig)


def wait_until(pred, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def stop_daemon(d: Daemon, grace: float = STOP_GRACE_S) -> str:
    """Stop one recorded daemon; returns 'stopped', 'killed' or 'already dead'."""
    if not is_alive(d):
        # The leader died; members of its group may survive. If the pid now belongs to another
        # live process, the group is not ours: leave it. Otherwise a pgid cannot be reused
        # while its group has members, so these are descendants of our daemon.
        leftovers = [] if pid_alive(d.pid) else group_members(d.pid, since=d.start_time)
        if leftovers:
            log.warning(
                "%s (pid %d) is dead; killing its leftover group %s", d.name, d.pid, leftovers
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(d.pid, signal.SIGKILL)
        return "already dead"
    signal_daemon(d, signal.SIGTERM)
    if wait_until(lambda: not is_alive(d) and not group_members(d.pid, d.start_time), grace):
        return "stopped"
    log.warning(
        "%s (pid %d) still alive %.0fs after SIGTERM; sending SIGKILL", d.name, d.pid, grace
    )
    signal_daemon(d, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(d.pid, signal.SIGKILL)
    if not wait_until(lambda: not is_alive(d), 5.0):
        raise LocalSlurmError(f"could not stop {d.name} (pid {d.pid})")
    return "killed"


def process_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def orphan_steps(conf: Path, since: int) -> list[tuple[int, int]]:
    """(pid, session) of slurmstepd processes our slurmds left behind.

    slurmstepd runs in a session of its own, so stopping a slurmd's group does not reach it;
    when a slurmd dies with jobs on it they stay. Ours: comm slurmstepd, owned by us, started
    after our munged, and SLURM_CONF in its environment (inherited from our slurmd) is our conf.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            comm = (entry / "comm").read_text().strip()
            owner = entry.stat().st_uid
        except OSError:
            continue
        st = proc_stat(pid)
        if (
            comm != "slurmstepd"
            or owner != os.geteuid()
            or st is None
            or st[0] in ("Z", "X")
            or st[2] < since
            or process_env(pid).get("SLURM_CONF") != str(conf)
        ):
            continue
        raw = Path(f"/proc/{pid}/stat").read_text()
        found.append((pid, int(raw[raw.rindex(")") + 2 :].split()[3])))
    return found


def kill_session(sid: int) -> list[int]:
    """SIGKILL every live process of a session (ids are not reused while it has members)."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


def run(
    argv: list[str], *, env: dict | None = None, timeout: float = CMD_TIMEOUT_S, check: bool = True
) -> subprocess.CompletedProcess:
    """Run a command (argv list) with a timeout; errors carry its stderr."""
    cmd = shlex.join(argv)
    try:
        cp = subprocess.run(
            argv,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError as e:
        raise LocalSlurmError(f"{argv[0]}: not found ({e})") from e
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        raise LocalSlurmError(f"`{cmd}` timed out after {timeout:.0f}s; stderr: {err}") from e
    if check and cp.returncode != 0:
        raise LocalSlurmError(f"`{cmd}` exited {cp.returncode}; stderr: {cp.stderr.strip()}")
    return cp


def find_binary(name: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN_DIRS)
    found = shutil.which(name, path=path)
    if not found:
        raise LocalSlurmError(
            f"{name} not found on PATH or in {', '.join(SBIN_DIRS)}; install slurm-wlm and munge "
            "(bin/tmax-setup does)"
        )
    return found


def atomic_write(path: Path, text: str | bytes, mode: int = 0o644) -> None:
    """Write via a temp file in the same directory, then rename over the target."""
    data = text.encode() if isinstance(text, str) else text
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
