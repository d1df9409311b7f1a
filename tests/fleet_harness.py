"""A sandfleet started for tests: ``Fleet`` runs the CLI (``sandfleet up``/``down``) on a
tmp state dir with quick timings (``FAST``) and checks on ``down`` that no process or
sandbox is left. Used by the fleet tests, the rollout and wire tests and conftest's
``example_fleet``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from sandfleet.discovery import read_controller_info

SANDFLEET = [sys.executable, "-m", "sandfleet.cli"]

FAST = {"heartbeat_s": 0.3, "lost_after_s": 1.2, "scale_interval_s": 0.3, "idle_s": 60,
        "worker_grace_s": 20, "lease_ttl_s": 30, "acquire_wait_s": 30}


class Fleet:
    """A fleet started with the CLI in a tmp state dir; ``down`` checks nothing is left."""

    def __init__(self, root: Path, cache: Path, **overrides):
        self.root, self.cache = root, cache
        root.mkdir(parents=True, exist_ok=True)
        self.state = root / "state"
        self.work = root / "work"
        data = {"provider": "local", "max_nodes": 1, "cpus_per_node": 4,
                "memory_mb_per_node": 8192, "cache_dir": str(cache), "work_dir": str(self.work),
                **FAST, **overrides}
        self.config_path = root / "fleet.yaml"
        self.config_path.write_text(yaml.safe_dump(data))
        self.env = dict(os.environ)

    def cli(self, *args: str, check: bool = True, timeout: float = 120):
        out = subprocess.run([*SANDFLEET, *args, "--state-dir", str(self.state)],
                             capture_output=True, text=True, timeout=timeout, env=self.env,
                             stdin=subprocess.DEVNULL, check=False)
        if check and out.returncode != 0:
            raise AssertionError(f"sandfleet {' '.join(args)} failed:\n{out.stdout}\n"
                                 f"{out.stderr}\n{self.logs()}")
        return out

    def up(self) -> Fleet:
        self.cli("up", "--config", str(self.config_path))
        return self

    @contextlib.contextmanager
    def running(self) -> Iterator[Fleet]:
        """Up, with its first worker registered; down (and checked clean) at the end."""
        try:
            self.up()
            self.wait_for(lambda: self.status()["nodes"], 30, "the worker to register")
            yield self
        finally:
            self.down()

    def restart(self) -> None:
        self.cli("up")  # no --config: the state dir's saved config

    def info(self):
        return read_controller_info(self.state)

    def status(self) -> dict:
        return json.loads(self.cli("status", "-o", "json").stdout)

    def worker_pids(self) -> list[int]:
        return [int(j["job_id"].split(".")[0]) for j in self.status()["jobs"]]

    def logs(self) -> str:
        text = []
        for path in sorted((self.state / "logs").glob("*.log")):
            text.append(f"== {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(text)

    def wait_for(self, predicate, timeout: float = 20, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")

    def processes(self) -> list[str]:
        """Command lines of the live processes that name this fleet's state dir."""
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                try:
                    cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if str(self.state) in cmdline and "sandfleet" in cmdline:
                    found.append(f"{proc.name}: {cmdline}")
        return found

    def sandboxes(self) -> list[Path]:
        return sorted(self.work.glob("*/*/runtime/sandboxes/*"))

    def down(self) -> None:
        self.cli("down")
        assert self.info() is None
        self.wait_for(lambda: not self.processes(), 20, "every fleet process to exit")
        self.cli("gc")
        assert self.sandboxes() == [], f"sandboxes left: {self.sandboxes()}"

