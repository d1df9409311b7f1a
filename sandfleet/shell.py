"""The persistent shell of a sandbox: one long-lived bash per lease (see docs/shell.md).

``await AsyncShellSession(runtime, sandbox_id).run(command, timeout)`` runs ``command`` in
the same bash every time: cwd, variables, functions, options and background jobs carry over.
One command runs at a time. Its output (stdout and stderr interleaved, capped head and tail)
ends at a fresh random marker; on its deadline everything the command started is killed and
the shell stays usable; a shell that ends is restarted with a note in the output; a gone
sandbox raises ``SandboxLost``. The session lives on one event loop: the pipe and bash's pidfd
are read by callbacks there, and what blocks (starting bash, an abort, a reap) runs in an
executor. ``ShellSession`` is the same session for synchronous callers, on an event loop of
its own in a thread that ``close`` ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import fcntl
import functools
import logging
import os
import secrets
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple, Self, TypedDict, TypeVar

from sandfleet.errors import SandboxLost, SandboxStartError
from sandfleet.hostprocs import HostProcs, ProcStat
from sandfleet.runtime.base import (
    MAX_OUTPUT_BYTES,
    TIMEOUT_EXIT_CODE,
    ExecResult,
    OutputBuffer,
    Runtime,
    kill_process_group,
    read_small,
)
from sandfleet.wire.transport import new_event_loop

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




T = TypeVar("T")
Blocking = Callable[..., Awaitable[Any]]
"""``blocking(fn, *args)``: ``fn(*args)`` in the session's executor, awaited."""


def _wake(future: asyncio.Future, value: Any = None) -> None:
    if not future.done():
        future.set_result(value)


class _Bash:
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
        self.scanner = _Scanner(limit)
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


def _with_note(output: str, note: str) -> str:
    if output and not output.endswith("\n"):
        output += "\n"
    return f"{output}[{note}]\n"


def _command_line(command: str, timeout: float) -> bytes:
    """The line that runs ``command``, with ``%s`` where its nonce goes."""
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, not {timeout}")
    if "\0" in command:
        raise ValueError("a command cannot contain NUL bytes")
    return (COMMAND_LINE % (shlex.quote(command).replace("%", "%%"), "%s")).encode()


def _retrieve(task: asyncio.Future) -> None:
    """A done callback that marks the task's exception as seen (nobody awaits it)."""
    if not task.cancelled():
        task.exception()


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


