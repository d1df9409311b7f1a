"""The persistent shell of a sandbox: one long-lived bash per lease.

``ShellSession(runtime, sandbox_id).run(command, timeout)`` runs ``command`` in the same
bash every time, so the working directory, variables (exported or not, ``declare``\\ d
included), shell functions, options and background jobs carry over from one command to the
next. One command runs at a time (a lock; a second ``run`` waits).

Two ways to drive it. ``run`` is synchronous and a thread per shell reads its output. An
asyncio owner (the worker) passes ``loop=`` and calls ``await arun(command, timeout,
executor)`` from that loop: the output is read by reader callbacks on the loop, a short
command is sent from the loop and its end awaited there, and only what blocks (starting or
restarting bash, a timeout's abort) runs in the executor. A command's round trip then costs
no thread switch in the worker (``benchmarks/sandfleet_bench.py exec``).

Protocol. ``start`` runs ``setsid bash --noprofile --norc`` in the sandbox (plain bash where
the image has no ``setsid``) through ``runtime.popen``, with stdin and stdout as pipes and
stderr merged into stdout, turns on ``set -m`` (every job gets its own process group) and
defines two helper functions. A command goes in as one line (shown on three)::

    __tmax_c='<command>'; __tmax_pre
    . /dev/stdin <<<"$__tmax_p$__tmax_c" >&$__tmax_o 2>&1 {__tmax_o}>&-
    { __tmax_s=$? __tmax_in=; __tmax_end $__tmax_s <nonce>; } 2>/dev/null

so bash *sources* the command in its main context (not a subshell, not a function: ``cd``,
``export``, ``declare`` and function definitions persist), with stdin ``/dev/null`` (``cat``
or ``read`` get end of file), stdout and stderr merged into the session's pipe, and then
prints ``__TMAX_<nonce>__ <status>\\n`` on a descriptor the command cannot see. The nonce
is fresh random for every command, so nothing a command prints, not even text copied from
an earlier command, can end it early; the marker is cut from the output. The marker line
has a single newline, at its end, so bash writes it in one ``write`` (atomic on a pipe): a
background job writing at the same time cannot split it. The reader drains the pipe at all
times (a background job that writes while no command runs never blocks); what
arrives between commands opens the next command's output.

Output: stdout and stderr interleaved as written, decoded as UTF-8 with replacement, capped
at ``max_output_bytes`` with the head and the tail kept and the number of bytes cut noted
(``OutputBuffer``). Error messages name the source ``/dev/stdin: line N:``.

Timeout: what dies and what survives. On its deadline a command gets an abort, in rounds
``ABORT_ROUND_S`` apart: bash is frozen (SIGSTOP), every process the command started gets
SIGKILL, and once they are dead bash gets ``SIGRTMIN+7`` and is thawed. Bash runs its trap
as soon as the foreground job is reaped: it returns from the command (or the function it is
in) and arms a DEBUG trap that returns before any further command, so nothing after the
killed job runs, however deep in functions and loops it was. "Started by the command"
means, comparing with a snapshot of the sandbox's processes taken just before the command
was sent:

- every process in a process group that did not exist before: the command's foreground
  pipeline and every job it put in the background with ``&``, and whatever it started with
  ``setsid``/``nohup ... &``/``(cmd &)``; their children wherever they were re-parented;
- every new process in bash's own group (command substitutions, subshells under ``set +m``).

Everything that existed before survives: servers and other background jobs of *earlier*
commands, and the children they start meanwhile (they stay in the old group); so do
processes that other ``runtime.exec`` calls run in the sandbox at the same time (their
group leader lives outside the sandbox), and the sandbox's init. The result is
``timed_out=True``, exit code 124, with the output so far (bash may add a line such as
``/dev/stdin: line 1: 42 Killed  sleep 100``). The shell stays as it was: cwd, variables and
older jobs are intact (a DEBUG trap the command set is removed). If bash has not come back
``abort_grace_s`` after the deadline (a ``fg`` of an older job, a command that replaced the
trap), bash is killed and restarted (below), and the output says so.

Shell restarts. When bash ends, by ``exit N``, by ``exec`` of another program that then
ends, by ``set -e`` and a failing command, or by being killed (OOM, a stuck abort), the
result is that command's: exit code N (128+signal for a signal; 124 after a timeout) and
its output, followed by a note ``[the shell exited ...; a new shell was started: ...]``. A new
bash starts in the same sandbox at once, with the session's initial cwd and environment:
variables, functions and ``cd`` are reset, files and processes in the sandbox are not
(background jobs of the old shell keep running; their output is drained and dropped). If
the sandbox itself is gone, ``run`` raises ``SandboxLost`` instead, and so does every later
``run``. ``exec >file`` and other ``exec`` redirections of descriptors 0, 1 and 2 last until
the end of the command that made them; other descriptors persist.

How processes are found and killed. The host reads the sandbox's own ``/proc`` (pids of its
pid namespace) through ``/proc/<bash>/root/proc``, opened when the session's first shell
starts and kept for the shells after it (so a command that unmounts, covers or fakes its
``/proc`` changes nothing; start the session before anything else runs in the sandbox),
and signals through pid file descriptors opened from that procfs: a pid cannot be reused
between the check and the kill, and nothing outside the sandbox's pid namespace can be
reached. Bash itself is signalled through a pidfd. The shell therefore needs a sandbox with
its own pid namespace on this host (both runtimes give one) and the right to read its
``/proc/<pid>/root`` (root, or the user owning the sandbox's user namespace).

``oom`` is True when the runtime counts an OOM kill in the sandbox while the command ran
(the local runtime with a memory cgroup); elsewhere it is always False.

``close`` kills bash and everything in its session (every job it started that did not
leave it, older background jobs included) and is idempotent; a ``run`` waiting or running
then raises ``SandboxLost``.

Limits: commands cannot contain NUL bytes; a command over 64 KiB is passed through a
temporary file, so it needs a writable ``$TMPDIR`` (or ``/tmp``); commands are read through
``/dev/stdin``, so a command that unmounts the sandbox's ``/proc`` leaves its shell unable
to run anything. Aliases are not expanded (bash is not interactive). A command that
changes the helpers' variables (``__tmax_*``) or the ``RTMIN+7`` trap breaks only its own
shell, which is then restarted; a DEBUG trap of its own is removed by a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import fcntl
import itertools
import logging
import os
import secrets
import selectors
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Self

from sandfleet.errors import SandboxLost, SandboxStartError
from sandfleet.runtime.base import (
    MAX_OUTPUT_BYTES,
    TIMEOUT_EXIT_CODE,
    ExecResult,
    OutputBuffer,
    Runtime,
    kill_process_group,
    read_small,
)

log = logging.getLogger(__name__)

ABORT_SIGNAL = signal.SIGRTMIN + 7
"""Sent to bash on a timeout; bash's trap on ``RTMIN+7`` returns from the sourced command."""
ABORT_ROUND_S = 0.1
ABORT_GRACE_S = 2.0
"""How long after the deadline bash may take to come back before it is killed."""
START_TIMEOUT_S = 30.0
MARKER = b"__TMAX_%s__ "
READ_CHUNK = 1 << 20
PIPE_SIZE = 1 << 20
F_SETPIPE_SZ = 1031


