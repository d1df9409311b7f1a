"""The controller's core: request handling and the wiring of its parts.

One ``Controller`` per fleet (an asyncio daemon) answers workers and clients; see the
package doc for what it owns. The parts it wires: the ``Registry`` of records
(``state``), the ``LeaseDesk`` that acquires, grants, renews, releases and ends leases
(``leasing``, over the ``Queues`` and placement decisions of ``placement``), the
``Journal`` (``journal``: typed events, one replay), the ``WorkerPool`` of worker
connections (``pool``), the liveness checks (``monitor``) and, when it has a provider, the
``Scaler`` (``scaler``), which sees it through the ``FleetView`` this class implements.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TypeGuard

from sandfleet.config import CONFIG_FILE, FleetConfig
from sandfleet.controller import monitor
from sandfleet.controller.journal import (
    JOURNAL,
    Event,
    FleetDown,
    JobEnded,
    Journal,
    NodeEnded,
    load,
    replay,
    rewrite,
)
from sandfleet.controller.leasing import LeaseDesk
from sandfleet.controller.pool import WorkerPool
from sandfleet.controller.scaler import Scaler
from sandfleet.controller.state import Job, Lease, Node, Registry
from sandfleet.discovery import ControllerInfo, read_controller_info, write_private
from sandfleet.errors import (
    BadRequest,
    NodeLost,
    SandboxLost,
)
from sandfleet.providers.base import Provider
from sandfleet.runtime.base import proc_start_time
from sandfleet.wire.messages import (
    Acquire,
    Heartbeat,
    LeaseActivity,
    Ping,
    Register,
    Release,
    Renew,
    Shutdown,
    Status,
    new_id,
)
from sandfleet.wire.server import Peer, Server
from sandfleet.wire.transport import run_event_loop

log = logging.getLogger(__name__)

LOCK_FILE = "controller.lock"
COMPACT_AFTER = 200_000
"""Journal lines after which the running controller rewrites it as a snapshot."""


def controller_alive(info: ControllerInfo | None) -> TypeGuard[ControllerInfo]:
    """Whether ``info``'s controller process still runs (True: ``info`` is not None)."""
    return info is not None and info.pid > 0 and proc_start_time(info.pid) == info.pid_start


