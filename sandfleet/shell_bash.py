"""The bash process of a persistent shell (``sandfleet.shell``): how it is started and fed
its helpers, the line that runs a command, the scanner that cuts its output at each
command's end marker, and ``Bash``, the process and its pipes read by callbacks on an event
loop, with the abort round that kills what a command started (see docs/shell.md)."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import shlex
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sandfleet.hostprocs import HostProcs
from sandfleet.runtime.base import OutputBuffer, kill_process_group
from sandfleet.shell_procs import Procs, SandboxProcs, Snapshot, find_host_pid, spawned_since

log = logging.getLogger(__name__)

ABORT_SIGNAL = signal.SIGRTMIN + 7
"""Sent to bash on a timeout; bash's trap on ``RTMIN+7`` returns from the sourced command."""
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


class Scanner:
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


Blocking = Callable[..., Awaitable[Any]]
"""``blocking(fn, *args)``: ``fn(*args)`` in the session's executor, awaited."""


def _wake(future: asyncio.Future, value: Any = None) -> None:
    if not future.done():
        future.set_result(value)


class Bash:
    """One bash process in the sandbox and its pipes, read by callbacks on an event loop.

    Every method runs on that loop, except those marked *blocking* (they may wait or sleep),
    which the session runs in its executor: they touch only the pidfd, the procfs handle and
    the host-side leader, never the output.
    """

    def __init__(self, proc: subprocess.Popen, limit: int, loop: asyncio.AbstractEventLoop):
        self.proc, self.loop = proc, loop
        assert proc.stdin is not None and proc.stdout is not None  # popen'd with PIPEs (_spawn)
        self.stdin, self.stdout = proc.stdin, proc.stdout
        self.out_fd, self.in_fd = self.stdout.fileno(), self.stdin.fileno()
        try:
            fcntl.fcntl(self.out_fd, F_SETPIPE_SZ, PIPE_SIZE)  # fewer wake-ups on big output
        except OSError:
            pass
        os.set_blocking(self.out_fd, False)
        os.set_blocking(self.in_fd, False)
        self.scanner = Scanner(limit)
        self.waiter: asyncio.Future | None = None  # wait()'s, woken by the readers
        self.exited = self.eof = self.stopping = self.discard = False
        self.pidfd: int | None = None
        self.procs: Procs | None = None
        self.pid = self.pgid = self.sid = 0  # bash's, in the sandbox's pid namespace
        self.watched: list[int] = []  # descriptors with a reader on the loop
        self._watch(self.out_fd, self._out_ready)

    async def handshake(self, deadline: float, procs: Procs | None,
                        blocking: Blocking) -> Procs:
        """Feed bash its helpers and read its pid back; find it on the host, open its pidfd
        and (unless given one to check bash against) the sandbox's procfs, and watch the
        pidfd; the procfs handle. OSError if it fails."""
        nonce = secrets.token_hex(8)
        self.scanner.expect(nonce)
        if not await self.send((INIT_BASH + f"__tmax_end $$ {nonce}\n").encode(), deadline):
            raise OSError(f"bash did not read its input: {self.scanner.take()[0][-1500:]!r}")
        if await self.wait(deadline) != "marker":
            raise OSError(f"bash did not start: {self.scanner.take()[0][-1500:]!r}")
        said, ns_pid = self.scanner.take()
        if said.strip():
            log.info("shell start-up said: %s", said.strip()[-500:])
        procs = await blocking(self._find, ns_pid, procs)
        assert self.pidfd is not None  # opened by _find
        self._watch(self.pidfd, self._pid_ready)
        return procs

    def _find(self, ns_pid: int, procs: Procs | None) -> Procs:
        """Blocking (walks the host's /proc): bash on the host, its pidfd and procfs."""
        host_pid = find_host_pid(self.proc.pid, ns_pid)
        if host_pid is None:
            raise OSError(f"bash (pid {ns_pid} inside) is not below host pid {self.proc.pid} "
                          "in a pid namespace of its own")
        self.pidfd = os.pidfd_open(host_pid)
        if procs is None:
            try:
                procs = SandboxProcs(host_pid, ns_pid)
            except PermissionError:  # a root the host cannot enter (see hostprocs)
                procs = HostProcs(host_pid, ns_pid)
        else:
            procs.check(host_pid, ns_pid)
        self.procs = procs
        st = self.procs.stat(ns_pid)
        if st is None:
            raise OSError("bash died during start-up")
        self.pid, self.pgid, self.sid = ns_pid, st.pgid, st.sid
        return procs

    # ---- pipes

    async def send(self, data: bytes, deadline: float) -> bool:
        """Write ``data`` to bash by ``deadline``; False if bash is gone or too slow."""
        try:
            view = memoryview(data)[os.write(self.in_fd, data):]  # most often all of it
        except BlockingIOError:
            view = memoryview(data)
        except OSError:
            return False
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not await self._writable(min(left, 0.5)):
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

    async def _writable(self, seconds: float) -> bool:
        """Whether bash's stdin takes more within ``seconds``."""
        ready = self.loop.create_future()
        self.loop.add_writer(self.in_fd, _wake, ready, True)
        timer = self.loop.call_later(seconds, _wake, ready, False)
        try:
            return await ready
        finally:
            timer.cancel()
            self.loop.remove_writer(self.in_fd)

    def _read_some(self, chunks: int) -> bool:
        """Move up to ``chunks`` reads of what the pipe holds into the scanner; False at end
        of file."""
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

    def _watch(self, fd: int, callback: Callable[[], None]) -> None:
        self.loop.add_reader(fd, callback)
        self.watched.append(fd)

    def _unwatch(self, fd: int) -> None:
        if fd in self.watched:
            self.loop.remove_reader(fd)
            self.watched.remove(fd)

    def _out_ready(self) -> None:
        """One read per wake-up: a job that writes without end cannot starve ``wait``."""
        self.eof = not self._read_some(1)
        if self.eof:
            self._unwatch(self.out_fd)
        if self.eof or self.exited or self.scanner.done is not None:
            self._notify()

    def _pid_ready(self) -> None:
        self._read_some(64)  # bash's last words are in the pipe
        self.exited = True
        if self.pidfd is not None:  # (None is never watched: _unwatch would do nothing)
            self._unwatch(self.pidfd)
        self._notify()

    def _notify(self) -> None:
        if self.waiter is not None:
            _wake(self.waiter)

    def outcome(self) -> str | None:
        """``marker`` (the command ended), ``exited`` (bash did), or None (neither yet)."""
        if self.scanner.done is not None:
            return "marker"
        return "exited" if self.exited or self.eof else None

    async def wait(self, deadline: float) -> str:
        """``marker`` (the command ended), ``exited`` (bash did) or ``timeout``."""
        while (outcome := self.outcome()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            self.waiter = woken = self.loop.create_future()
            timer = self.loop.call_later(left, _wake, woken)
            try:
                await woken
            finally:
                timer.cancel()
                self.waiter = None
        return outcome

    def expect(self, nonce: str) -> None:
        self.scanner.expect(nonce)

    def take(self) -> tuple[str, int | None]:
        return self.scanner.take()

    def retire(self) -> None:
        """Stop collecting output; keep draining it (jobs of this shell may outlive it and
        must not block on a full pipe) until the pipe closes or ``stop``."""
        self.discard = True

    def stop(self) -> None:
        """Stop watching, then close the pipes and the pidfd (closing them while watched
        could leave a later descriptor of the same number watched); the procfs handle is
        the session's."""
        self.stopping = True
        for fd in list(self.watched):
            self._unwatch(fd)
        self.procs = None
        self.stdin.close()
        self.stdout.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    # ---- processes

    def alive(self) -> bool:
        return not (self.exited or self.eof)

    def sandbox_procs(self) -> Procs:
        """The procfs handle of a started shell: set by the handshake, dropped only by
        ``stop``, which the session calls with its lock held (never while a command runs)."""
        assert self.procs is not None, "the shell has not started, or was stopped"
        return self.procs

    def signal(self, sig: int) -> None:
        if self.pidfd is not None and not self.stopping:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass

    def kill_since(self, before: Snapshot, settle_s: float = 0.0) -> int:
        """Blocking: kill what the command started (see ``spawned_since``)."""
        try:
            return self.sandbox_procs().kill(spawned_since(before, self.pid, self.pgid),
                                   settle_s=settle_s)
        except OSError:  # the sandbox's procfs empties with its last process
            return 0

    def abort(self, before: Snapshot) -> None:
        """Blocking: one abort round. Bash frozen, the command's processes killed until they
        are dead, then the abort signal and bash thawed. Bash then finds every job dead at
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
        """Blocking: SIGKILL bash and every process of its session, then reap the
        host-side leader."""
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
        """Blocking: the exit status of the host-side leader (bash's) once bash is dead;
        128+N for signal N."""
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


def command_line(command: str, timeout: float) -> bytes:
    """The line that runs ``command``, with ``%s`` where its nonce goes."""
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, not {timeout}")
    if "\0" in command:
        raise ValueError("a command cannot contain NUL bytes")
    return (COMMAND_LINE % (shlex.quote(command).replace("%", "%%"), "%s")).encode()