START_SH = ("if command -v setsid >/dev/null 2>&1; then exec setsid bash --noprofile --norc; "
            "fi; exec bash --noprofile --norc")
# Fed to bash once. __tmax_o: the pipe, on a descriptor commands never see; __tmax_f: the
# x and v flags, off from __tmax_end to the command (no trace of the helpers; the command
# line needs 2>/dev/null only where the command's own flags may still be on);
# __tmax_in: set while a command runs. The abort trap returns from the command, or from the
# function it is in, and arms a DEBUG trap (inherited by functions under set -T) that
# returns before every further command until the command is left: it unwinds nested
# functions and loops at once (a trap that re-sends its own signal crashes bash 5.2). After
# an abort, `jobs` takes bash's "Killed" notices of the jobs the abort killed.
INIT_BASH = r"""set -m
exec {__tmax_o}>&1 2>&1
readonly __tmax_o
__tmax_f= __tmax_T=
trap '[[ -n ${__tmax_in-} ]] && {
  __tmax_T=1${-//[!T]/}; builtin set -T
  builtin trap "[[ -n \${__tmax_in-} ]] && { builtin return 124 2>/dev/null || :; }" DEBUG
  builtin return 124 2>/dev/null || :; }' RTMIN+7
__tmax_pre() {
  __tmax_p="exec </dev/null; unset __tmax_c __tmax_p; ${__tmax_f:+set -$__tmax_f; }"
  __tmax_in=1
}
__tmax_end() {
  __tmax_f=${-//[!xv]/}
  builtin set +xv
  if [[ -n ${__tmax_T-} ]]; then
    builtin trap - DEBUG
    [[ $__tmax_T == *T ]] || builtin set +T
    __tmax_T=
    builtin jobs >/dev/null 2>&1
  fi
  builtin printf '__TMAX_%s__ %s\n' "$2" "$1" >&"$__tmax_o"
}
readonly -f __tmax_pre __tmax_end
"""
COMMAND_LINE = ("__tmax_c=%s; __tmax_pre; "
                '. /dev/stdin <<<"$__tmax_p$__tmax_c" >&$__tmax_o 2>&1 {__tmax_o}>&-; '
                "{ __tmax_s=$? __tmax_in=; __tmax_end $__tmax_s %s; } 2>/dev/null\n")


