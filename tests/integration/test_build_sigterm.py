"""A build ended by SIGTERM (scancel, a Slurm job past its time, kill) ends its checks'
sandboxes with it: they are not its children (each has its own process group and cgroups),
so they used to run on until their lifetime (the task's timeouts, hours)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.unit.test_tasks import make_task

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def processes_with(marker: str) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True,
                         check=True).stdout
    return [int(line.split(None, 1)[0]) for line in out.splitlines()
            if marker in line and "ps -eo" not in line]


def test_a_build_ended_by_sigterm_stops_the_sandbox_of_its_running_check(image_store,
                                                                         tmp_path):
    marker = f"tmax-sigterm-{uuid.uuid4().hex[:12]}"
    task = make_task(tmp_path / "tasks", "slow-solution", **{
        "environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\n"
                                  f"RUN echo {marker} > /app/marker\n",
        "solution/solve.sh": f"#!/bin/bash\nexec -a {marker} sleep 3600\n"})
    cache = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
    build = subprocess.Popen([str(Path(sys.executable).parent / "tmax"), "images", "build", "--store",
                              str(image_store.root), "-j", "1", str(task)],
                             env={**os.environ, "TMAX_CACHE": str(cache)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (solving := processes_with(marker)):  # the oracle check's solve.sh
            assert build.poll() is None, build.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the check's solution never started"
            time.sleep(0.5)
        build.send_signal(signal.SIGTERM)
        output = build.communicate(timeout=120)[0]
        assert build.returncode == -signal.SIGTERM, output[-3000:]
        assert "SIGTERM: stopped check sandboxes check-" in output, output[-3000:]
        assert [pid for pid in solving if os.path.exists(f"/proc/{pid}")] == []
    finally:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGKILL)
            build.wait()


HELD_LOCK = """
import os, signal, sys, threading, time
from tmax.images import checks

checks.STOP_ON_SIGTERM_S = 0.5
lock = threading.Lock()

class Runtime:  # stop needs the lock the main thread holds (a start in progress)
    def stop(self, sandbox_id):
        with lock:
            open(sys.argv[1], "w").write(sandbox_id)

with checks.checks_end_on_sigterm():
    checks._LIVE["check-x"] = Runtime()
    if sys.argv[2] == "held":
        lock.acquire()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
print("not ended")
"""


@pytest.mark.parametrize("lock", ["free", "held"])
def test_sigterm_ends_the_process_even_when_stopping_must_wait_for_the_main_thread(
        lock, tmp_path):
    """The handler stops the sandboxes from a thread of its own, bounded: with the lock
    stopping needs free, the sandbox is stopped; held by the interrupted main thread, the
    process still ends by SIGTERM (it used to be able to wait for ever)."""
    marker = tmp_path / "stopped"
    proc = subprocess.run([sys.executable, "-c", HELD_LOCK, str(marker), lock],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert marker.exists() == (lock == "free")