class Controller:
    """The fleet's daemon. ``await Controller(state_dir, config).run()`` serves until
    ``down`` (or a signal); see the package doc."""

    def __init__(self, state_dir: Path, config: FleetConfig, provider: Provider | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.config = config
        self.provider = provider
        self.token = ""
        self.address = ""
        self.reg = Registry()
        self.started = time.time()
        self.scaler: Scaler | None = None
        self._stopping = asyncio.Event()
        self._pool = WorkerPool(self._stopping)
        self.desk = LeaseDesk(self.reg, config, self._pool, self)
        self._server: Server | None = None
        self._journal: Journal | None = None
        self._tasks: set[asyncio.Task] = set()
        self._down = False
        self._lock_fd = -1

    # ---- what the scaler (and a reader) sees: the FleetView

    @property
    def nodes(self) -> Mapping[str, Node]:
        return self.reg.nodes

    @property
    def leases(self) -> Mapping[str, Lease]:
        return self.reg.leases

    @property
    def jobs(self) -> Mapping[str, Job]:
        return self.reg.jobs

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def queued_cpus(self) -> int:
        return self.desk.queues.cpus()

    def take_worker_index(self) -> int:
        index = self.reg.next_index
        self.reg.next_index += 1
        return index

    async def add_job(self, job: Job) -> None:
        self.reg.jobs[job.job_id] = job
        await self._log(job.record())

    async def job_ended(self, job_id: str) -> None:
        self.reg.jobs.pop(job_id, None)
        await self._log(JobEnded(job_id))

    def drain_node(self, node: Node) -> None:
        node.state = "draining"
        self.reg.index(node)

    async def release_node(self, node: Node, why: str) -> None:
        self.drain_node(node)
        try:
            await self._pool.rpc(node, Shutdown(id=new_id(), reason=why), timeout=10)
        except Exception as e:  # noqa: BLE001 - logged; the scaler keeps going
            log.debug("shutdown %s: %s", node.worker_id, e)
        self.node_gone(node, f"released: {why}")

    def note_failure(self, cause: str, message: str, *, count: bool = True) -> None:
        self.reg.note(cause, message, count=count)

    # ---- startup and shutdown

    async def run(self) -> None:
        await self.start()
        try:
            await self._stopping.wait()
        finally:
            await self.stop()

    async def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.state_dir, 0o700)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        self._lock_fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            info = read_controller_info(self.state_dir)
            raise RuntimeError(f"a controller already runs on {self.state_dir}"
                               + (f" (pid {info.pid}, {info.address})" if info else "")) from None
        old = read_controller_info(self.state_dir)
        self.token = self._pool.token = old.token if old else secrets.token_urlsafe(32)
        write_private(self.state_dir / CONFIG_FILE, self.config.model_dump_json(indent=1))
        self.recover()
        self._journal = Journal(self.state_dir / JOURNAL)
        self._server = Server(self.handle, self.token, name="controller",
                              limits=self.config.wire_limits())
        port = self.config.port
        if old and not port:
            with contextlib.suppress(ValueError):
                port = int(old.address.rpartition(":")[2])
        try:
            _, port = await self._server.start(self.config.host, port)
        except OSError:
            _, port = await self._server.start(self.config.host, self.config.port)
        self.address = f"{advertised_host(self.config)}:{port}"
        info = ControllerInfo(address=self.address, token=self.token, pid=os.getpid(),
                              pid_start=proc_start_time(os.getpid()), host=socket.gethostname(),
                              started_at=self.started)
        write_private(self.state_dir / "controller.json", info.model_dump_json(indent=1))
        if self.provider is not None:
            self.scaler = Scaler(self, self.provider)
            self._spawn(self.scaler.run(), "scaler")
        self._spawn(self._monitor(), "monitor")
        log.info("controller up at %s (state %s, %d nodes and %d leases recovered)",
                 self.address, self.state_dir, len(self.reg.nodes), len(self.reg.leases))

    def request_stop(self) -> None:
        self._stopping.set()

    def _owner_gone(self) -> bool:
        pid = self.config.owner_pid
        return pid is not None and proc_start_time(pid) != self.config.owner_start

    async def stop(self) -> None:
        """Stop serving. After ``down`` everything is released first (see ``_down_all``)."""
        if self._down:
            await self._down_all()
        tasks = [*self._tasks, *self._pool.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.close()
        await self._pool.close()
        if self._journal is not None:
            await self._journal.close()
        if self._down:
            rewrite(self.state_dir / JOURNAL, [FleetDown(t=time.time())])
            info = read_controller_info(self.state_dir)
            if info is not None and info.pid == os.getpid():
                (self.state_dir / "controller.json").unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    async def _down_all(self) -> None:
        """``sandfleet down``: fail waiters, end leases, stop workers, cancel jobs."""
        for task in list(self._tasks):  # the scaler first: it would replace the workers
            if task.get_name() == "scaler":
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.desk.close_all()
        stops = [self._pool.rpc(node, Shutdown(id=new_id(), token=self.token,
                                               reason="fleet down"), timeout=30)
                 for node in self.reg.nodes.values() if node.state in ("up", "draining")]
        await asyncio.gather(*stops, return_exceptions=True)
        if self.scaler is not None:
            await self.scaler.cancel_all()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    # ---- the journal

    def recover(self) -> None:
        """Rebuild state from the journal and compact it to what is still live."""
        path = self.state_dir / JOURNAL
        self.reg.restore(replay(load(path)), time.time(), time.monotonic())
        rewrite(path, self.reg.snapshot(round(time.time(), 3)))

    async def _compact(self) -> None:
        assert self._journal is not None
        await self._journal.swap(self.reg.snapshot(round(time.time(), 3)))
        log.info("journal compacted")

    def commit(self, event: Event) -> asyncio.Future:
        """Journal ``event`` (group commit): the ``LeaseHost``'s."""
        assert self._journal is not None
        return self._journal.commit(event)

    def log_later(self, event: Event) -> None:
        """Journal ``event`` in a task of its own."""
        self._spawn(self._log(event), "journal")

    async def _log(self, event) -> None:
        assert self._journal is not None
        try:
            await self._journal.append(event)
        except OSError:
            pass  # logged by the journal; the fleet keeps serving

    # ---- requests

    def handle(self, req, payload: bytes, peer: Peer):
        """The ``Server``'s handler: what can be answered at once is (no task for a
        heartbeat or a renew); acquire and release answer once their grant or end is
        journaled."""
        if isinstance(req, Heartbeat):
            return self._heartbeat(req)
        if isinstance(req, Acquire):
            return self.desk.acquire(req, peer)
        if isinstance(req, Release):
            return self.desk.release(req.lease_id)
        if isinstance(req, Renew):
            return self.desk.renew(req.lease_id)
        if isinstance(req, Ping):
            return {"role": "controller", "address": self.address}
        if isinstance(req, Register):
            return self._register(req)
        if isinstance(req, Status):
            return self.status()
        if isinstance(req, Shutdown):
            self._down = True
            self._stopping.set()
            return {"stopping": True}
        raise BadRequest(f"the controller does not serve {req.type!r}")

    # ---- workers: register, heartbeat, lost, gone

    async def _register(self, req: Register) -> dict:
        reg, mono = self.reg, time.monotonic()
        other = reg.nodes.get(reg.by_name.get(req.name, ""))
        if other is not None and other.worker_id != req.worker_id \
                and other.state in ("up", "draining"):
            self.node_lost(other, "its worker restarted")  # it replaces its old self
        reg.by_name[req.name] = req.worker_id
        node = reg.nodes.get(req.worker_id)
        if node is None or node.state in ("lost", "gone"):
            node = Node(req.worker_id, req.name, req.address, req.node, req.slots,
                        req.memory_mb, req.job_id, req.ends_at, registered_at=time.time())
            reg.nodes[req.worker_id] = node
            reg.index(node)
            await self._log(node.record())
            log.info("worker %s registered: %s at %s, %d slots", req.worker_id, req.node,
                     req.address, req.slots)
        else:
            node.address, node.slots, node.memory_mb = req.address, req.slots, req.memory_mb
            reg.index(node)
        node.last_seen = mono
        if self.scaler is not None:
            self.scaler.worker_registered(node)
        keep = self._reconcile(node, req.leases, {})
        self.desk.schedule()
        return {"known": True, "keep": keep, "heartbeat_s": self.config.heartbeat_s}

    def _heartbeat(self, req: Heartbeat) -> dict:
        node = self.reg.nodes.get(req.worker_id)
        if node is None or node.state in ("lost", "gone"):
            return {"known": False}
        node.last_seen = time.monotonic()
        if req.leaving:
            self.node_lost(node, f"its worker is exiting: {req.leaving}")
            return {"known": False}
        keep = self._reconcile(node, req.leases, req.lost)
        stop = [lid for lid in req.leases if lid not in keep]
        return {"known": True, "stop": stop, "drain": node.state == "draining"}

    def _reconcile(self, node: Node, reported: dict[str, LeaseActivity],
                   lost: dict[str, str]) -> list[str]:
        """Renew what the worker reports active; end what it lost; the ids it should keep."""
        keep, gone = monitor.reconcile(node, reported, lost, self.reg.leases, now=time.time(),
                                       heartbeat_s=self.config.heartbeat_s)
        for lease, reason in gone:
            self.desk.end_logged(lease, "sandbox_lost", SandboxLost(lease.lease_id,
                                                                reason).to_dict(), stop=False)
        return keep

    def node_lost(self, node: Node, reason: str) -> None:
        """A node that failed (silent, exited, its job ended): its leases end as lost and
        the scaler replaces it."""
        if node.state in ("lost", "gone"):
            return
        node.state = "lost"
        self.reg.index(node)
        log.warning("worker %s (%s) lost: %s", node.worker_id, node.node, reason)
        self.reg.note("node_lost", reason, node=node.node, count=False)
        self._forget(node, reason)
        if self.scaler is not None:
            self.scaler.worker_lost(node)
        self.desk.schedule()

    def node_gone(self, node: Node, reason: str) -> None:
        """A node released on purpose (idle, down): forgotten without a failure."""
        node.state = "gone"
        self.reg.index(node)
        self._forget(node, reason)
        self.reg.nodes.pop(node.worker_id, None)

    def _forget(self, node: Node, reason: str) -> None:
        """End the node's leases as lost, journal its end, close its connection."""
        for lease_id in list(node.leases):
            lease = self.reg.leases.get(lease_id)
            if lease is not None:
                self.desk.end_logged(lease, "node_lost", NodeLost(node.node, reason).to_dict(),
                                 stop=False)
        self.log_later(NodeEnded(node.worker_id, reason))
        conn = self._pool.forget(node.worker_id)
        if conn is not None:
            self._spawn(conn.close(), "close")

    # ---- the monitor: lost nodes, expired leases, compaction

    async def _monitor(self) -> None:
        period = min(self.config.heartbeat_s / 2, 0.5)
        while True:
            await asyncio.sleep(period)
            self.check(time.time(), time.monotonic())
            if self._owner_gone():
                log.warning("owner pid %s is gone: taking the fleet down", self.config.owner_pid)
                self._down = True
                self._stopping.set()
            if self._journal is not None and self._journal.lines > COMPACT_AFTER:
                await self._compact()

    def check(self, now: float, mono: float) -> None:
        lost, forget = monitor.silent_nodes(list(self.reg.nodes.values()), mono,
                                            self.config.lost_after_s)
        for node, reason in lost:
            self.node_lost(node, reason)
        for node in forget:
            self.reg.nodes.pop(node.worker_id, None)  # kept a while for status
        for lease, cause, error in monitor.due_leases(list(self.reg.leases.values()), now):
            self.desk.end_logged(lease, cause, error)

    # ---- status

    def status(self) -> dict:
        now = time.time()
        return {"address": self.address, "pid": os.getpid(), "state_dir": str(self.state_dir),
                "provider": self.config.provider, "uptime_s": round(now - self.started, 1),
                **monitor.status_report(self.reg, queued=self.desk.queues.count(),
                                        queued_by_client=self.desk.queues.by_client(), now=now,
                                        mono=time.monotonic())}



def advertised_host(config: FleetConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    if config.host in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()
    return config.host


def serve_forever(state_dir: Path, config: FleetConfig, provider: Provider | None) -> None:
    """Run a controller in this process until ``down`` or SIGTERM/SIGINT."""

    async def main() -> None:
        controller = Controller(state_dir, config, provider)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, controller.request_stop)
        await controller.run()

    run_event_loop(main())