class ProcStat(NamedTuple):
    state: str
    ppid: int
    pgid: int
    sid: int
    start: int


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
    (see the module doc): new processes in new groups or in bash's own group."""
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
        for attempt in itertools.count():
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

    def close(self) -> None:
        os.close(self.fd)


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


class _Scanner:
    """Splits the shell's output stream into commands' outputs at their end markers."""

    def __init__(self, limit: int):
        self.limit = limit
        self.buf = OutputBuffer(limit)
        self.want: bytes | None = None
        self.carry = b""  # held back: may be the start of the marker
        self.done: tuple[OutputBuffer, int] | None = None

    def expect(self, nonce: str) -> None:
        self.want, self.done = MARKER % nonce.encode(), None

    def feed(self, data: bytes) -> None:
        if self.want is None:
            self.buf.write(data)
            return
        data, self.carry = self.carry + data, b""
        at = data.find(self.want)
        if at < 0:
            keep = min(len(self.want) - 1, len(data))
            self.buf.write(data[:len(data) - keep])
            self.carry = data[len(data) - keep:]
            return
        end = data.find(b"\n", at + len(self.want))
        self.buf.write(data[:at])
        if end < 0:
            self.carry = data[at:]
            return
        self.done = (self.buf, int(data[at + len(self.want):end]))
        self.buf, self.want = OutputBuffer(self.limit), None
        self.buf.write(data[end + 1:])  # after the marker: a background job's, for the next

    def take(self) -> tuple[str, int | None]:
        """The finished command's output and status, or everything so far and None."""
        if self.done is not None:
            buf, status = self.done
        else:
            self.buf.write(self.carry)
            buf, status, self.buf = self.buf, None, OutputBuffer(self.limit)
        self.done, self.want, self.carry = None, None, b""
        return buf.text(), status


