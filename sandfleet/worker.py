"""The fleet worker (``sandfleet worker``): one per node job, owning operations.

A worker starts its runtime, serves clients *and* the controller on one TCP server (same
fleet token), registers with the controller named in the state dir and heartbeats every
``heartbeat_s``. The controller asks it to start and stop sandboxes; lease holders call it
directly for ``exec`` (the lease's persistent shell: one per lease, one command at a time),
``put`` and ``get`` (tar streams). Each of those renews the lease locally; heartbeats carry
every lease's idle time and whether a command pins it, and the controller renews from
them. Blocking runtime calls run in a thread pool sized for the node's slots, never on the
event loop.

Cleanup it owns:

- At start, every sandbox left in its runtime state dir (a previous run under the same
  name, e.g. a requeued job) is reaped: a shell's state cannot survive its worker, so such
  leases are not silently resumed; the controller fails them as lost. So are the
  sandboxes and work dirs of this fleet's dead workers on the node (worker.json names a
  dead process), e.g. one killed with SIGKILL.
- A sandbox whose lease the controller no longer knows (heartbeat reply) is stopped.
- A sandbox that dies under it is reported ``lost`` in the next heartbeat.
- If the controller stays unreachable for ``worker_grace_s``, it stops every sandbox and
  exits; SIGTERM (scancel, ``down``) does the same at once. Each sandbox's hard lifetime
  holds even if the worker is killed with SIGKILL.

Files: ``put`` unpacks the client's tar on the host with tarfile's ``data`` filter after
checking every member lies under the one top-level name the request declares (absolute
paths, ``..``, links out and device files are refused: BadRequest), then ``copy_in``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import posixpath
import shutil
import signal
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandfleet.config import FleetConfig, fleet_config_of, fleet_key
from sandfleet.discovery import read_controller_info, write_private
from sandfleet.errors import BadRequest, InfraError, RemoteError, SandboxLost, UnknownLease
from sandfleet.netproxy import ProxyPool
from sandfleet.runtime import get_runtime
from sandfleet.runtime.base import ExecResult, SandboxSpec, cap_output, proc_start_time
from sandfleet.runtime.prepared import ready_default
from sandfleet.shell import AsyncShellSession
from sandfleet.slurm import SlurmClient
from sandfleet.transfer import tar_bounded, unpack_checked
from sandfleet.wire.frames import MAX_PAYLOAD_BYTES
from sandfleet.wire.messages import (
    Exec,
    ExecReply,
    FileReply,
    Get,
    Heartbeat,
    HeartbeatReply,
    LeaseActivity,
    Ping,
    Put,
    Register,
    RegisterReply,
    Shutdown,
    ShutdownReply,
    StartReply,
    StartSandbox,
    StopReply,
    StopSandbox,
    Verify,
    VerifyReply,
    new_id,
    parse_result,
)
from sandfleet.wire.server import Peer, Server
from sandfleet.wire.transport import Connection, parse_address, run_event_loop

log = logging.getLogger(__name__)
VERIFY_OUTPUT_BYTES = 65536
"""What a verify reply keeps of test.sh's output: its head and tail (a grader reads both:
the tools the script set up first, the test runner's summary last)."""


@dataclass
class Held:
    """A lease this worker runs a sandbox for."""

    lease_id: str
    spec: SandboxSpec
    shell: Any = None
    ready: asyncio.Future | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running: int = 0
    ops: int = 0  # operations begun (``running`` counts those not yet ended)
    last_activity: float = field(default_factory=time.monotonic)
    lost: str | None = None

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def activity(self) -> LeaseActivity:
        return LeaseActivity(idle_s=round(time.monotonic() - self.last_activity, 3),
                             pinned=self.running > 0)


