"""sandfleet.shell: the persistent shell of a sandbox, in real local sandboxes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import re
import subprocess
import threading
import time

import pytest

from sandfleet.errors import SandboxLost
from sandfleet.runtime.base import SandboxSpec
from sandfleet.runtime.local import LocalRuntime
from sandfleet.shell import RESET, AsyncShellSession, ShellSession
from sandfleet.shell_bash import MARKER, Scanner
from sandfleet.shell_procs import spawned_since
from sandfleet.wire.transport import new_event_loop
from tests.integration.test_prepared import until

OWNER = f"sh{os.getpid()}"

# ---- pure parts


def test_scanner_finds_the_marker_across_chunks_and_keeps_lookalikes():
    lookalikes = b"out __TMAX_abc124__ 0\n\n__TMAX_\n__TMAX_abc123_ 1\n"
    stream = lookalikes + b"x" * 100 + MARKER % b"abc123" + b"7\n" + b"later"
    for step in (1, 5, 7, len(stream)):  # every split point of the marker comes up
        scanner = Scanner(1 << 20)
        scanner.expect("abc123")
        for i in range(0, len(stream), step):
            scanner.feed(stream[i:i + step])
        assert scanner.take() == (lookalikes.decode() + "x" * 100, 7)
        assert scanner.take() == ("later", None)  # after the marker: the next command's


def test_spawned_since_picks_new_groups_and_new_members_of_bash_group():
    before = {1: (10, 1), 2: (10, 1), 5: (20, 5), 7: (30, 7), 9: (31, 9)}  # bash 5, job 7, 9
    picked = spawned_since(before, bash_pid=5, bash_pgid=5)

    def st(pgid, start=99):
        from sandfleet.hostprocs import ProcStat
        return ProcStat("S", 5, pgid, 5, start)

    assert not picked(7, st(7, 30))  # an older job
    assert not picked(12, st(7))  # a child an older job forked meanwhile
    assert picked(13, st(13))  # a new job
    assert picked(14, st(13))  # and its children
    assert picked(15, st(5))  # a command substitution (bash's own group)
    assert not picked(5, st(5, 20))  # bash
    assert not picked(16, st(0))  # an exec call's process (group led from outside)
    assert not picked(17, st(1))  # init's
    assert picked(9, st(13, 77))  # pid 9 reused by a new process


# ---- real sandboxes


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    root = tmp_path_factory.mktemp("shell")
    runtime = LocalRuntime(root / "state", root / "cache", owner=OWNER)
    yield runtime
    runtime.close()
    assert runtime.reap(keep=()) == [], "sandboxes left running"
    deadline = time.monotonic() + 3
    while any(t.name.startswith("shell-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "shell reader threads left running"
        time.sleep(0.05)


_ids = itertools.count()


@pytest.fixture
def sandbox(runtime, base_sif):
    """Start sandboxes from the base image (spec fields as keywords); all stopped after."""
    started = []

    def make(**spec) -> str:
        sandbox_id = f"sh{next(_ids)}"
        runtime.start(sandbox_id, SandboxSpec(image=base_sif, **spec))
        started.append(sandbox_id)
        return sandbox_id

    yield make
    for sandbox_id in started:
        runtime.stop(sandbox_id)


@pytest.fixture(scope="module")
def loop():
    """An event loop on a thread of its own, and an executor: what a worker has (uvloop's,
    as the worker runs on)."""
    loop = new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        loop.executor = executor
        yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


class OnLoop:
    """An AsyncShellSession on the worker-like loop, driven from the test's thread (as the
    worker drives it from its requests), with the sync face the tests use."""

    def __init__(self, session: AsyncShellSession, loop):
        self.session, self.loop = session, loop

    def call(self, work):
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def start(self):
        return self.call(self.session.start())

    def run(self, command: str, timeout: float):
        return self.call(self.session.run(command, timeout))

    def close(self):
        return self.call(self.session.close())

    def __getattr__(self, name):
        return getattr(self.session, name)


def open_session(runtime, sandbox_id, loop=None, **kwargs):
    """A started session: ShellSession (loop None), or AsyncShellSession on ``loop``."""
    if loop is None:
        session = ShellSession(runtime, sandbox_id, **kwargs)
    else:
        session = OnLoop(AsyncShellSession(runtime, sandbox_id, executor=loop.executor,
                                           **kwargs), loop)
    session.start()
    return session


@pytest.fixture(params=["sync", "async"])
def shell(request, runtime, sandbox):
    """A started shell session in a fresh sandbox; closed after. Every test runs twice:
    through the sync ShellSession and through AsyncShellSession on an event loop."""
    sessions = []
    loop = request.getfixturevalue("loop") if request.param == "async" else None

    def make(sandbox_id: str | None = None, **kwargs):
        session = open_session(runtime, sandbox_id or sandbox(), loop, **kwargs)
        sessions.append(session)
        return session

    yield make
    for session in sessions:
        session.close()


def run(session: ShellSession, command: str, timeout: float = 30):
    return session.run(command, timeout)


def procs(runtime, sandbox_id) -> str:
    """``ps`` inside the sandbox, through a separate exec."""
    return runtime.exec(sandbox_id, "ps -eo pid,pgid,sid,args", timeout=30).output


@pytest.mark.sandbox
def test_cwd_variables_and_functions_persist(shell):
    sh = shell()
    assert run(sh, "pwd").output == "/\n"
    assert run(sh, "cd /tmp && mkdir -p work && cd work").exit_code == 0
    assert run(sh, "pwd").output == "/tmp/work\n"
    run(sh, "export X=1; Y=plain; declare -A M=([k]=v); greet() { echo \"hi $1\"; }")
    out = run(sh, 'echo "$X $Y ${M[k]}"; greet you; bash -c \'echo "child sees ${X-} ${Y-}"\'')
    assert out.output == "1 plain v\nhi you\nchild sees 1 \n"
    run(sh, "set -o pipefail; shopt -s nullglob")
    assert run(sh, "false | true").exit_code == 1


@pytest.mark.sandbox
def test_background_job_keeps_running_into_the_next_command(shell):
    sh = shell()
    pid = run(sh, "sleep 300 & echo $!").output.strip()
    result = run(sh, f"kill -0 {pid} && echo alive; jobs")
    assert result.output.startswith("alive\n[1]+  Running") and "sleep 300" in result.output


@pytest.mark.sandbox
def test_exit_codes_and_exit_restarts_a_fresh_shell(shell):
    sh = shell(cwd="/root", env={"START": "s"})
    assert run(sh, "true").exit_code == 0
    assert run(sh, "false").exit_code == 1
    assert run(sh, "(exit 5)").exit_code == 5
    assert run(sh, "kill -9 $BASHPID").exit_code == 137  # bash itself: a signal death
    assert sh.restarts == 1
    run(sh, "cd /tmp; export X=1")
    result = run(sh, "echo bye; exit 3")
    assert result.exit_code == 3 and not result.timed_out
    assert result.output.startswith("bye\n[the shell exited (status 3); a new shell")
    assert sh.restarts == 2
    assert run(sh, 'pwd; echo "${X-unset} $START"').output == "/root\nunset s\n"  # reset


@pytest.mark.sandbox
def test_exec_and_errexit_end_the_shell_but_exec_redirections_last_one_command(shell):
    sh = shell()
    assert run(sh, "exec >/dev/null 2>&1; echo hidden").output == ""
    assert run(sh, "echo visible; echo err >&2").output == "visible\nerr\n"
    assert run(sh, "exec 7>/tmp/seven; echo seven >&7").exit_code == 0
    assert run(sh, "echo more >&7; cat /tmp/seven").output == "seven\nmore\n"  # fd 7 stays
    result = run(sh, "exec sh -c 'echo replaced; exit 4'")
    assert result.exit_code == 4 and "replaced\n[the shell exited (status 4)" in result.output
    result = run(sh, "set -e; false; echo not-reached")
    assert result.exit_code == 1 and "not-reached" not in result.output
    assert run(sh, "echo $-").output.strip().count("e") == 0  # errexit gone with the shell
    assert sh.restarts == 2


@pytest.mark.sandbox
def test_timeout_kills_the_command_and_leaves_the_shell_usable(runtime, shell):
    sh = shell()
    run(sh, "cd /tmp; export X=kept; sleep 300 & echo $! > /tmp/server.pid")
    result = run(sh, "echo before; sleep 100", timeout=1)
    assert result.timed_out and result.exit_code == 124
    assert 1 <= result.duration_s < 2
    assert result.output.startswith("before\n")
    assert run(sh, "pwd; echo $X").output == "/tmp\nkept\n"
    assert run(sh, "kill -0 $(cat /tmp/server.pid) && echo server-alive").output == \
        "server-alive\n"  # the job of an earlier command survives


@pytest.mark.sandbox
def test_timeout_kills_every_process_the_command_started(runtime, shell):
    sid = None
    sh = shell()
    sid = sh.sandbox_id
    run(sh, "sleep 300 &")  # an earlier job: must survive
    command = ("sleep 101 & (sleep 102 &); setsid sleep 103 & x=$(sleep 104; echo); "
               "sleep 105; wait")
    result = run(sh, command, timeout=1)
    assert result.timed_out and result.duration_s < 2
    inside = procs(runtime, sid)
    assert "sleep 300" in inside
    for n in range(101, 106):
        assert f"sleep {n}" not in inside, inside
    host = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True,
                          timeout=30, check=True).stdout
    assert not any(f"sleep {n}" in host for n in range(101, 106))
    assert run(sh, "echo ok").output == "ok\n"


@pytest.mark.slow
@pytest.mark.sandbox
def test_timeout_stops_the_whole_command_inside_functions_and_loops(shell):
    sh = shell()
    run(sh, "inner() { sleep 100; echo after-inner; }; outer() { inner; echo after-outer; }")
    result = run(sh, "outer; echo after-all; touch /tmp/ran-on", timeout=1)
    assert result.timed_out and "after" not in result.output
    result = run(sh, "for i in 1 2 3; do sleep 100; echo loop $i; done; echo done", timeout=1)
    assert result.timed_out and "loop" not in result.output and "done" not in result.output
    result = run(sh, "while :; do :; done; echo never", timeout=1)  # builtins only
    assert result.timed_out and result.duration_s < 2 and "never" not in result.output
    assert run(sh, "test -e /tmp/ran-on || echo stopped; inner() { echo new; }; inner"
               ).output == "stopped\nnew\n"
    assert sh.restarts == 0


@pytest.mark.sandbox
def test_a_command_that_will_not_stop_gets_the_shell_restarted(shell):
    sh = shell(abort_grace_s=0.5)
    run(sh, "cd /tmp")
    result = run(sh, "trap '' RTMIN+7; while :; do :; done", timeout=0.5)
    assert result.timed_out and result.exit_code == 124 and result.duration_s < 3
    assert "shell was killed; a new shell was started" in result.output
    assert run(sh, "pwd").output == "/\n" and sh.restarts == 1


@pytest.mark.sandbox
def test_huge_output_is_capped_quickly_with_head_and_tail(shell):
    sh = shell(max_output_bytes=1 << 20)
    result = run(sh, "yes | head -c 50000000; echo END", timeout=60)
    assert result.exit_code == 0 and result.duration_s < 10
    head, _, tail = result.output.partition("\n[... ")
    assert head.startswith("y\ny\n") and tail.endswith("y\nEND\n")
    cut = int(tail.split(" bytes cut")[0])
    assert cut == 50000004 - (1 << 20)
    big = run(sh, "seq 1 3000000").output
    assert big.startswith("1\n2\n3\n") and big.endswith("\n2999999\n3000000\n")
    assert run(sh, "echo still-here").output == "still-here\n"


@pytest.mark.sandbox
def test_binary_output_and_marker_lookalikes_come_back_verbatim(shell):
    sh = shell()
    result = run(sh, r"printf 'a\xff\xfe\x00b\n'")
    assert result.output == "a\ufffd\ufffd\x00b\n"
    fake = "__TMAX_0123456789abcdef__ 0"
    text = f"x\n{fake}\n\n__TMAX_\n{fake} 5\n"
    result = run(sh, f"printf '%s' '{text}'; exit_code=9; (exit 2)")
    assert (result.output, result.exit_code) == (text, 2)
    result = run(sh, f"for i in $(seq 3000); do echo '{fake}'; done")  # across reads
    assert result.output == f"{fake}\n" * 3000
    assert "__tmax" not in run(sh, "echo hi; foo_not_here").output


@pytest.mark.sandbox
def test_stdin_is_empty_so_readers_do_not_hang(shell):
    sh = shell()
    result = run(sh, "cat; read line; echo read=$?; python3 -c 'import sys; "
                     "print(repr(sys.stdin.read()))'", timeout=10)
    assert result.output == "read=1\n''\n" and result.duration_s < 5


@pytest.mark.sandbox
def test_output_between_commands_is_drained_and_shown_next(shell):
    sh = shell()
    run(sh, "(head -c 3000000 /dev/zero | tr '\\0' x; echo; echo bg-done > /tmp/bg) &")
    deadline = time.monotonic() + 20
    while run(sh, "cat /tmp/bg 2>/dev/null").output != "bg-done\n":  # never blocks on a pipe
        assert time.monotonic() < deadline
        time.sleep(0.1)
    run(sh, "(sleep 0.3; echo late) &")
    time.sleep(0.6)
    assert run(sh, "echo now").output == "late\nnow\n"


@pytest.mark.sandbox
def test_commands_end_cleanly_while_a_background_job_floods_the_pipe(shell):
    sh = shell(max_output_bytes=1 << 16)
    run(sh, "(for i in $(seq 100); do head -c 1000000 /dev/zero | tr '\\0' x; done) &")
    for i in range(100):  # the job's output lands in any of them, cut; the markers never
        result = run(sh, f"echo tag-{i}; (exit {i % 7})", timeout=10)
        assert not result.timed_out and result.exit_code == i % 7
        assert "__TMAX" not in result.output
    assert sh.restarts == 0


@pytest.mark.sandbox
def test_a_job_writing_without_end_does_not_starve_commands(shell):
    sh = shell(max_output_bytes=1 << 16)
    run(sh, "yes flood &")
    for i in range(5):
        result = run(sh, f"(exit {i})", timeout=10)
        assert (result.timed_out, result.exit_code) == (False, i)
    run(sh, "kill %1; wait")
    assert run(sh, "echo quiet").output.endswith("quiet\n")
    assert run(sh, "echo quiet").output == "quiet\n"


@pytest.mark.sandbox
def test_xtrace_shows_the_command_and_not_the_helpers(shell):
    sh = shell()
    assert "traced" in run(sh, "set -x; echo traced").output
    out = run(sh, "echo again").output
    assert "echo again" in out and "__tmax" not in out and "TMAX" not in out
    run(sh, "set +x")
    assert run(sh, "echo quiet").output == "quiet\n"


@pytest.mark.sandbox
def test_sandbox_stopped_under_a_running_command_raises_sandbox_lost(runtime, shell):
    sh = shell()
    run(sh, "cd /tmp")
    stopper = threading.Timer(0.5, runtime.stop, args=(sh.sandbox_id,))
    stopper.start()
    started = time.monotonic()
    with pytest.raises(SandboxLost):
        run(sh, "sleep 100", timeout=30)
    assert time.monotonic() - started < 10
    stopper.join()
    with pytest.raises(SandboxLost):
        run(sh, "true")


@pytest.mark.sandbox
def test_sandbox_stopped_between_commands_raises_sandbox_lost(runtime, shell):
    sh = shell()
    run(sh, "true")
    runtime.stop(sh.sandbox_id)
    with pytest.raises(SandboxLost):
        run(sh, "true")


@pytest.mark.sandbox
def test_many_commands_in_a_row(shell):
    sh = shell()
    started = time.monotonic()
    results = [run(sh, "true") for _ in range(200)]
    assert all(r.exit_code == 0 and r.output == "" for r in results)
    assert time.monotonic() - started < 20
    assert run(sh, "ls /proc/self/fd | wc -l").output == "4\n"  # 0-2 and ls's own: no leaks


@pytest.mark.sandbox
def test_concurrent_runs_take_turns(shell):
    sh = shell()
    results = {}

    def worker(name):
        results[name] = run(sh, f"echo start-{name}; sleep 0.3; echo end-{name}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in "abc"]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started >= 0.9
    assert {n: r.output for n, r in results.items()} == {
        n: f"start-{n}\nend-{n}\n" for n in "abc"}


@pytest.mark.sandbox
def test_close_kills_the_session_and_is_idempotent(runtime, shell, sandbox):
    sid = sandbox()
    sh = shell(sid)
    run(sh, "sleep 301 & setsid sleep 302 & sleep 0.5")  # time for setsid to leave
    sh.close()
    sh.close()
    for _ in range(50):  # SIGKILL lands when the killed process next runs: on a busy
        inside = procs(runtime, sid)  # machine, a moment after close returns
        if "sleep 301" not in inside:
            break
        time.sleep(0.1)
    assert "sleep 301" not in inside and "bash --noprofile" not in inside
    assert "sleep 302" in inside  # it left the session
    with pytest.raises(SandboxLost):
        run(sh, "true")
    other = shell(sid)  # the sandbox itself is fine
    assert run(other, "echo fresh").output == "fresh\n"


@pytest.mark.sandbox
def test_close_during_a_command_ends_it(shell):
    sh = shell()
    threading.Timer(0.3, sh.close).start()
    started = time.monotonic()
    with pytest.raises(SandboxLost):
        run(sh, "sleep 100")
    assert time.monotonic() - started < 5


@pytest.mark.sandbox
def test_oom_kill_is_reported_and_the_shell_survives(runtime, shell, sandbox):
    if "memory" not in runtime.cgroups.parents:
        pytest.skip("no writable memory cgroup here")
    sh = shell(sandbox(memory_mb=200))
    result = run(sh, "python3 -c 'b = bytearray(400 << 20); print(\"sur\" + \"vived\")'")
    assert result.oom and result.exit_code == 137 and "survived" not in result.output
    after = run(sh, "echo fine")
    assert (after.output, after.oom) == ("fine\n", False)


@pytest.mark.sandbox
def test_async_run_leaves_the_loop_free_and_a_cancelled_command_runs_to_its_end(
        runtime, sandbox, loop):
    session = AsyncShellSession(runtime, sandbox(), executor=loop.executor)

    async def scenario():
        await session.start()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        result = await session.run("sleep 0.5; echo slept", 10)
        ticking.cancel()
        assert result.output == "slept\n" and ticks >= 20  # the loop ran meanwhile
        first = asyncio.create_task(session.run("sleep 0.6; echo > /tmp/first-done", 10))
        await asyncio.sleep(0.2)
        first.cancel()
        started = time.monotonic()
        after = await session.run("cat /tmp/first-done && echo next", 10)
        return after, time.monotonic() - started

    try:
        after, waited = asyncio.run_coroutine_threadsafe(scenario(), loop).result(30)
        # the cancelled command went on; the next one waited for it, output not mixed
        assert after.output == "\nnext\n" and after.exit_code == 0 and waited >= 0.3
    finally:
        asyncio.run_coroutine_threadsafe(session.close(), loop).result(30)


SEQUENCE = [  # (command, timeout): state, stderr, a background job, a timeout, a restart
    ("cd /tmp && export X=1 && Y=2; f() { echo \"f $1\"; }", 10),
    ('pwd; echo "$X $Y"; f arg; echo err >&2; (exit 3)', 10),
    ("sleep 300 & echo started", 10),
    ("jobs; kill -0 %1 && echo alive", 10),
    ("echo before; sleep 100; echo never", 1),
    ("jobs; pwd; echo $X", 10),
    ("printf 'no newline'; exit 4", 10),
    ('pwd; echo "${X-unset}"; kill -0 %1 2>&1 | head -c 20; true', 10),
    ("cat; echo read=$?", 10),
]


def results_of(session) -> list[tuple]:
    got = []
    for command, timeout in SEQUENCE:
        r = session.run(command, timeout)
        got.append((re.sub(r"line 1: +\d+ Killed", "line 1: N Killed", r.output),
                    r.exit_code, r.timed_out, r.oom))
    return got + [("restarts", session.restarts)]


@pytest.mark.sandbox
def test_sync_and_async_sessions_give_the_same_results(runtime, sandbox, loop):
    sync, asynchronous = open_session(runtime, sandbox()), open_session(runtime, sandbox(),
                                                                         loop)
    try:
        got = results_of(sync)
        assert got == results_of(asynchronous)
    finally:
        sync.close()
        asynchronous.close()
    assert got[1] == ("/tmp\n1 2\nf arg\nerr\n", 3, False, False)
    assert got[3][0].startswith("[1]+  Running") and got[3][0].endswith("alive\n")
    assert got[4][:3] == (got[4][0], 124, True) and got[4][0].startswith("before\n")
    assert "never" not in got[4][0]
    assert got[5][0].startswith("[1]+  Running") and got[5][0].endswith("/tmp\n1\n")
    assert got[6][:2] == ("no newline\n[the shell exited (status 4); " + RESET + "]\n", 4)
    assert got[7][0].startswith("/\nunset\n") and got[8][0] == "read=0\n"
    assert got[-1] == ("restarts", 1)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def settled(threads: set, fds: set[str], timeout: float = 30.0) -> bool:
    """Whether no thread and no descriptor beyond ``threads`` and ``fds`` is left, within
    ``timeout`` (other threads of this process, as a runtime's pool making disks ahead,
    open and close their own meanwhile: a leak stays, theirs go)."""
    return until(lambda: set(threading.enumerate()) <= threads and open_fds() <= fds, timeout)


@pytest.mark.sandbox
def test_sync_session_close_leaves_no_thread_loop_or_descriptor(runtime, sandbox):
    sid = sandbox()
    runtime.disks.close()  # (its maker thread would come and go during the counts)
    threads, fds = set(threading.enumerate()), open_fds()
    session = ShellSession(runtime, sid)
    assert settled(threads, fds, 0)  # nothing before the first use
    session.start()
    runner = session._runner
    assert session.run("sleep 50 & echo hi", 10).output == "hi\n"
    assert session.run("sleep 10", 0.5).timed_out  # the executor's threads in use
    assert any(t.name.startswith(f"shell-{sid}-blocking") for t in threading.enumerate())
    session.close()
    session.close()
    assert runner.loop.is_closed() and not runner.thread.is_alive()
    assert settled(threads, fds), (set(threading.enumerate()) - threads, open_fds() - fds)
    with pytest.raises(SandboxLost):
        session.run("true", 10)
    assert settled(threads, fds, 0)  # a closed session starts nothing


@pytest.mark.sandbox
def test_sync_session_that_cannot_start_leaves_no_thread(runtime, sandbox):
    threads = set(threading.enumerate())
    with pytest.raises(SandboxLost), ShellSession(runtime, "no-such-sandbox"):
        pass
    session = ShellSession(runtime, "no-such-sandbox")
    with pytest.raises(SandboxLost):
        session.run("true", 10)
    session.close()
    assert set(threading.enumerate()) == threads


@pytest.mark.sandbox
def test_async_session_close_leaves_no_descriptor_or_task(runtime, sandbox, loop):
    fds = open_fds()
    session = open_session(runtime, sandbox(), loop)
    assert session.run("sleep 50 & echo hi", 10).output == "hi\n"
    assert session.run("sleep 10", 0.5).timed_out
    session.close()
    assert open_fds() == fds and not session.session._tasks


@pytest.mark.sandbox
def test_sync_session_inside_a_running_event_loop(runtime, sandbox):
    """The sync face never runs a loop in the caller's thread: it works (blocking) even
    where one runs, and a session called from its own loop's thread says why it cannot."""
    with ShellSession(runtime, sandbox()) as session:
        async def caller():
            return session.run("echo inside", 10)

        assert asyncio.run(caller()).output == "inside\n"

        async def on_own_loop():
            session.run("true", 10)

        with pytest.raises(RuntimeError, match="own loop"):
            asyncio.run_coroutine_threadsafe(on_own_loop(), session._runner.loop).result(10)
        assert session.run("echo still", 10).output == "still\n"