class _Bash:
    """One bash process in the sandbox, its pipes, and the thread that drains its output."""

    def __init__(self, runtime: Runtime, sandbox_id: str, cwd: str | None,
                 env: dict[str, str] | None, limit: int,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.proc = runtime.popen(sandbox_id, ["/bin/sh", "-c", START_SH], cwd=cwd, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)
        self.out_fd, self.in_fd = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        try:
            fcntl.fcntl(self.out_fd, F_SETPIPE_SZ, PIPE_SIZE)  # fewer wake-ups on big output
        except OSError:
            pass
        os.set_blocking(self.out_fd, False)
        os.set_blocking(self.in_fd, False)
        self.scanner = _Scanner(limit)
        self.cond = threading.Condition()
        self.waker: Callable[[], None] | None = None  # an async run's, see set_waker
        self.loop = loop  # reads on this loop instead of a thread of its own
        self.attached = False
        self.exited = self.eof = self.stopping = self.discard = False
        self.pidfd: int | None = None
        self.procs: SandboxProcs | None = None
        self.pid = self.pgid = self.sid = 0  # bash's, in the sandbox's pid namespace
        self.thread: threading.Thread | None = None

    def handshake(self, deadline: float, procs: SandboxProcs | None) -> SandboxProcs:
        """Feed bash its helpers and read its pid back; find it on the host, open its pidfd
        and (unless given one to check bash against) the sandbox's procfs, and start the
        reader thread; the procfs handle. OSError if it fails."""
        nonce = secrets.token_hex(8)
        self.scanner.expect(nonce)
        if not self.send((INIT_BASH + f"__tmax_end $$ {nonce}\n").encode(), deadline):
            raise OSError(f"bash did not read its input: {self.scanner.take()[0][-1500:]!r}")
        with selectors.DefaultSelector() as sel:
            sel.register(self.out_fd, selectors.EVENT_READ)
            while self.scanner.done is None:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left) or not self._read_some():
                    raise OSError(f"bash did not start: {self.scanner.take()[0][-1500:]!r}")
        said, ns_pid = self.scanner.take()
        if said.strip():
            log.info("shell start-up said: %s", said.strip()[-500:])
        host_pid = find_host_pid(self.proc.pid, ns_pid)
        if host_pid is None:
            raise OSError(f"bash (pid {ns_pid} inside) is not below host pid {self.proc.pid} "
                          "in a pid namespace of its own")
        self.pidfd = os.pidfd_open(host_pid)
        if procs is None:
            procs = SandboxProcs(host_pid, ns_pid)
        else:
            procs.check(host_pid, ns_pid)
        self.procs = procs
        st = self.procs.stat(ns_pid)
        if st is None:
            raise OSError("bash died during start-up")
        self.pid, self.pgid, self.sid = ns_pid, st.pgid, st.sid
        if self.loop is not None:
            self._on_loop(self._attach)
        else:
            self.thread = threading.Thread(target=self._read_loop, daemon=True,
                                           name=f"shell-{host_pid}")
            self.thread.start()
        return procs

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop: now if this is its thread, else soon (a closed loop
        runs nothing: ``fn`` runs here)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            fn()
            return
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # closed
            fn()

    # ---- pipes

    def send(self, data: bytes, deadline: float) -> bool:
        """Write ``data`` to bash by ``deadline``; False if bash is gone or too slow."""
        try:
            view = memoryview(data)[os.write(self.in_fd, data):]  # most often all of it
        except BlockingIOError:
            view = memoryview(data)
        except OSError:
            return False
        if not view:
            return True
        with selectors.DefaultSelector() as sel:
            sel.register(self.in_fd, selectors.EVENT_WRITE)
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if not sel.select(min(left, 0.5)):
                    if self.proc.poll() is not None:
                        return False
                    continue
                try:
                    view = view[os.write(self.in_fd, view[:65536]):]
                except BlockingIOError:
                    pass
                except OSError:  # EPIPE: bash is gone
                    return False
        return True

    def _read_some(self, chunks: int = 1 << 30) -> bool:
        """Move up to ``chunks`` reads of what the pipe holds into the scanner (the caller
        holds ``cond`` once the reader runs); False at end of file."""
        for _ in range(chunks):
            try:
                chunk = os.read(self.out_fd, READ_CHUNK)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            if not self.discard:
                self.scanner.feed(chunk)
        return True

    def _read_loop(self) -> None:
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.out_fd, selectors.EVENT_READ, "out")
                sel.register(self.pidfd, selectors.EVENT_READ, "pid")
                while not (self.stopping or self.eof):
                    for key, _ in sel.select(1.0):
                        with self.cond:  # one read at a time: a job that writes without
                            if key.data == "out":  # end must not starve wait()
                                self.eof = not self._read_some(1)
                            else:
                                self._read_some(64)  # bash's last words are in the pipe
                                self.exited = True
                                sel.unregister(key.fileobj)
                            if self.eof or self.exited or self.scanner.done is not None:
                                self._notify()
        except Exception:
            log.exception("shell reader failed")
            with self.cond:
                self.eof = True
                self._notify()
        finally:
            self.proc.stdout.close()  # the pidfd is stop()'s: others signal through it

    # ---- reading on an event loop (instead of the thread)

    def _attach(self) -> None:
        """On the loop: watch the pipe and bash's pidfd there."""
        if self.stopping:
            return
        self.loop.add_reader(self.out_fd, self._out_ready)
        self.loop.add_reader(self.pidfd, self._pid_ready)
        self.attached = True

    def _out_ready(self) -> None:
        with self.cond:
            self.eof = not self._read_some(1)
            if self.eof:
                self.loop.remove_reader(self.out_fd)
            if self.eof or self.exited or self.scanner.done is not None:
                self._notify()

    def _pid_ready(self) -> None:
        with self.cond:
            self._read_some(64)  # bash's last words are in the pipe
            self.exited = True
            self.loop.remove_reader(self.pidfd)
            self._notify()

    def _detach(self) -> None:
        """On the loop: stop watching, then close the pipe and the pidfd (closing them while
        watched could leave a later descriptor of the same number watched)."""
        if self.attached:
            self.loop.remove_reader(self.out_fd)
            self.loop.remove_reader(self.pidfd)
            self.attached = False
        self.proc.stdout.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def _notify(self) -> None:
        """Wake whoever waits for the command (the caller holds ``cond``)."""
        self.cond.notify_all()
        if self.waker is not None:
            self.waker()

    def outcome(self) -> str | None:
        """``marker`` (the command ended), ``exited`` (bash did), or None (neither yet)."""
        with self.cond:
            if self.scanner.done is not None:
                return "marker"
            return "exited" if self.exited or self.eof else None

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """Call ``waker`` (from the reader thread) once the command ends or bash does, or at
        once if that has happened already."""
        with self.cond:
            self.waker = waker
            if waker is not None and (self.scanner.done is not None or self.exited
                                      or self.eof):
                waker()

    def wait(self, deadline: float) -> str:
        """``marker`` (the command ended), ``exited`` (bash did) or ``timeout``."""
        with self.cond:
            while True:
                if (outcome := self.outcome()) is not None:
                    return outcome
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                self.cond.wait(left)

    def expect(self, nonce: str) -> None:
        with self.cond:
            self.scanner.expect(nonce)

    def take(self) -> tuple[str, int | None]:
        with self.cond:
            return self.scanner.take()

    # ---- processes

    def alive(self) -> bool:
        with self.cond:
            return not (self.exited or self.eof)

    def signal(self, sig: int) -> None:
        if self.pidfd is not None and not self.stopping:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass

    def kill_since(self, before: Snapshot, settle_s: float = 0.0) -> int:
        try:
            return self.procs.kill(spawned_since(before, self.pid, self.pgid),
                                   settle_s=settle_s)
        except OSError:  # the sandbox's procfs empties with its last process
            return 0

    def abort(self, before: Snapshot) -> None:
        """One abort round: bash frozen, the command's processes killed until they are
        dead, then the abort signal and bash thawed. Bash then finds every job dead at
        once, reaps them all, runs its trap before anything else, and reports the kills in
        this command's output (not, reaped late, in the next one's)."""
        self.signal(signal.SIGSTOP)
        try:
            self.kill_since(before, settle_s=0.5)
            self.signal(ABORT_SIGNAL)
        finally:
            self.signal(signal.SIGCONT)
            self._thaw_leader()

    def _thaw_leader(self) -> None:
        """SIGCONT the host-side leader: ``nsenter`` waits for bash with WUNTRACED and
        stops itself when bash stops, and a stopped nsenter never reaps bash."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def kill_session(self) -> None:
        """SIGKILL bash and every process of its session, then reap the host-side leader."""
        if self.pidfd is None:
            kill_process_group(self.proc)
            return
        self.signal(signal.SIGKILL)
        if self.sid == self.pid and self.procs is not None:
            try:
                self.procs.kill(lambda pid, st: st.sid == self.sid)
            except OSError:
                pass
        self.reap()

    def reap(self) -> int:
        """The exit status of the host-side leader (bash's) once bash is dead; 128+N for
        signal N."""
        give_up = time.monotonic() + 5
        while (code := self.proc.poll()) is None and time.monotonic() < give_up:
            self._thaw_leader()  # it may have stopped itself after the last abort round
            try:
                code = self.proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                continue
        if code is None:
            code = kill_process_group(self.proc)
        return 128 - code if code < 0 else code

    def retire(self) -> None:
        """Stop collecting output; keep draining it (jobs of this shell may outlive it and
        must not block on a full pipe) until the pipe closes or ``stop``."""
        with self.cond:
            self.discard = True

    def stop(self) -> None:
        """Release everything but the procfs handle (the session's); the reader thread
        ends within a second."""
        self.stopping = True
        self.proc.stdin.close()
        self.procs = None
        if self.loop is not None:
            self._on_loop(self._detach)
            return
        if self.thread is None:
            self.proc.stdout.close()
        if self.pidfd is not None:
            os.close(self.pidfd)  # a reader still in select() just stops seeing it
            self.pidfd = None


def _oom_kills(runtime: Runtime, sandbox_id: str) -> int | None:
    """OOM kills in the sandbox so far where the runtime counts them. The ``Runtime``
    protocol has no public counter yet; ``CommandRuntime._oom_kills`` is what ``exec`` uses."""
    count = getattr(runtime, "oom_kills", None) or getattr(runtime, "_oom_kills", None)
    return count(sandbox_id) if count is not None else None


def _with_note(output: str, note: str) -> str:
    if output and not output.endswith("\n"):
        output += "\n"
    return f"{output}[{note}]\n"


FAST_LINE_BYTES = 16384
"""Longest command line ``arun`` sends from the event loop (it fits an empty pipe at once)."""


def _command_line(command: str, timeout: float) -> bytes:
    """The line that runs ``command``, with ``%s`` where its nonce goes."""
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, not {timeout}")
    if "\0" in command:
        raise ValueError("a command cannot contain NUL bytes")
    return (COMMAND_LINE % (shlex.quote(command).replace("%", "%%"), "%s")).encode()


class _Sent(NamedTuple):
    """A command sent to a shell, and what finishing it needs."""

    bash: _Bash
    before: Snapshot
    oom_before: int | None
    notes: list[str]
    started: float
    deadline: float
    sent: bool


RESET = ("a new shell was started: working directory, variables and functions are reset, "
         "files and background processes are not")


class ShellSession:
    """One persistent bash in sandbox ``sandbox_id`` of ``runtime`` (see the module doc)."""

    def __init__(self, runtime: Runtime, sandbox_id: str, *, cwd: str | None = None,
                 env: dict[str, str] | None = None, max_output_bytes: int = MAX_OUTPUT_BYTES,
                 abort_grace_s: float = ABORT_GRACE_S,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.runtime, self.sandbox_id = runtime, sandbox_id
        self.loop = loop
        """Where shells' output is read: this event loop (an asyncio owner calling
        ``arun`` from it), or a thread per shell (None)."""
        self.cwd, self.env = cwd, dict(env or {})
        self.max_output_bytes, self.abort_grace_s = max_output_bytes, abort_grace_s
        self.restarts = 0
        """Shells started after the first one (see "Shell restarts")."""
        self._bash: _Bash | None = None
        self._retired: list[_Bash] = []
        self._procs: SandboxProcs | None = None  # opened by the first shell, kept
        self._lock = threading.Lock()  # one command at a time
        self._state = threading.Lock()  # _closed, for close() racing close()
        self._closed = False
        self._lost: SandboxLost | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- lifecycle

    def start(self) -> None:
        """Start the shell (a no-op when it runs): SandboxLost if the sandbox is gone,
        SandboxStartError if bash cannot start in it."""
        with self._lock:
            if self._bash is None:
                self._spawn()

    def _spawn(self) -> _Bash:
        self._check_open()
        bash = _Bash(self.runtime, self.sandbox_id, self.cwd, self.env, self.max_output_bytes,
                     self.loop)
        try:
            self._procs = bash.handshake(time.monotonic() + START_TIMEOUT_S, self._procs)
        except BaseException as e:
            bash.kill_session()
            if bash.procs is not None and bash.procs is not self._procs:
                bash.procs.close()
            bash.stop()
            if not isinstance(e, OSError):
                raise
            self._check_sandbox()
            raise SandboxStartError(self.sandbox_id, f"shell: {e}") from None
        self._bash = bash
        self._check_open()  # close() ran meanwhile: it cleans up once we let go of the lock
        return bash

    def close(self) -> None:
        """Kill bash and its session; idempotent. A command running now raises SandboxLost."""
        with self._state:
            first, self._closed = not self._closed, True
        bash = self._bash
        if first and bash is not None:
            bash.kill_session()  # without the lock: a running command sees bash die
        with self._lock:  # a running command sees bash die and gives up the lock
            for old in [self._bash, *self._retired]:
                if old is not None:
                    old.kill_session()
                    old.stop()
            if self._procs is not None:
                self._procs.close()
            self._bash, self._retired, self._procs = None, [], None

    def _check_open(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self._closed:
            raise SandboxLost(self.sandbox_id, "its shell session was closed")

    def _check_sandbox(self) -> None:
        """SandboxLost (and for every later call) unless the sandbox still runs."""
        self._check_open()
        if self.sandbox_id not in self.runtime.list_running():
            self._lost = SandboxLost(self.sandbox_id, "it stopped under its shell")
            raise self._lost

    def _replace(self, bash: _Bash) -> _Bash:
        """A new shell for a dead one, whose jobs may live on (their output is dropped)."""
        bash.reap()
        bash.retire()
        self._retired.append(bash)
        self._bash = None
        self._check_sandbox()
        self.restarts += 1
        log.info("sandbox %s: starting a new shell", self.sandbox_id)
        return self._spawn()

    # ---- commands

    def run(self, command: str, timeout: float) -> ExecResult:
        """Run ``command`` in the shell and return what it did (see the module doc);
        SandboxLost when the sandbox is gone or the session closed."""
        line = _command_line(command, timeout)
        with self._lock:
            sent = self._begin(line, timeout)
            return self._finish(sent, sent.bash.wait(sent.deadline) if sent.sent else None)

    async def arun(self, command: str, timeout: float,
                   executor: concurrent.futures.Executor | None = None) -> ExecResult:
        """``run`` for an asyncio caller. While the shell runs and the command is short, the
        command is sent from the loop and its end awaited there (in loop mode no thread is
        involved at all). Starting or restarting a shell and a timeout's abort run in
        ``executor`` (they block). Cancelled, it leaves the command running to its end or
        timeout as ``run`` would, and the session busy until then."""
        line = _command_line(command, timeout)
        loop = asyncio.get_running_loop()
        bash = self._bash
        if bash is None or not bash.alive() or len(line) > FAST_LINE_BYTES \
                or not self._lock.acquire(blocking=False):
            return await loop.run_in_executor(executor, self.run, command, timeout)
        try:  # the lock is a plain Lock: whichever thread finishes the command releases it
            if bash is not self._bash or not bash.alive():  # changed before we locked
                self._lock.release()
                return await loop.run_in_executor(executor, self.run, command, timeout)
            sent = self._begin(line, timeout)  # non-blocking here: bash is idle, pipe empty
        except BaseException:
            self._lock.release()
            raise
        woken, thread = loop.create_future(), threading.get_ident()

        def done() -> None:
            if not woken.done():
                woken.set_result(None)

        def wake() -> None:  # from whoever reads the shell's output, under its lock
            if threading.get_ident() == thread:
                done()
            else:
                loop.call_soon_threadsafe(done)

        outcome = None
        try:
            if sent.sent:
                sent.bash.set_waker(wake)
                try:
                    async with asyncio.timeout(sent.deadline - time.monotonic()):
                        await woken
                except TimeoutError:
                    pass
                finally:
                    sent.bash.set_waker(None)
                outcome = sent.bash.outcome() or "timeout"
        except asyncio.CancelledError:
            rest = loop.run_in_executor(executor, self._finish_locked, sent, None, True)
            rest.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        if outcome == "marker":  # the common case, at once
            return self._finish_locked(sent, outcome)
        return await loop.run_in_executor(executor, self._finish_locked, sent, outcome)

    def _finish_locked(self, sent: _Sent, outcome: str | None,
                       wait: bool = False) -> ExecResult:
        """``_finish`` for ``arun``, which took the lock and left it to whoever ends it."""
        try:
            if wait:
                outcome = sent.bash.wait(sent.deadline) if sent.sent else None
            return self._finish(sent, outcome)
        finally:
            self._lock.release()

    def _begin(self, line: bytes, timeout: float) -> _Sent:
        """Send a command (the lock held): the shell, restarted first if it died between
        commands, and the state to finish it with."""
        started = time.monotonic()
        deadline = started + timeout
        bash = self._bash or self._spawn()
        notes = []
        if not bash.alive():  # it died between commands
            notes.append(f"the shell had exited (status {bash.reap()}); {RESET}")
            bash = self._replace(bash)
        oom_before = _oom_kills(self.runtime, self.sandbox_id)
        try:
            before = bash.procs.snapshot()
        except OSError:
            self._check_sandbox()
            raise
        nonce = secrets.token_hex(8)
        bash.expect(nonce)
        sent = bash.send(line % nonce.encode(), deadline)
        return _Sent(bash, before, oom_before, notes, started, deadline, sent)

    def _finish(self, sent: _Sent, outcome: str | None) -> ExecResult:
        """The result of a sent command (the lock held) given how waiting for it ended
        (None: it could not be sent in time): after a timeout the command is aborted, after
        bash's end a new shell is started."""
        bash, before = sent.bash, sent.before
        if outcome is None:
            outcome = "timeout" if bash.alive() else "exited"
        timed_out = outcome == "timeout"
        if timed_out:
            outcome = self._abort(bash, before)
        output, status = bash.take()
        if outcome == "marker" and timed_out:
            bash.kill_since(before)  # what forked while the abort ran
        elif outcome != "marker":
            if outcome == "stuck":
                bash.signal(signal.SIGKILL)
                bash.kill_since(before)
            self._check_open()
            status = bash.reap()
            why = (f"the command was still running {self.abort_grace_s:g}s after its "
                   "timeout, so the shell was killed" if outcome == "stuck" else
                   f"the shell exited (status {status})")
            self._replace(bash)
            output = _with_note(output, f"{why}; {RESET}")
        oom_after = _oom_kills(self.runtime, self.sandbox_id)
        for note in sent.notes:
            output = f"[{note}]\n{output}"
        return ExecResult(
            output=output,
            exit_code=TIMEOUT_EXIT_CODE if timed_out else int(status),
            timed_out=timed_out,
            oom=sent.oom_before is not None and oom_after is not None
            and oom_after > sent.oom_before,
            duration_s=time.monotonic() - sent.started)

    def _abort(self, bash: _Bash, before: Snapshot) -> str:
        """Stop a command past its deadline: ``marker``, ``exited`` or ``stuck``."""
        give_up = time.monotonic() + self.abort_grace_s
        while True:
            bash.abort(before)
            outcome = bash.wait(min(time.monotonic() + ABORT_ROUND_S, give_up))
            if outcome != "timeout":
                return outcome
            if time.monotonic() >= give_up:
                log.warning("sandbox %s: a command still runs %gs after its timeout; "
                            "killing its shell", self.sandbox_id, self.abort_grace_s)
                return "stuck"
