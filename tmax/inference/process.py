"""``ServerProcess``: owns one inference server process (``vllm serve`` or ``tmax serve``).

Lifecycle only (operations go through ``HttpEngine``): start the argv in its own process
group with its output in a log file, wait for ``GET /health`` with a deadline (failing
early, with the log's tail, if the process exits), stop it by process group (SIGTERM,
then SIGKILL after a grace period). Nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import BinaryIO

import httpx

from tmax.inference.base import EngineStartError

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def hf_server_command(model_dir: str | Path, *, host: str = "127.0.0.1", port: int,
                      max_batch: int = 16, max_tokens: int = 256, temperature: float = 1.0,
                      served_model_name: str | None = None, seed: int | None = None
                      ) -> list[str]:
    """The ``tmax serve`` argv (run with this interpreter, so no PATH lookup)."""
    argv = [sys.executable, "-c", "from tmax.cli import main; main(prog_name='tmax')",
            "serve", str(model_dir), "--host", host,
            "--port", str(port), "--max-batch", str(max_batch), "--max-tokens",
            str(max_tokens), "--temperature", repr(float(temperature))]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if seed is not None:
        argv += ["--seed", str(seed)]
    return argv


class ServerProcess:
    """``async with ServerProcess(argv, url=..., log_path=...) as server:`` started and
    healthy inside, stopped (the whole process group) on the way out."""

    def __init__(self, argv: list[str], *, url: str, log_path: str | Path,
                 env: dict[str, str] | None = None, name: str = "server",
                 start_timeout_s: float = 600.0, stop_grace_s: float = 10.0):
        self.argv, self.url, self.log_path = list(argv), url.rstrip("/"), Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.name, self.start_timeout_s, self.stop_grace_s = name, start_timeout_s, stop_grace_s
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self) -> None:
        """Start the process and wait until ``/health`` answers 200 (EngineStartError if
        it exits or the deadline passes; the process is stopped then)."""
        out = await asyncio.to_thread(self._open_log)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, env=self.env, start_new_session=True)
        finally:
            out.close()
        log.info("%s: started pid %d: %s", self.name, self.proc.pid, " ".join(self.argv))
        try:
            await self.wait_healthy(self.start_timeout_s)
        except BaseException:
            await self.stop()
            raise

    def _open_log(self) -> BinaryIO:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.log_path, "ab")

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 0.1
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if self.proc is not None and self.proc.returncode is not None:
                    raise EngineStartError(self.name, f"exited with code "
                                           f"{self.proc.returncode} before it was healthy",
                                           self.log_tail())
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise EngineStartError(self.name, f"not healthy at {self.url}/health "
                                           f"after {timeout_s:.0f} s", self.log_tail())
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 1.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after the grace period; idempotent."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                await asyncio.wait_for(proc.wait(), wait)
                return
            except TimeoutError:
                continue

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    async def __aenter__(self) -> ServerProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
