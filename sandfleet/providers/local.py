"""Workers as processes on this machine, each leading its own process group, named by
(pid, start time) so a reused pid is never signalled."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sandfleet.providers.base import worker_argv
from sandfleet.runtime.base import kill_group, proc_start_time

log = logging.getLogger(__name__)


class LocalProvider:
    """Workers as local processes, each in its own session; job id ``<pid>.<start time>``."""

    name = "local"
    poll_min_s = 0.5
    poll_max_s = 2.0

    def __init__(self, state_dir: Path, *, python: str | None = None, grace_s: float = 15.0):
        self.state_dir = Path(state_dir).resolve()
        self.python = python or sys.executable
        self.grace_s = grace_s
        self._procs: dict[str, subprocess.Popen] = {}

    def submit(self, name: str, index: int) -> str:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"worker-{name}.log", "ab") as out:
            proc = subprocess.Popen(worker_argv(self.python, self.state_dir, name),
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        job_id = f"{proc.pid}.{proc_start_time(proc.pid, zombie_ok=True) or 0}"
        self._procs[job_id] = proc
        return job_id

    @staticmethod
    def _parse(job_id: str) -> tuple[int, int]:
        pid, _, start = job_id.partition(".")
        return int(pid), int(start or 0)

    def alive(self, job_id: str) -> bool:
        proc = self._procs.get(job_id)
        if proc is not None:
            proc.poll()  # reap our own child once it exits
        pid, start = self._parse(job_id)
        return proc_start_time(pid) == start

    def poll(self, job_ids: Sequence[str]) -> dict[str, str]:
        return {job_id: "running" if self.alive(job_id) else "ended" for job_id in job_ids}

    def cancel(self, job_id: str) -> None:
        pid, start = self._parse(job_id)
        if not self.alive(job_id):
            return
        kill_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while self.alive(job_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc_start_time(pid) == start:
            log.warning("worker %s ignored SIGTERM for %.0fs: SIGKILL", job_id, self.grace_s)
            kill_group(pid, signal.SIGKILL)
        proc = self._procs.pop(job_id, None)
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