class AsyncShellSession:
    """One persistent bash in sandbox ``sandbox_id`` of ``runtime`` (see docs/shell.md),
    used from one event loop. What blocks runs in ``executor`` (the loop's default if None).
    """

    def __init__(self, runtime: Runtime, sandbox_id: str, *, cwd: str | None = None,
                 env: dict[str, str] | None = None, max_output_bytes: int = MAX_OUTPUT_BYTES,
                 abort_grace_s: float = ABORT_GRACE_S,
                 executor: concurrent.futures.Executor | None = None):
        self.runtime, self.sandbox_id = runtime, sandbox_id
        self.cwd, self.env = cwd, dict(env or {})
        self.max_output_bytes, self.abort_grace_s = max_output_bytes, abort_grace_s
        self.executor = executor
        self.restarts = 0
        """Shells started after the first one (see "Shell restarts")."""
        self._bash: _Bash | None = None
        self._retired: list[_Bash] = []
        self._procs: Procs | None = None  # opened by the first shell, kept
        self._lock = asyncio.Lock()  # one command at a time
        self._closed = False
        self._lost: SandboxLost | None = None
        self._tasks: set[asyncio.Task] = set()  # shielded runs and closes, referenced

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _shielded(self, work: Coroutine[Any, Any, T]) -> T:
        """``work`` in a task of its own that a cancelled caller leaves running."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_retrieve)
            raise

    # ---- lifecycle

    async def start(self) -> None:
        """Start the shell (a no-op when it runs): SandboxLost if the sandbox is gone,
        SandboxStartError if bash cannot start in it."""
        async with self._lock:
            if self._bash is None:
                await self._spawn()

    async def _spawn(self) -> _Bash:
        self._check_open()
        popen = functools.partial(
            self.runtime.popen, self.sandbox_id, ["/bin/sh", "-c", START_SH], cwd=self.cwd,
            env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        bash = _Bash(await self._blocking(popen), self.max_output_bytes,
                     asyncio.get_running_loop())
        try:
            self._procs = await bash.handshake(time.monotonic() + START_TIMEOUT_S, self._procs,
                                               self._blocking)
            await self._blocking(self.runtime.oom_kills, self.sandbox_id)  # warm its cache
        except BaseException as e:
            await self._blocking(bash.kill_session)
            if bash.procs is not None and bash.procs is not self._procs:
                bash.procs.close()
            bash.stop()
            if not isinstance(e, OSError):
                raise
            await self._check_sandbox()
            raise SandboxStartError(self.sandbox_id, f"shell: {e}") from None
        self._bash = bash
        self._check_open()  # close() ran meanwhile: it cleans up once we let go of the lock
        return bash

    async def close(self) -> None:
        """Kill bash and its session; idempotent. A command running now raises SandboxLost.
        Cancelled, the close still runs to its end."""
        await self._shielded(self._close())

    async def _close(self) -> None:
        first, self._closed = not self._closed, True
        bash = self._bash
        if first and bash is not None:
            await self._blocking(bash.kill_session)  # without the lock: a running command
        async with self._lock:  # sees bash die and gives up the lock
            for old in [self._bash, *self._retired]:
                if old is not None:
                    await self._blocking(old.kill_session)
                    old.stop()
            if self._procs is not None:
                self._procs.close()
            self._bash, self._retired, self._procs = None, [], None

    def _check_open(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self._closed:
            raise SandboxLost(self.sandbox_id, "its shell session was closed")

    async def _check_sandbox(self) -> None:
        """SandboxLost (and for every later call) unless the sandbox still runs."""
        self._check_open()
        if self.sandbox_id not in await self._blocking(self.runtime.list_running):
            self._lost = SandboxLost(self.sandbox_id, "it stopped under its shell")
            raise self._lost

    async def _replace(self, bash: _Bash) -> _Bash:
        """A new shell for a dead one, whose jobs may live on (their output is dropped)."""
        await self._blocking(bash.reap)
        bash.retire()
        self._retired.append(bash)
        self._bash = None
        await self._check_sandbox()
        self.restarts += 1
        log.info("sandbox %s: starting a new shell", self.sandbox_id)
        return await self._spawn()

    # ---- commands

    async def run(self, command: str, timeout: float) -> ExecResult:
        """Run ``command`` in the shell and return what it did (see docs/shell.md);
        SandboxLost when the sandbox is gone or the session closed. Cancelled, it leaves
        the command running to its end or timeout, and the session busy until then."""
        line = _command_line(command, timeout)
        return await self._shielded(self._run(line, timeout))

    async def _run(self, line: bytes, timeout: float) -> ExecResult:
        async with self._lock:
            sent = await self._begin(line, timeout)
            outcome = await sent.bash.wait(sent.deadline) if sent.sent else None
            return await self._finish(sent, outcome)

    async def _begin(self, line: bytes, timeout: float) -> _Sent:
        """Send a command (the lock held): the shell, restarted first if it died between
        commands, and the state to finish it with."""
        started = time.monotonic()
        deadline = started + timeout
        bash = self._bash or await self._spawn()
        notes = []
        if not bash.alive():  # it died between commands
            notes.append(f"the shell had exited (status {await self._blocking(bash.reap)}); "
                         f"{RESET}")
            bash = await self._replace(bash)
        oom_before = self.runtime.oom_kills(self.sandbox_id)  # a small file, cached path
        try:
            before = bash.sandbox_procs().snapshot()  # the sandbox's /proc: no disk, no waiting
        except OSError:
            await self._check_sandbox()
            raise
        nonce = secrets.token_hex(8)
        bash.expect(nonce)
        sent = await bash.send(line % nonce.encode(), deadline)
        return _Sent(bash, before, oom_before, notes, started, deadline, sent)

    async def _finish(self, sent: _Sent, outcome: str | None) -> ExecResult:
        """The result of a sent command (the lock held) given how waiting for it ended
        (None: it could not be sent in time): after a timeout the command is aborted, after
        bash's end a new shell is started."""
        bash, before = sent.bash, sent.before
        if outcome is None:
            outcome = "timeout" if bash.alive() else "exited"
        timed_out = outcome == "timeout"
        if timed_out:
            outcome = await self._abort(bash, before)
        output, status = bash.take()
        if outcome == "marker" and timed_out:
            await self._blocking(bash.kill_since, before)  # what forked while the abort ran
        elif outcome != "marker":
            if outcome == "stuck":
                bash.signal(signal.SIGKILL)
                await self._blocking(bash.kill_since, before)
            self._check_open()
            status = await self._blocking(bash.reap)
            why = (f"the command was still running {self.abort_grace_s:g}s after its "
                   "timeout, so the shell was killed" if outcome == "stuck" else
                   f"the shell exited (status {status})")
            await self._replace(bash)
            output = _with_note(output, f"{why}; {RESET}")
        oom_after = self.runtime.oom_kills(self.sandbox_id)
        assert status is not None  # a "marker" outcome's, from the scanner; else reap's
        for note in sent.notes:
            output = f"[{note}]\n{output}"
        return ExecResult(
            output=output,
            exit_code=TIMEOUT_EXIT_CODE if timed_out else int(status),
            timed_out=timed_out,
            oom=sent.oom_before is not None and oom_after is not None
            and oom_after > sent.oom_before,
            duration_s=time.monotonic() - sent.started)

    async def _abort(self, bash: _Bash, before: Snapshot) -> str:
        """Stop a command past its deadline: ``marker``, ``exited`` or ``stuck``."""
        give_up = time.monotonic() + self.abort_grace_s
        while True:
            await self._blocking(bash.abort, before)  # the loop drains the pipe meanwhile
            outcome = await bash.wait(min(time.monotonic() + ABORT_ROUND_S, give_up))
            if outcome != "timeout":
                return outcome
            if time.monotonic() >= give_up:
                log.warning("sandbox %s: a command still runs %gs after its timeout; "
                            "killing its shell", self.sandbox_id, self.abort_grace_s)
                return "stuck"


