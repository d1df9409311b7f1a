"""A sandbox's commands start with every signal at its default action and none blocked, as a
``docker exec`` does, whatever the process that started the runtime ignored.

A launcher started in the background by a shell without job control (``cmd &`` in a
script, a ``nohup``) ignores SIGINT and SIGQUIT (and SIGHUP); ignored signals survive fork
and exec. Before, every command in the sandbox inherited them: Terminal-Bench 2.0's
cancel-async-tasks sends SIGINT to a ``python`` it started and expects a KeyboardInterrupt;
its reference solution failed test_tasks_cancel_above_max_concurrent (the SIGINT did
nothing, the run outlived the test's 5 s) under ``tmax images build`` run from a
background job.
"""

from __future__ import annotations

import os
import signal

import pytest

from sandfleet.runtime.base import SandboxSpec
from sandfleet.runtime.local import LocalRuntime

INHERITED = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


@pytest.fixture
def launched_in_the_background():
    """This process as a background job or nohup leaves it: SIGINT, SIGQUIT, SIGHUP ignored,
    SIGUSR1 blocked."""
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in INHERITED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.sandbox
def test_commands_and_the_verifier_do_not_inherit_the_launchers_ignored_signals(
        launched_in_the_background, base_sif, tmp_path):
    runtime = LocalRuntime(tmp_path / "state", tmp_path / "cache", owner=f"sig{os.getpid()}")
    runtime.start("sig", SandboxSpec(image=base_sif))
    try:
        status = "grep -E '^Sig(Blk|Ign):' /proc/self/status"
        clean = "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"
        assert runtime.exec("sig", status, timeout=30).output == clean
        # what the task's test does: SIGINT to a python it started ends it with
        # KeyboardInterrupt (ignored, the sleep would run out the timeout)
        interrupt = ("python3 -c 'import os, signal, time; os.kill(os.getpid(), "
                     "signal.SIGINT); time.sleep(20)'")
        result = runtime.exec("sig", interrupt, timeout=15)
        assert not result.timed_out and result.exit_code == 130, result  # killed by SIGINT
        assert "KeyboardInterrupt" in result.output
        tests = tmp_path / "tests"
        tests.mkdir()
        (tests / "test.sh").write_text(f"{status} > /logs/verifier/status\n")
        graded = runtime.verify("sig", ["bash", "/tests/test.sh"], tests=tests,
                                logs=tmp_path / "logs", timeout=60)
        assert graded.exit_code == 0, graded.output
        assert (tmp_path / "logs" / "status").read_text() == clean
    finally:
        runtime.stop("sig")
        assert runtime.reap(keep=()) == []