def address_towards(host: str) -> str:
    """This machine's IP on the interface that routes to ``host``."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class Worker:
    """One worker process (see the module doc). ``await Worker(...).run()``."""

    def __init__(self, state_dir: Path, name: str, config: FleetConfig, *,
                 runtime: Any | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.name, self.config = name, config
        self.worker_id = f"{name}-{os.urandom(3).hex()}"
        self.node = socket.gethostname()
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.work = config.path("work_dir") / fleet_key(self.state_dir) / name
        self.work.mkdir(parents=True, exist_ok=True, mode=0o700)
        if runtime is None:
            kwargs: dict[str, Any] = {  # within its lease slots, sandboxes started ahead
                "state_dir": self.work / "runtime", "max_sandboxes": config.cpus_per_node,
                "ready": ready_default(1)}
            if config.runtime == "local":
                kwargs["cache_dir"] = config.path("cache_dir")
            elif config.apptainer_allow_root:
                kwargs["allow_host_root"] = True
            runtime = get_runtime(config.runtime, **kwargs)
        self.runtime, self.proxies = runtime, ProxyPool(config.proxy_upstream,
                                                        trust_node_ca=config.proxy_node_ca)
        self.leases: dict[str, Held] = {}
        self.lost: dict[str, str] = {}
        self.executor = ThreadPoolExecutor(max_workers=max(16, 4 * config.cpus_per_node),
                                           thread_name_prefix="worker")
        self.token = ""
        self.address = ""
        self._server: Server | None = None
        self._conn: Connection | None = None
        self._stopping = asyncio.Event()
        self._leaving = ""
        self._tasks: set[asyncio.Task] = set()
        self.ends_at = _job_end_time()

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- lifecycle

    async def run(self) -> None:
        write_private(self.work / "worker.json", json.dumps({
            "pid": os.getpid(), "pid_start": proc_start_time(os.getpid()),
            "worker_id": self.worker_id, "state_dir": str(self.state_dir)}))
        if self.job_id and self.ends_at is None:
            self.ends_at = await self._call(_squeue_end_time, self.job_id)
        old = await self._call(self.runtime.reap, ())
        if old:
            log.warning("reaped %d sandboxes left by an earlier run: %s", len(old), old)
        for line in await self._call(lambda: reap_dead_workers(
                self.work.parent, self.config, keep=self.name)):
            log.warning("%s", line)
        if hasattr(self.runtime, "prepare"):  # writable layers made ahead, in the background
            self.runtime.prepare(self.config.storage_mb)
        info = await self._wait_controller()
        if info is None:
            log.error("no controller in %s after %.0fs; exiting", self.state_dir,
                      self.config.worker_grace_s)
            return
        self.token = info.token
        self._server = Server(self.handle, self.token, name=f"worker {self.name}",
                              limits=self.config.wire_limits())
        host, port = await self._server.start(self.config.worker_host, 0)
        advertise = host if host not in ("0.0.0.0", "::") else \
            address_towards(parse_address(info.address)[0])
        self.address = f"{advertise}:{port}"
        log.info("worker %s serving at %s", self.worker_id, self.address)
        try:
            await self._heartbeats()
        finally:
            await self.shutdown()

    def request_stop(self, why: str = "") -> None:
        self._leaving = self._leaving or why
        self._stopping.set()

    async def shutdown(self) -> None:
        self._stopping.set()
        if self._leaving and self.leases:
            await self._say_goodbye()
        await asyncio.sleep(0.05)  # let a shutdown request's reply go out
        if self._server is not None:
            await self._server.close()
        leases = list(self.leases)
        await asyncio.gather(*(self._stop(lid, "worker shutting down") for lid in leases),
                             return_exceptions=True)
        await self._call(self.runtime.reap, ())
        if hasattr(self.runtime, "close"):  # what it made ahead goes too
            await self._call(self.runtime.close)
        if not await self._call(self.runtime.list_running):
            shutil.rmtree(self.work, ignore_errors=True)  # nothing left to find later
        for task in list(self._tasks):
            task.cancel()
        if self._conn is not None:
            await self._conn.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        log.info("worker %s stopped", self.worker_id)

    async def _say_goodbye(self) -> None:
        """Tell the controller this worker exits, so its leases fail now (NodeLost)."""
        try:
            conn = await self._controller()
            await conn.request(Heartbeat(id=new_id(), worker_id=self.worker_id,
                                         leaving=self._leaving), timeout=2)
        except (ConnectionError, OSError, RemoteError) as e:
            log.info("goodbye not delivered: %s", e)

    async def _wait_controller(self):
        deadline = time.monotonic() + self.config.worker_grace_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            info = read_controller_info(self.state_dir)
            if info is not None:
                return info
            await asyncio.sleep(min(self.config.heartbeat_s, 1.0))
        return None

    async def _controller(self) -> Connection:
        info = read_controller_info(self.state_dir)
        if info is None:
            raise ConnectionRefusedError(f"no controller.json in {self.state_dir}")
        if self._conn is not None and (self._conn.closed or self._conn.address != info.address
                                       or self._conn.token != info.token):
            await self._conn.close()
            self._conn = None
        if self._conn is None:
            self._conn = await Connection.open(info.address, info.token, timeout=5)
        return self._conn

    def _activity(self) -> dict[str, LeaseActivity]:
        return {lid: held.activity() for lid, held in self.leases.items() if lid not in self.lost}

    async def _register(self, conn: Connection) -> None:
        """Register with the controller; stop the leases reported to it that it does not
        know. Only those: the controller grants leases to this worker as soon as it has
        registered it, and their creates can arrive before this reply (its ``keep``
        cannot name them)."""
        reported = self._activity()
        reply, _ = await conn.request(Register(
            id=new_id(), worker_id=self.worker_id, name=self.name, address=self.address,
            node=self.node, slots=self.config.cpus_per_node,
            memory_mb=self.config.memory_mb_per_node, job_id=self.job_id,
            ends_at=self.ends_at, leases=reported), timeout=10)
        keep = set(parse_result(RegisterReply, reply).keep)
        for lease_id in reported:
            if lease_id not in keep and lease_id in self.leases:
                self._spawn(self._stop(lease_id, "the controller does not know its lease"))

    async def _heartbeats(self) -> None:
        registered = False
        last_ok = time.monotonic()
        checked = 0.0
        while not self._stopping.is_set():
            try:
                conn = await self._controller()
                if not registered:
                    await self._register(conn)
                    registered = True
                lost = dict(self.lost)
                result, _ = await conn.request(Heartbeat(
                    id=new_id(), worker_id=self.worker_id, leases=self._activity(), lost=lost),
                    timeout=max(2.0, 2 * self.config.heartbeat_s))
                reply = parse_result(HeartbeatReply, result)
                last_ok = time.monotonic()
                for lease_id, reason in lost.items():
                    if self.lost.get(lease_id) == reason:
                        del self.lost[lease_id]
                        self._spawn(self._stop(lease_id, "lost"))
                if not reply.known:
                    registered = False
                    continue
                for lease_id in reply.stop:
                    self._spawn(self._stop(lease_id, "the controller ended its lease"))
            except (ConnectionError, OSError, RemoteError) as e:
                registered = registered and not isinstance(e, RemoteError)
                silent = time.monotonic() - last_ok
                log.warning("controller unreachable for %.1fs: %s", silent, e)
                if silent > self.config.worker_grace_s:
                    log.error("controller gone past the %.0fs grace: shutting down",
                              self.config.worker_grace_s)
                    self._leaving = ""  # nobody to tell
                    return
            if time.monotonic() - checked > 2.0:
                checked = time.monotonic()
                await self._check_sandboxes()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.heartbeat_s)

    async def _check_sandboxes(self) -> None:
        """Report leases whose sandbox died (max lifetime, killed processes). Only those
        with no operation under way while the list was taken: one may take the sandbox down
        for a while (Apptainer's verify stops the agent's instance and starts it again), and
        an operation that fails reports its own loss (``_lost_or``)."""
        quiet = {lid: held.ops for lid, held in self.leases.items() if held.running == 0}
        try:
            running = set(await self._call(self.runtime.list_running))
        except Exception as e:  # noqa: BLE001 - a runtime hiccup must not end the loop
            log.warning("list_running: %s", e)
            return
        for lease_id, held in list(self.leases.items()):
            if held.ready is not None and held.ready.done() and not held.ready.exception() \
                    and lease_id not in running and lease_id not in self.lost \
                    and held.running == 0 and quiet.get(lease_id) == held.ops:
                held.lost = self.lost[lease_id] = "the sandbox is no longer running"

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests

    async def handle(self, req: Any, payload: bytes, peer: Peer):
        if isinstance(req, Exec):
            return await self._exec(req)
        if isinstance(req, Put):
            return await self._put(req, payload)
        if isinstance(req, Get):
            return await self._get(req)
        if isinstance(req, Verify):
            return await self._verify(req, payload)
        if isinstance(req, StartSandbox):
            return await self._start(req)
        if isinstance(req, StopSandbox):
            await self._stop(req.lease_id, req.reason)
            return StopReply()
        if isinstance(req, Ping):
            return {"role": "worker", "worker_id": self.worker_id, "leases": len(self.leases)}
        if isinstance(req, Shutdown):
            self._stopping.set()
            return ShutdownReply()
        raise BadRequest(f"a worker does not serve {req.type!r}")

    def _held(self, lease_id: str) -> Held:
        held = self.leases.get(lease_id)
        if held is None or held.ready is None or not held.ready.done() \
                or held.ready.exception() is not None:
            raise UnknownLease(f"worker {self.worker_id} runs no sandbox for {lease_id}")
        if held.lost:
            raise SandboxLost(lease_id, held.lost)
        return held

    async def _start(self, req: StartSandbox) -> StartReply:
        held = self.leases.get(req.lease_id)
        if held is not None:  # a retried start: wait for the first one
            assert held.ready is not None  # every Held of self.leases is made with it, below
            await asyncio.shield(held.ready)
            return StartReply()
        if self._stopping.is_set():
            raise BadRequest("worker shutting down")
        try:
            spec = SandboxSpec.from_dict(req.spec.model_dump())
        except (TypeError, ValueError) as e:
            raise BadRequest(f"bad sandbox spec: {e}") from None
        ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        held = Held(req.lease_id, spec, ready=ready)
        self.leases[req.lease_id] = held
        try:
            await self._call(self.runtime.start, req.lease_id, spec)
            await self.proxies.open(req.lease_id, self.runtime, spec.allowed_hosts)
            shell = AsyncShellSession(self.runtime, req.lease_id, cwd=spec.workdir,
                                      executor=self.executor)
            await shell.start()
        except BaseException as e:
            self.leases.pop(req.lease_id, None)
            ready.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
            ready.exception()
            await self.proxies.close(req.lease_id, done=True)
            await self._call(self.runtime.stop, req.lease_id)
            raise
        held.shell = shell
        held.touch()
        ready.set_result(True)
        if self.leases.get(req.lease_id) is not held:  # stopped while starting
            await self._teardown(held)
        return StartReply()

    async def _stop(self, lease_id: str, reason: str) -> None:
        held = self.leases.pop(lease_id, None)
        self.lost.pop(lease_id, None)
        if held is None:
            return
        log.info("stopping %s: %s", lease_id, reason)
        if held.ready is not None and not held.ready.done():
            return  # _start tears it down when it finishes
        await self._teardown(held)

    async def _teardown(self, held: Held) -> None:
        await self.proxies.close(held.lease_id, done=True)
        if held.shell is not None:
            with contextlib.suppress(Exception):
                await held.shell.close()
        await self._call(self.runtime.stop, held.lease_id)

    async def _exec(self, req: Exec):
        held = self._held(req.lease_id)
        async with held.lock:
            held.running += 1
            held.ops += 1
            held.touch()
            try:
                result: ExecResult = await held.shell.run(req.command, req.timeout)
            except InfraError as e:
                raise await self._lost_or(held, e) from None
            finally:
                held.running -= 1
                held.touch()
        reply = ExecReply(exit_code=result.exit_code, timed_out=result.timed_out,
                          oom=result.oom, duration_s=result.duration_s)
        return reply, result.output.encode("utf-8", "replace")

    async def _pinned(self, held: Held, work):
        """``work()`` in the executor as the lease's one operation at a time, pinning it
        (no expiry while it runs); an infrastructure error as ``_lost_or`` explains it."""
        async with held.lock:
            held.running += 1
            held.ops += 1
            try:
                return await self._call(work)
            except InfraError as e:
                raise await self._lost_or(held, e) from None
            finally:
                held.running -= 1
                held.touch()

    def _mark_lost(self, held: Held, reason: str) -> None:
        if self.leases.get(held.lease_id) is held:
            held.lost = self.lost[held.lease_id] = reason

    async def _lost_or(self, held: Held, error: InfraError) -> InfraError:
        """After an infrastructure error under a lease: SandboxLost (reported in the next
        heartbeat) if its sandbox is gone, else ``error`` as it is."""
        if isinstance(error, SandboxLost):
            self._mark_lost(held, error.reason)
            return error
        if held.lease_id in await self._call(self.runtime.list_running):
            return error
        lost = SandboxLost(held.lease_id, f"the sandbox died ({error})")
        self._mark_lost(held, lost.reason)
        return lost

    async def _put(self, req: Put, payload: bytes) -> FileReply:
        dest = _abs_path(req.path)
        if "/" in req.name or req.name in (".", ".."):
            raise BadRequest(f"put: bad name {req.name!r}")
        held = self._held(req.lease_id)
        held.touch()

        def work() -> None:
            with tempfile.TemporaryDirectory(dir=self._xfer_dir()) as tmp:
                src = unpack_checked(payload, req.name, Path(tmp))
                self.runtime.copy_in(req.lease_id, src, dest)

        await self._pinned(held, work)
        return FileReply(path=dest, bytes=len(payload))

    async def _get(self, req: Get):
        src = _abs_path(req.path)
        held = self._held(req.lease_id)
        held.touch()

        def work() -> bytes:
            name = posixpath.basename(src)
            with tempfile.TemporaryDirectory(dir=self._xfer_dir()) as tmp:
                local = Path(tmp) / "out" / name
                self.runtime.copy_out(req.lease_id, src, local)
                return tar_bounded(local, name, MAX_PAYLOAD_BYTES)

        data = await self._pinned(held, work)
        return FileReply(path=src, bytes=len(data)), data

    async def _verify(self, req: Verify, payload: bytes):
        if "/" in req.name or req.name in (".", ".."):
            raise BadRequest(f"verify: bad name {req.name!r}")
        held = self._held(req.lease_id)
        held.touch()
        await self.proxies.close(req.lease_id)  # the verifier keeps its own (offline) policy

        def work() -> tuple[ExecResult, bytes]:
            with tempfile.TemporaryDirectory(dir=self._xfer_dir()) as tmp:
                tests = unpack_checked(payload, req.name, Path(tmp) / "in")
                logs = Path(tmp) / "verifier"
                logs.mkdir()
                result = self.runtime.verify(req.lease_id, list(req.command), tests=tests,
                                             logs=logs, timeout=req.timeout, cwd=req.cwd,
                                             env=dict(req.env), agent_system=req.agent_system,
                                             user=req.user)
                return result, tar_bounded(logs, "verifier", MAX_PAYLOAD_BYTES)

        result, data = await self._pinned(held, work)
        await self.proxies.reopen(req.lease_id, self.runtime, held.spec.allowed_hosts)
        reply = VerifyReply(exit_code=result.exit_code, timed_out=result.timed_out,
                            oom=result.oom, duration_s=result.duration_s,
                            output=cap_output(result.output.encode(), VERIFY_OUTPUT_BYTES))
        return reply, data

    def _xfer_dir(self) -> Path:
        path = self.work / "xfer"
        path.mkdir(exist_ok=True)
        return path


def _abs_path(path: str) -> str:
    norm = posixpath.normpath(path)
    if not path.startswith("/") or norm in ("/", "//"):
        raise BadRequest(f"need an absolute path to a file or directory, not {path!r}")
    return norm


def _job_end_time() -> float | None:
    value = os.environ.get("SLURM_JOB_END_TIME")
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _squeue_end_time(job_id: str) -> float | None:
    """When Slurm job ``job_id`` hits its time limit (epoch seconds), from squeue."""
    try:
        return SlurmClient(30).end_time(job_id)
    except ValueError:  # not a job id
        return None


def worker_alive(work_dir: Path) -> bool:
    """Whether the worker that owns ``work_dir`` (its worker.json) still runs."""
    try:
        data = json.loads((work_dir / "worker.json").read_text())
        return proc_start_time(int(data["pid"])) == data["pid_start"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def reap_dead_workers(root: Path, config: FleetConfig, *, keep: str = "",
                      min_age_s: float = 3600.0) -> list[str]:
    """Stop the sandboxes of this fleet's dead workers on this node and remove their work
    dirs (``root`` = ``work_dir/<fleet key>``). A dir whose worker.json names a live
    process is kept, and so is one without worker.json younger than ``min_age_s`` (a
    worker starting now). What was removed, one line each."""
    done = []
    for work in sorted(root.iterdir()) if root.is_dir() else []:
        if not work.is_dir() or work.name == keep or worker_alive(work):
            continue
        if not (work / "worker.json").exists():
            try:
                if time.time() - work.stat().st_mtime < min_age_s:
                    continue
            except OSError:
                continue
        kwargs: dict[str, Any] = {"state_dir": work / "runtime"}
        if config.runtime == "local":
            kwargs["cache_dir"] = config.path("cache_dir")
        try:
            reaped = get_runtime(config.runtime, **kwargs).reap(())
        except Exception as e:  # noqa: BLE001 - one bad dir must not stop the others
            log.warning("reaping %s: %s", work, e)
            continue
        shutil.rmtree(work, ignore_errors=True)
        done.append(f"removed dead worker dir {work} ({len(reaped)} sandboxes reaped)")
    return done


def run_worker(state_dir: Path, name: str, config: FleetConfig | None = None) -> None:
    """``sandfleet worker``: run until shutdown, SIGTERM, or the controller's grace ends."""
    config = config or fleet_config_of(state_dir)

    async def main() -> None:
        worker = Worker(state_dir, name, config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            loop.add_signal_handler(sig, worker.request_stop,
                                    f"{signal.Signals(sig).name} (job cancelled, preempted or "
                                    "at its time limit)")
        await worker.run()

    run_event_loop(main())