class _LoopThread:
    """An event loop running in a thread of its own (``name``), with a small executor for
    what its sessions block on; ``close`` ends all three."""

    def __init__(self, name: str):
        self.loop = new_event_loop()
        self.executor = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix=f"{name}-blocking")
        self.loop.set_default_executor(self.executor)
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self.thread:
            work.close()
            raise RuntimeError("a ShellSession cannot be called from its own loop's thread")
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def close(self) -> None:
        """Stop the loop, cancel what is left on it (nothing, after a session's close),
        close it and the executor."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        try:
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        finally:
            self.loop.close()
            self.executor.shutdown(wait=True)


class _Options(TypedDict):
    """What ``ShellSession`` passes on to its ``AsyncShellSession``."""

    cwd: str | None
    env: dict[str, str] | None
    max_output_bytes: int
    abort_grace_s: float


class ShellSession:
    """``AsyncShellSession`` for synchronous callers (any threads, one command at a time).

    The session lives on an event loop in a thread of its own, ``shell-<sandbox id>``
    (and up to two ``...-blocking`` executor threads), started by the first ``start`` or
    ``run`` and ended with the loop by ``close`` (also after a failed ``start``: ``with``
    does that). A caller interrupted while it waits (a KeyboardInterrupt) leaves the
    command running to its end or timeout, as a cancelled ``AsyncShellSession.run`` does.
    From async code use the async session: this one works there but blocks the caller's
    loop while it waits.
    """

    def __init__(self, runtime: Runtime, sandbox_id: str, *, cwd: str | None = None,
                 env: dict[str, str] | None = None, max_output_bytes: int = MAX_OUTPUT_BYTES,
                 abort_grace_s: float = ABORT_GRACE_S):
        self.runtime, self.sandbox_id = runtime, sandbox_id
        self._options: _Options = {"cwd": cwd, "env": env, "max_output_bytes": max_output_bytes,
                         "abort_grace_s": abort_grace_s}
        self._shell: AsyncShellSession | None = None
        self._runner: _LoopThread | None = None
        self._guard = threading.Lock()  # _runner, _closed
        self._closing = threading.Lock()  # a second close waits for the first
        self._closed = False

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()  # its thread and loop too
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def restarts(self) -> int:
        """Shells started after the first one."""
        return self._shell.restarts if self._shell is not None else 0

    def start(self) -> None:
        """``AsyncShellSession.start``."""
        self._call(lambda shell: shell.start())

    def run(self, command: str, timeout: float) -> ExecResult:
        """``AsyncShellSession.run`` (unshielded: nothing on the loop cancels it but its
        ``close``)."""
        line = _command_line(command, timeout)
        return self._call(lambda shell: shell._run(line, timeout))

    def close(self) -> None:
        """Close the session, then its loop, thread and executor; idempotent."""
        with self._closing:
            with self._guard:
                self._closed = True
                runner, self._runner = self._runner, None
            if runner is None:
                return
            try:
                assert self._shell is not None  # made with the runner, in _call
                runner.submit(self._shell.close()).result()
            finally:
                runner.close()

    def _call(self, work: Callable[[AsyncShellSession], Coroutine[Any, Any, T]]) -> T:
        with self._guard:
            if self._closed:
                raise SandboxLost(self.sandbox_id, "its shell session was closed")
            if self._runner is None:
                self._runner = _LoopThread(f"shell-{self.sandbox_id}")
                self._shell = AsyncShellSession(self.runtime, self.sandbox_id,
                                                **self._options)
            shell = self._shell
            assert shell is not None  # made with the runner, just above or by an earlier call
            done = self._runner.submit(work(shell))
        try:
            return done.result()
        except concurrent.futures.CancelledError:  # left on the loop when it closed
            raise SandboxLost(self.sandbox_id, "its shell session was closed") from None
