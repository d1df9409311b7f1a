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
import functools
import logging
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple, Self, TypedDict, TypeVar

from sandfleet.errors import SandboxLost, SandboxStartError
from sandfleet.runtime.base import MAX_OUTPUT_BYTES, TIMEOUT_EXIT_CODE, ExecResult, Runtime
from sandfleet.shell_bash import START_SH, Bash, command_line
from sandfleet.shell_procs import Procs, Snapshot
from sandfleet.wire.transport import new_event_loop

log = logging.getLogger(__name__)

ABORT_ROUND_S = 0.1
ABORT_GRACE_S = 2.0
"""How long after the deadline bash may take to come back before it is killed."""
START_TIMEOUT_S = 30.0


T = TypeVar("T")


def _with_note(output: str, note: str) -> str:
    if output and not output.endswith("\n"):
        output += "\n"
    return f"{output}[{note}]\n"


def _retrieve(task: asyncio.Future) -> None:
    """A done callback that marks the task's exception as seen (nobody awaits it)."""
    if not task.cancelled():
        task.exception()


class _Sent(NamedTuple):
    """A command sent to a shell, and what finishing it needs."""

    bash: Bash
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
        self._bash: Bash | None = None
        self._retired: list[Bash] = []
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

    async def _spawn(self) -> Bash:
        self._check_open()
        popen = functools.partial(
            self.runtime.popen, self.sandbox_id, ["/bin/sh", "-c", START_SH], cwd=self.cwd,
            env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        bash = Bash(await self._blocking(popen), self.max_output_bytes,
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

    async def _replace(self, bash: Bash) -> Bash:
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
        line = command_line(command, timeout)
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

    async def _abort(self, bash: Bash, before: Snapshot) -> str:
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
        line = command_line(command, timeout)
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
