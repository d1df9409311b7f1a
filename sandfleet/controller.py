"""The fleet controller: one asyncio daemon per fleet, owning lifecycle (nodes, leases).

It never runs a command in a sandbox: workers serve exec and files to clients directly.
What it owns:

- **Nodes**: workers register (id, address, slots = CPUs, memory, provider job) and
  heartbeat every ``heartbeat_s``; one silent for ``lost_after_s`` is *lost*: its leases
  end with ``NodeLost`` (recorded, so the holder's next renew or exec raises it at once)
  and its job is cancelled so the scaler replaces it.
- **Leases**: ``acquire`` queues FIFO per client, clients served round-robin, until a
  worker slot fits (best fit, so idle nodes can drain), asks that worker to start the
  sandbox and answers with the grant; ``CapacityTimeout`` after ``wait_s``. Expiry = last
  renewal + ttl; a renew, or a worker heartbeat reporting an exec or a running command
  (which pins the lease), renews. An expired lease's sandbox is destroyed via its worker
  and the reason recorded. Release is idempotent; a repeated acquire id answers with the
  lease it already got.
- **Scaling** (``Scaler``): desired workers = ceil((queued + held) CPUs / cpus_per_node)
  within [min_nodes, max_nodes]; the provider submits the difference, a few per tick;
  workers idle past ``idle_s`` are released; lost ones are cancelled and so replaced. One
  batched provider poll per interval, backing off while nothing changes.
- **State dir**: ``controller.json`` (address, token; 0600, atomic), ``journal.jsonl``
  (append-only, fsync'd by group commit, rewritten as a snapshot at start and every
  ``COMPACT_AFTER`` events), ``fleet.json`` (the resolved
  config, read by workers), ``logs/``. A restarted controller rebuilds nodes, leases and
  jobs from the journal, keeps its token and tries its old port; renewals are not
  journaled, so recovered leases count as renewed at recovery (downtime never expires a
  lease) and recovered nodes get ``lost_after_s`` to heartbeat again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any

from pydantic_core import to_json

from sandfleet.config import FleetConfig
from sandfleet.errors import CapacityTimeout, InfraError, LeaseExpired, NodeLost, SandboxLost
from sandfleet.protocol import (
    Acquire,
    BadRequest,
    Connection,
    ControllerInfo,
    Heartbeat,
    LeaseActivity,
    LeaseClosed,
    Peer,
    Ping,
    Register,
    Release,
    Renew,
    Server,
    Shutdown,
    StartSandbox,
    Status,
    StopSandbox,
    new_id,
    read_controller_info,
    run_event_loop,
    settle,
    write_private,
)
from sandfleet.runtime.base import proc_start_time

log = logging.getLogger(__name__)

JOURNAL = "journal.jsonl"
CONFIG_FILE = "fleet.json"
LOCK_FILE = "controller.lock"
ENDED_KEEP = 100_000
"""Ended leases remembered (so a late renew learns why its lease ended)."""
RECENT_FAILURES = 200
COMPACT_AFTER = 200_000
"""Journal lines after which the running controller rewrites it as a snapshot."""


def fleet_config_of(state_dir: Path) -> FleetConfig:
    """The resolved config a controller saved in ``state_dir``."""
    return FleetConfig.model_validate_json((Path(state_dir) / CONFIG_FILE).read_text())


def controller_alive(info: ControllerInfo | None) -> bool:
    return info is not None and info.pid > 0 and proc_start_time(info.pid) == info.pid_start


# ---- journal


class Journal:
    """Append-only JSON lines, fsync'd by group commit: ``commit(event)`` returns a future
    that resolves once the event (and every one before it) is on disk.

    One writer thread owns the file: the events committed in one turn of the event loop
    reach it as one batch, and it writes and fsyncs whatever batches wait when it is free
    (one fsync for all of them), so the loop never blocks on the disk and pays no executor
    round trip per batch. A snapshot swap is queued behind the writes before it.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._loop = asyncio.get_running_loop()
        self._lines: list[bytes] = []
        self._waiters: list[asyncio.Future] = []
        """This turn's events and their futures, not yet handed to the writer."""
        self._queue: SimpleQueue = SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="journal", daemon=True)
        self._writer.start()
        self._closed = False
        self.lines = 0
        """Events appended since the journal was last rewritten."""

    @staticmethod
    def load(path: Path) -> list[dict]:
        """Every event in the journal; a torn last line (a crash mid-write) is skipped."""
        events = []
        try:
            lines = path.read_bytes().splitlines()
        except FileNotFoundError:
            return []
        for i, line in enumerate(lines):
            try:
                event = json.loads(line)
            except ValueError:
                log.warning("%s: line %d unreadable, skipped", path, i + 1)
                continue
            if isinstance(event, dict) and "e" in event:
                events.append(event)
        return events

    @staticmethod
    def rewrite(path: Path, events: list[dict]) -> None:
        """Replace the journal with ``events`` (atomic: write, fsync, rename)."""
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, b"".join(to_json(e) + b"\n" for e in events))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def commit(self, event: dict) -> asyncio.Future:
        """Queue ``event``; the future resolves once it (and every event before it) is on
        disk, or fails with the OSError that kept it off (logged here)."""
        event.setdefault("t", round(time.time(), 3))
        line = to_json(event) + b"\n"
        future = self._loop.create_future()
        if self._closed:
            future.set_exception(OSError(f"journal {self.path} is closed"))
            return future
        if not self._lines:
            self._loop.call_soon(self._hand_over)
        self._lines.append(line)
        self._waiters.append(future)
        self.lines += 1
        return future

    async def append(self, event: dict) -> None:
        await self.commit(event)

    def _hand_over(self) -> None:
        if self._lines:
            self._queue.put(("write", b"".join(self._lines), self._waiters))
            self._lines, self._waiters = [], []

    async def swap(self, events: list[dict]) -> None:
        """Replace the file with ``events``, a snapshot of the state now: what was committed
        before is written first (into the file the snapshot replaces), what comes after is
        appended to the snapshot (replay is idempotent)."""
        self._hand_over()
        done = self._loop.create_future()
        self._queue.put(("swap", events, [done]))
        await done
        self.lines = 0

    async def close(self) -> None:
        """Return once everything committed is written (or failed to be)."""
        if self._closed:
            return
        self._hand_over()
        self._closed = True
        done = self._loop.create_future()
        self._queue.put(("close", None, [done]))
        if self._writer.is_alive():
            await done

    def _write_loop(self) -> None:
        """The writer thread: batches in order, one fsync for all that wait."""
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            waiters = [w for item in batch for w in item[2]]
            error: OSError | None = None
            data: list[bytes] = []
            try:
                for kind, what, _ in batch:
                    if kind == "write":
                        data.append(what)
                        continue
                    self._sync(data)  # what came before a swap goes into the file it replaces
                    data = []
                    if kind == "swap":
                        Journal.rewrite(self.path, what)
                        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND, 0o600)
                        os.close(self._fd)
                        self._fd = fd
                self._sync(data)
            except Exception as e:  # noqa: BLE001 - the waiters get it; the writer goes on
                log.error("journal %s: %s", self.path, e)
                error = e if isinstance(e, OSError) else OSError(f"journal write failed: {e}")
            closing = any(item[0] == "close" for item in batch)
            if closing:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
            try:
                self._loop.call_soon_threadsafe(settle, waiters, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return
            if closing:
                return

    def _sync(self, data: list[bytes]) -> None:
        if data:
            _write_all(self._fd, b"".join(data))
            os.fsync(self._fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ---- state


@dataclass
class Node:
    worker_id: str
    name: str
    address: str
    node: str
    slots: int
    memory_mb: int
    job_id: str = ""
    ends_at: float | None = None
    registered_at: float = 0.0
    state: str = "up"
    """up | draining (no new leases; released when idle) | lost | gone."""
    last_seen: float = field(default_factory=time.monotonic)
    used_cpus: int = 0
    used_mb: int = 0
    leases: set[str] = field(default_factory=set)
    idle_since: float = field(default_factory=time.monotonic)
    unschedulable_until: float = 0.0
    bucket: int | None = None
    """Its key in the controller's free-CPU index (None when not schedulable)."""

    def record(self) -> dict:
        return {"e": "node", "worker_id": self.worker_id, "name": self.name,
                "address": self.address, "node": self.node, "slots": self.slots,
                "memory_mb": self.memory_mb, "job_id": self.job_id, "ends_at": self.ends_at,
                "registered_at": self.registered_at}

    def fits(self, cpus: int, memory_mb: int) -> bool:
        return self.used_cpus + cpus <= self.slots and self.used_mb + memory_mb <= self.memory_mb


@dataclass
class Lease:
    lease_id: str
    request_id: str
    client: str
    worker_id: str
    node: str
    address: str
    spec: dict
    cpus: int
    memory_mb: int
    ttl_s: float
    granted_at: float = 0.0
    queued_s: float = 0.0
    renewed_at: float = 0.0
    state: str = "starting"
    """starting | held."""
    pinned: bool = False

    @property
    def expires_at(self) -> float:
        return self.renewed_at + self.ttl_s

    def grant(self) -> dict:
        """A ``Grant``'s fields (built as a dict: this runs for every acquire and renew)."""
        return {"lease_id": self.lease_id, "sandbox_id": self.lease_id,
                "worker_id": self.worker_id, "worker_address": self.address, "node": self.node,
                "granted_at": self.granted_at, "queued_s": self.queued_s,
                "expires_at": self.expires_at, "ttl_s": self.ttl_s}

    def record(self) -> dict:
        return {"e": "grant", "lease_id": self.lease_id, "request_id": self.request_id,
                "client": self.client, "worker_id": self.worker_id, "node": self.node,
                "address": self.address, "spec": self.spec, "cpus": self.cpus,
                "memory_mb": self.memory_mb, "ttl_s": self.ttl_s,
                "granted_at": self.granted_at, "queued_s": self.queued_s}


@dataclass(eq=False)
class Waiter:
    request: Acquire
    client: str
    future: asyncio.Future
    wait_s: float
    enqueued: float = field(default_factory=time.monotonic)
    attempts: int = 0
    queued: bool = True
    """In its client's queue (not placed yet)."""
    timer: asyncio.TimerHandle | None = None
    """``CapacityTimeout`` at ``enqueued + wait_s``; armed only once it has to wait."""


@dataclass
class Job:
    job_id: str
    name: str
    index: int
    state: str = "pending"
    """pending | running | ended (the provider's view)."""
    submitted_at: float = field(default_factory=time.time)
    releasing: bool = False
    registered: bool = False
    """Its worker registered at least once."""


# ---- the controller


class Controller:
    """The fleet's daemon. ``await Controller(state_dir, config).run()`` serves until
    ``down`` (or a signal); see the module doc."""

    def __init__(self, state_dir: Path, config: FleetConfig, provider: Any | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.config = config
        self.provider = provider
        self.token = ""
        self.address = ""
        self.nodes: dict[str, Node] = {}
        self.free: dict[int, dict[str, Node]] = {}
        self.by_name: dict[str, str] = {}
        """Schedulable nodes by free CPUs: placement scans buckets, not every node."""
        self.leases: dict[str, Lease] = {}
        self.ended: OrderedDict[str, dict] = OrderedDict()
        self.by_request: dict[str, str] = {}
        self.inflight: dict[str, asyncio.Future] = {}
        self.queues: OrderedDict[str, deque[Waiter]] = OrderedDict()
        self.jobs: dict[str, Job] = {}
        self.next_index = 0
        self.failures: Counter = Counter()
        self.recent: deque[dict] = deque(maxlen=RECENT_FAILURES)
        self.started = time.time()
        self._server: Server | None = None
        self._journal: Journal | None = None
        self._conns: dict[str, Connection] = {}
        self._conn_locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self._down = False
        self._lock_fd = -1
        self.scaler = None

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
        self.token = old.token if old else secrets.token_urlsafe(32)
        write_private(self.state_dir / CONFIG_FILE, self.config.model_dump_json(indent=1))
        self._recover()
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
            from sandfleet.providers import Scaler

            self.scaler = Scaler(self, self.provider)
            self._spawn(self.scaler.run(), "scaler")
        self._spawn(self._monitor(), "monitor")
        log.info("controller up at %s (state %s, %d nodes and %d leases recovered)",
                 self.address, self.state_dir, len(self.nodes), len(self.leases))

    def request_stop(self) -> None:
        self._stopping.set()

    def _owner_gone(self) -> bool:
        pid = self.config.owner_pid
        return pid is not None and proc_start_time(pid) != self.config.owner_start

    async def stop(self) -> None:
        """Stop serving. After ``down`` everything is released first (see ``_down_all``)."""
        if self._down:
            await self._down_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.close()
        for conn in self._conns.values():
            await conn.close()
        if self._journal is not None:
            await self._journal.close()
        if self._down:
            Journal.rewrite(self.state_dir / JOURNAL, [{"e": "down", "t": time.time()}])
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
        for queue in self.queues.values():
            for waiter in queue:
                self._fail_waiter(waiter, CapacityTimeout(
                    time.monotonic() - waiter.enqueued, "the fleet is shutting down"))
        self.queues.clear()
        for lease in list(self.leases.values()):
            self._end(lease, "released", {"error": "LeaseClosed",
                                          "message": "the fleet was shut down"})
        stops = [self._worker_rpc(node, Shutdown(id=new_id(), token=self.token,
                                                  reason="fleet down"), timeout=30)
                 for node in self.nodes.values() if node.state in ("up", "draining")]
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

    # ---- journal recovery

    def _recover(self) -> None:
        """Rebuild state from the journal and compact it to what is still live."""
        path = self.state_dir / JOURNAL
        events = Journal.load(path)
        nodes: dict[str, dict] = {}
        leases: dict[str, dict] = {}
        jobs: dict[str, dict] = {}
        ends: OrderedDict[str, dict] = OrderedDict()
        for ev in events:
            kind = ev["e"]
            if kind == "down":
                nodes.clear(), leases.clear(), jobs.clear(), ends.clear()
            elif kind == "node":
                nodes[ev["worker_id"]] = ev
            elif kind == "node_end":
                nodes.pop(ev["worker_id"], None)
            elif kind == "grant":
                leases[ev["lease_id"]] = ev
            elif kind == "end":
                leases.pop(ev["lease_id"], None)
                ends[ev["lease_id"]] = ev
            elif kind == "job":
                jobs[ev["job_id"]] = ev
                self.next_index = max(self.next_index, int(ev.get("index", 0)) + 1)
            elif kind == "job_end":
                jobs.pop(ev["job_id"], None)
            elif kind == "meta":
                self.next_index = max(self.next_index, int(ev.get("next_index", 0)))
        now, mono = time.time(), time.monotonic()
        for ev in nodes.values():
            data = {k: v for k, v in ev.items() if k not in ("e", "t")}
            self.nodes[ev["worker_id"]] = Node(**data, last_seen=mono, idle_since=mono)
        for ev in leases.values():
            data = {k: v for k, v in ev.items() if k not in ("e", "t")}
            lease = Lease(**data, renewed_at=now, state="held")
            node = self.nodes.get(lease.worker_id)
            if node is None:
                self._remember_end(lease.lease_id, "node_lost", NodeLost(
                    lease.node, "its worker was gone when the controller restarted").to_dict(),
                    lease.request_id)
                continue
            self.leases[lease.lease_id] = lease
            self.by_request[lease.request_id] = lease.lease_id
            node.leases.add(lease.lease_id)
            node.used_cpus += lease.cpus
            node.used_mb += lease.memory_mb
        for node in self.nodes.values():
            self._index(node)
            self.by_name[node.name] = node.worker_id
        for ev in list(ends.values())[-ENDED_KEEP:]:
            self._remember_end(ev["lease_id"], ev["cause"], ev["error"], ev.get("request_id"))
            if ev["cause"] not in ("released", "expired"):
                self.failures[ev["cause"]] += 1
        for ev in jobs.values():
            self.jobs[ev["job_id"]] = Job(ev["job_id"], ev["name"], int(ev.get("index", 0)),
                                          state="running", submitted_at=ev.get("t", now),
                                          registered=True)
        Journal.rewrite(path, self._snapshot())

    def _snapshot(self) -> list[dict]:
        """The journal of the present state: what a compacted journal holds."""
        now = round(time.time(), 3)
        return ([{"e": "meta", "next_index": self.next_index, "t": now}]
                + [{"e": "job", "job_id": j.job_id, "name": j.name, "index": j.index,
                    "t": j.submitted_at} for j in self.jobs.values() if j.state != "ended"]
                + [{**n.record(), "t": now} for n in self.nodes.values()
                   if n.state in ("up", "draining")]
                + [{**lease.record(), "t": now} for lease in self.leases.values()
                   if lease.state == "held"]
                + [{"e": "end", "lease_id": lease_id, **ended, "t": now}
                   for lease_id, ended in list(self.ended.items())[-1000:]])

    async def _compact(self) -> None:
        assert self._journal is not None
        await self._journal.swap(self._snapshot())
        log.info("journal compacted")

    def _remember_end(self, lease_id: str, cause: str, error: dict,
                      request_id: str | None = None) -> None:
        self.ended[lease_id] = {"cause": cause, "error": error, "request_id": request_id}
        self.ended.move_to_end(lease_id)
        if request_id:
            self.by_request[request_id] = lease_id
        while len(self.ended) > ENDED_KEEP:
            _, old = self.ended.popitem(last=False)
            if old.get("request_id"):
                self.by_request.pop(old["request_id"], None)

    def _journaled(self, event: dict, result: dict) -> asyncio.Future:
        """A future of ``result``, resolved once ``event`` is journaled (or failed to be:
        logged by the journal; the fleet keeps serving, as with ``_log``)."""
        assert self._journal is not None
        answer = asyncio.get_running_loop().create_future()

        def resolve(done: asyncio.Future) -> None:
            if not done.cancelled():
                done.exception()  # retrieved: logged by the journal
            if not answer.done():
                answer.set_result(result)

        self._journal.commit(event).add_done_callback(resolve)
        return answer

    async def _log(self, event: dict) -> None:
        assert self._journal is not None
        try:
            await self._journal.append(event)
        except OSError:
            pass  # logged by the journal; the fleet keeps serving

    # ---- requests

    def handle(self, req: Any, payload: bytes, peer: Peer):
        """The ``Server``'s handler: what can be answered at once is (no task for a
        heartbeat or a renew); acquire and release answer once their grant or end is
        journaled."""
        if isinstance(req, Heartbeat):
            return self._heartbeat(req)
        if isinstance(req, Acquire):
            return self._acquire(req, peer)
        if isinstance(req, Release):
            return self._release(req.lease_id)
        if isinstance(req, Renew):
            return self._renew(req.lease_id)
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

    # ---- leases

    def _max_cpus(self) -> tuple[int, int]:
        return self.config.cpus_per_node, self.config.memory_mb_per_node

    def _acquire(self, req: Acquire, peer: Peer) -> dict | asyncio.Future:
        """The answer to an acquire: at once for a repeated id whose lease exists, else a
        future of the grant (the asker's own: the server cancels it when the asker hangs
        up, which drops the wait if it is still queued)."""
        if req.id in self.by_request:
            return self._renew(self.by_request[req.id])
        if req.id in self.inflight:
            return _follow(self.inflight[req.id])
        max_cpus, max_mb = self._max_cpus()
        if req.cpus > max_cpus or req.memory_mb > max_mb:
            raise BadRequest(f"no node can hold {req.cpus} CPUs and {req.memory_mb} MB "
                             f"(nodes have {max_cpus} CPUs, {max_mb} MB)")
        if self._down or self._stopping.is_set():
            raise CapacityTimeout(0.0, "the fleet is shutting down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        future.add_done_callback(_retrieve)
        self.inflight[req.id] = future
        wait_s = self.config.acquire_wait_s if req.wait_s is None else req.wait_s
        waiter = Waiter(req, req.client or peer.address.rpartition(":")[0], future, wait_s)
        self.queues.setdefault(waiter.client, deque()).append(waiter)
        self._schedule()
        if waiter.queued:  # no slot for it now
            self._arm(waiter)
            if self.scaler is not None:
                self.scaler.kick()
        answer = _follow(future)
        answer.add_done_callback(functools.partial(self._asker_done, waiter))
        return answer

    def _asker_done(self, waiter: Waiter, answer: asyncio.Future) -> None:
        if answer.cancelled():  # the asker hung up: drop the wait if still queued
            queue = self.queues.get(waiter.client)
            if waiter.queued and queue is not None and waiter in queue:
                waiter.queued = False
                queue.remove(waiter)
                if not queue:
                    del self.queues[waiter.client]
                self._fail_waiter(waiter, CapacityTimeout(0.0, "the asker went away"))
        if waiter.future.done():
            self.inflight.pop(waiter.request.id, None)

    def _arm(self, waiter: Waiter) -> None:
        if waiter.timer is None:
            left = waiter.wait_s - (time.monotonic() - waiter.enqueued)
            waiter.timer = asyncio.get_running_loop().call_later(max(0.0, left),
                                                                 self._wait_timeout, waiter)

    def _wait_timeout(self, waiter: Waiter) -> None:
        queue = self.queues.get(waiter.client)
        if not waiter.queued or queue is None or waiter not in queue:
            return  # already placed: the start proceeds
        waiter.queued = False
        queue.remove(waiter)
        if not queue:
            del self.queues[waiter.client]
        up = sum(1 for n in self.nodes.values() if n.state == "up")
        self._fail_waiter(waiter, CapacityTimeout(
            time.monotonic() - waiter.enqueued,
            f"{self.queued_count()} others queued, {len(self.leases)} leases held on "
            f"{up} nodes (max {self.config.max_nodes})"))
        self.failures["capacity"] += 1

    def _fail_waiter(self, waiter: Waiter, error: Exception) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        if not waiter.future.done():
            waiter.future.set_exception(error)
        self.inflight.pop(waiter.request.id, None)

    def queued_count(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def queued_cpus(self) -> int:
        return sum(w.request.cpus for q in self.queues.values() for w in q)

    def _index(self, node: Node) -> None:
        """File ``node`` under its free CPUs (or nowhere unless it is up)."""
        if node.bucket is not None:
            bucket = self.free.get(node.bucket)
            if bucket is not None:
                bucket.pop(node.worker_id, None)
                if not bucket:
                    del self.free[node.bucket]
            node.bucket = None
        if node.state == "up" and self.nodes.get(node.worker_id) is node:
            node.bucket = node.slots - node.used_cpus
            self.free.setdefault(node.bucket, {})[node.worker_id] = node

    def _place(self, cpus: int, memory_mb: int) -> Node | None:
        """Best fit: a node with the fewest free CPUs that still holds the lease, so idle
        nodes stay idle and can be released; among equals the one filed last (the node
        that went idle most recently before those idle longer)."""
        now, mono = time.time(), time.monotonic()
        drain = self.config.slurm.drain_before_s if self.config.provider == "slurm" else 0
        for free in sorted(k for k in self.free if k >= cpus):
            for node in reversed(self.free[free].values()):
                if node.unschedulable_until > mono or not node.fits(cpus, memory_mb):
                    continue
                if node.ends_at is not None and node.ends_at - now < drain:
                    continue
                return node
        return None

    def _schedule(self) -> None:
        """Grant what fits: round-robin over clients, FIFO within each."""
        progress = True
        while progress and self.queues:
            progress = False
            for client in list(self.queues):
                queue = self.queues.get(client)
                if not queue:
                    self.queues.pop(client, None)
                    continue
                waiter = queue[0]
                node = self._place(waiter.request.cpus, waiter.request.memory_mb)
                if node is None:
                    continue
                queue.popleft()
                waiter.queued = False
                if not queue:
                    del self.queues[client]
                else:
                    self.queues.move_to_end(client)  # round-robin: this client goes last
                progress = True
                self._grant(waiter, node)

    def _grant(self, waiter: Waiter, node: Node) -> None:
        req = waiter.request
        lease_id = new_id("L")
        max_life = min(req.max_lifetime_s or self.config.max_lease_s, self.config.max_lease_s)
        spec = {"image": req.image, "cpus": req.cpus, "memory_mb": req.memory_mb,
                "storage_mb": req.storage_mb or self.config.storage_mb, "network": req.network, "max_lifetime_s": max_life, "env": dict(req.env),
                "workdir": req.workdir, "hostname": "sandbox"}
        lease = Lease(lease_id, req.id, waiter.client, node.worker_id, node.node, node.address,
                      spec, req.cpus, req.memory_mb, req.ttl_s or self.config.lease_ttl_s)
        self.leases[lease_id] = lease
        node.leases.add(lease_id)
        node.used_cpus += req.cpus
        node.used_mb += req.memory_mb
        self._index(node)
        self._start(waiter, lease, node)

    def _start(self, waiter: Waiter, lease: Lease, node: Node) -> None:
        """Ask the worker to start the lease's sandbox; ``_started`` goes on from there."""
        lease.queued_s = round(time.monotonic() - waiter.enqueued, 4)  # until a slot, not start
        started = self._worker_call(node, StartSandbox(
            id=new_id(), token=self.token, lease_id=lease.lease_id, spec=lease.spec),
            timeout=self.config.sandbox_start_timeout_s + 10)
        started.add_done_callback(functools.partial(self._started, waiter, lease, node))

    def _started(self, waiter: Waiter, lease: Lease, node: Node,
                 started: asyncio.Future) -> None:
        """The worker answered the start: journal the grant (then ``_granted``), or try
        another node, or fail the acquire."""
        if started.cancelled():
            return  # the controller stops
        e = started.exception()
        if isinstance(e, (ConnectionError, OSError)):  # TimeoutError included
            self._unreserve(lease, node)
            node.unschedulable_until = time.monotonic() + self.config.lost_after_s
            if waiter.attempts < 2 and not waiter.future.done() \
                    and not self._stopping.is_set():
                waiter.attempts += 1
                log.warning("start of %s on %s failed (%s); queued again", lease.lease_id,
                            node.worker_id, e)
                self.queues.setdefault(waiter.client, deque()).appendleft(waiter)
                self.queues.move_to_end(waiter.client, last=False)
                waiter.queued = True
                self._arm(waiter)
                self._schedule()
                return
            self._start_failed(waiter, NodeLost(node.node, f"sandbox start failed: {e}"))
            return
        if e is not None:  # ImageMissing, SandboxStartError...: they go to the asker
            self._unreserve(lease, node)
            self._start_failed(waiter, e)
            return
        if self.leases.get(lease.lease_id) is not lease:  # node lost or fleet down meanwhile
            self._start_failed(waiter, InfraError.from_dict(
                self.ended.get(lease.lease_id, {}).get("error")
                or NodeLost(node.node, "lost while the sandbox started").to_dict()))
            return
        now = time.time()
        lease.granted_at = lease.renewed_at = now
        lease.state = "held"
        self.by_request[waiter.request.id] = lease.lease_id
        assert self._journal is not None
        self._journal.commit(lease.record()).add_done_callback(
            functools.partial(self._granted, waiter, lease))

    def _granted(self, waiter: Waiter, lease: Lease, journaled: asyncio.Future) -> None:
        _retrieve(journaled)  # a journal error is logged there; the fleet keeps serving
        if waiter.timer is not None:
            waiter.timer.cancel()
        self.inflight.pop(waiter.request.id, None)
        if not waiter.future.done():
            waiter.future.set_result(lease.grant())

    def _unreserve(self, lease: Lease, node: Node) -> None:
        if self.leases.get(lease.lease_id) is lease:
            del self.leases[lease.lease_id]
            node.leases.discard(lease.lease_id)
            node.used_cpus -= lease.cpus
            node.used_mb -= lease.memory_mb
            self._index(node)
            if not node.leases:
                node.idle_since = time.monotonic()

    def _start_failed(self, waiter: Waiter, error: Exception) -> None:
        cause = getattr(error, "cause", "bad_request")
        self.failures[cause] += 1
        self.recent.append({"t": time.time(), "cause": cause, "lease_id": None,
                            "message": str(error)[:500]})
        self._fail_waiter(waiter, error)
        self._schedule()

    def _renew(self, lease_id: str) -> dict:
        lease = self.leases.get(lease_id)
        if lease is not None:
            if lease.state == "held":
                lease.renewed_at = time.time()
            return {**lease.grant(), "state": lease.state}
        self._raise_ended(lease_id)

    def _raise_ended(self, lease_id: str):
        ended = self.ended.get(lease_id)
        if ended is None:
            raise SandboxLost(lease_id, "no such lease in this fleet")
        error = ended["error"]
        if error.get("error") == "LeaseClosed":
            raise LeaseClosed(error.get("message", "lease released"))
        raise InfraError.from_dict(error)

    def _release(self, lease_id: str) -> dict | asyncio.Future:
        """The answer to a release: at once when the lease had ended, else a future that
        resolves once its end is journaled."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return {"released": True, "was": self.ended.get(lease_id, {}).get("cause")}
        self._end(lease, "released", {"error": "LeaseClosed", "message": "lease released"})
        return self._journaled({"e": "end", "lease_id": lease_id, "cause": "released",
                                "error": self.ended[lease_id]["error"],
                                "request_id": lease.request_id},
                               {"released": True, "was": "held"})

    def _end(self, lease: Lease, cause: str, error: dict, *, stop: bool = True) -> None:
        """End a lease: free its slot, remember why, stop its sandbox. Journaled by callers
        that await; the others go through ``_end_logged``."""
        if self.leases.get(lease.lease_id) is not lease:
            return
        node = self.nodes.get(lease.worker_id)
        if node is not None:
            self._unreserve(lease, node)
        else:
            del self.leases[lease.lease_id]
        self._remember_end(lease.lease_id, cause, error, lease.request_id)
        if cause not in ("released",):
            if cause != "expired":
                self.failures[cause] += 1
            self.recent.append({"t": time.time(), "cause": cause, "lease_id": lease.lease_id,
                                "node": lease.node, "message": error.get("message", "")[:500]})
            log.info("lease %s ended: %s (%s)", lease.lease_id, cause, error.get("message"))
        if stop and node is not None and node.state in ("up", "draining") \
                and lease.state == "held":
            self._stop_sandbox(node, lease.lease_id, cause)
        self._schedule()

    def _end_logged(self, lease: Lease, cause: str, error: dict, *, stop: bool = True) -> None:
        self._end(lease, cause, error, stop=stop)
        self._spawn(self._log({"e": "end", "lease_id": lease.lease_id, "cause": cause,
                               "error": error, "request_id": lease.request_id}), "journal")

    def _stop_sandbox(self, node: Node, lease_id: str, reason: str, attempt: int = 0) -> None:
        """Ask the worker to stop the sandbox: three tries over connection errors; after
        those, the worker's next heartbeat learns the lease is gone and stops it then."""
        if attempt and self._stopping.is_set():
            return
        stopped = self._worker_call(node, StopSandbox(
            id=new_id(), token=self.token, lease_id=lease_id, reason=reason), timeout=60)
        stopped.add_done_callback(functools.partial(self._stopped, node, lease_id, reason,
                                                    attempt))

    def _stopped(self, node: Node, lease_id: str, reason: str, attempt: int,
                 stopped: asyncio.Future) -> None:
        if stopped.cancelled() or stopped.exception() is None:
            return
        e = stopped.exception()
        if not isinstance(e, (ConnectionError, OSError)):  # an error reply: nothing to retry
            log.warning("stop %s on %s: %s", lease_id, node.worker_id, e)
            return
        log.debug("stop %s on %s: %s", lease_id, node.worker_id, e)
        if attempt < 2:
            asyncio.get_running_loop().call_later(0.5 * (attempt + 1), self._stop_sandbox,
                                                  node, lease_id, reason, attempt + 1)

    # ---- workers

    def _worker_call(self, node: Node, message, *, timeout: float) -> asyncio.Future:
        """A worker RPC as a future (it never raises): on the worker's open connection
        without a task, else in a task that opens one first."""
        conn = self._conns.get(node.worker_id)
        if conn is not None and not conn.closed and conn.address == node.address:
            try:
                return conn.call(message, timeout=timeout)
            except (ConnectionError, OSError) as e:
                failed = asyncio.get_running_loop().create_future()
                failed.set_exception(e)
                return failed
        task = asyncio.ensure_future(self._worker_rpc(node, message, timeout=timeout))
        self._tasks.add(task)  # cancelled by stop(); its outcome goes to the caller
        task.add_done_callback(self._tasks.discard)
        return task

    async def _worker_rpc(self, node: Node, message, *, timeout: float) -> dict:
        conn = self._conns.get(node.worker_id)
        if conn is None or conn.closed or conn.address != node.address:
            lock = self._conn_locks.setdefault(node.worker_id, asyncio.Lock())
            async with lock:  # one connection per worker, even under concurrent RPCs
                conn = self._conns.get(node.worker_id)
                if conn is None or conn.closed or conn.address != node.address:
                    if conn is not None:
                        await conn.close()
                    conn = await Connection.open(node.address, self.token, timeout=5)
                    self._conns[node.worker_id] = conn
        result, _ = await conn.request(message, timeout=timeout)
        return result

    async def _register(self, req: Register) -> dict:
        mono = time.monotonic()
        other = self.nodes.get(self.by_name.get(req.name, ""))
        if other is not None and other.worker_id != req.worker_id \
                and other.state in ("up", "draining"):
            self._node_lost(other, "its worker restarted")  # it replaces its old self
        self.by_name[req.name] = req.worker_id
        node = self.nodes.get(req.worker_id)
        if node is None or node.state in ("lost", "gone"):
            node = Node(req.worker_id, req.name, req.address, req.node, req.slots,
                        req.memory_mb, req.job_id, req.ends_at, registered_at=time.time())
            self.nodes[req.worker_id] = node
            self._index(node)
            await self._log(node.record())
            log.info("worker %s registered: %s at %s, %d slots", req.worker_id, req.node,
                     req.address, req.slots)
        else:
            node.address, node.slots, node.memory_mb = req.address, req.slots, req.memory_mb
            self._index(node)
        node.last_seen = mono
        if self.scaler is not None:
            self.scaler.registered(node)
        keep = self._reconcile(node, req.leases, {})
        self._schedule()
        return {"known": True, "keep": keep, "heartbeat_s": self.config.heartbeat_s}

    def _heartbeat(self, req: Heartbeat) -> dict:
        node = self.nodes.get(req.worker_id)
        if node is None or node.state in ("lost", "gone"):
            return {"known": False}
        node.last_seen = time.monotonic()
        if req.leaving:
            self._node_lost(node, f"its worker is exiting: {req.leaving}")
            return {"known": False}
        keep = self._reconcile(node, req.leases, req.lost)
        stop = [lid for lid in req.leases if lid not in keep]
        return {"known": True, "stop": stop, "drain": node.state == "draining"}

    def _reconcile(self, node: Node, reported: dict[str, LeaseActivity],
                   lost: dict[str, str]) -> list[str]:
        """Renew what the worker reports active; end what it lost; the ids it should keep."""
        now = time.time()
        keep = []
        for lease_id, activity in reported.items():
            lease = self.leases.get(lease_id)
            if lease is None or lease.worker_id != node.worker_id:
                continue
            if lease_id in lost:
                continue
            keep.append(lease_id)
            lease.pinned = activity.pinned
            if lease.state == "held":
                lease.renewed_at = max(lease.renewed_at, now - activity.idle_s)
        for lease_id, reason in lost.items():
            lease = self.leases.get(lease_id)
            if lease is not None and lease.worker_id == node.worker_id:
                self._end_logged(lease, "sandbox_lost",
                                 SandboxLost(lease_id, reason).to_dict(), stop=False)
        for lease_id in list(node.leases):
            lease = self.leases.get(lease_id)
            if lease is not None and lease.state == "held" and lease_id not in reported \
                    and now - lease.granted_at > 2 * self.config.heartbeat_s + 1:
                self._end_logged(lease, "sandbox_lost", SandboxLost(
                    lease_id, f"worker {node.worker_id} no longer runs it").to_dict(),
                    stop=False)
        return keep

    def _node_lost(self, node: Node, reason: str) -> None:
        if node.state in ("lost", "gone"):
            return
        node.state = "lost"
        self._index(node)
        log.warning("worker %s (%s) lost: %s", node.worker_id, node.node, reason)
        self.recent.append({"t": time.time(), "cause": "node_lost", "lease_id": None,
                            "node": node.node, "message": reason})
        for lease_id in list(node.leases):
            lease = self.leases.get(lease_id)
            if lease is not None:
                self._end_logged(lease, "node_lost", NodeLost(node.node, reason).to_dict(),
                                 stop=False)
        self._spawn(self._log({"e": "node_end", "worker_id": node.worker_id,
                               "reason": reason}), "journal")
        self._conn_locks.pop(node.worker_id, None)
        conn = self._conns.pop(node.worker_id, None)
        if conn is not None:
            self._spawn(conn.close(), "close")
        if self.scaler is not None:
            self.scaler.node_lost(node)
        self._schedule()

    def node_gone(self, node: Node, reason: str) -> None:
        """A node released on purpose (idle, down): forgotten without a failure."""
        node.state = "gone"
        self._index(node)
        for lease_id in list(node.leases):
            lease = self.leases.get(lease_id)
            if lease is not None:
                self._end_logged(lease, "node_lost", NodeLost(node.node, reason).to_dict(),
                                 stop=False)
        self.nodes.pop(node.worker_id, None)
        self._spawn(self._log({"e": "node_end", "worker_id": node.worker_id,
                               "reason": reason}), "journal")
        self._conn_locks.pop(node.worker_id, None)
        conn = self._conns.pop(node.worker_id, None)
        if conn is not None:
            self._spawn(conn.close(), "close")

    # ---- the monitor: lost nodes, expired leases

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
        for node in list(self.nodes.values()):
            if node.state in ("up", "draining") and mono - node.last_seen > \
                    self.config.lost_after_s:
                self._node_lost(node, f"no heartbeat for {mono - node.last_seen:.1f}s")
            elif node.state == "lost" and mono - node.last_seen > 600:
                self.nodes.pop(node.worker_id, None)  # kept a while for status
        for lease in list(self.leases.values()):
            if lease.state != "held":
                continue
            if now > lease.granted_at + lease.spec["max_lifetime_s"]:
                self._end_logged(lease, "sandbox_lost", SandboxLost(
                    lease.lease_id, "max lifetime reached").to_dict())
            elif not lease.pinned and now > lease.expires_at:
                self._end_logged(lease, "expired", LeaseExpired(
                    lease.lease_id, f"lease expired: not renewed for {lease.ttl_s:g}s "
                    "(ttl)").to_dict())

    # ---- status

    def status(self) -> dict:
        mono, now = time.monotonic(), time.time()
        held = [lease for lease in self.leases.values() if lease.state == "held"]
        return {
            "address": self.address, "pid": os.getpid(), "state_dir": str(self.state_dir),
            "provider": self.config.provider, "uptime_s": round(now - self.started, 1),
            "nodes": [{"worker_id": n.worker_id, "name": n.name, "node": n.node,
                       "address": n.address, "state": n.state, "slots": n.slots,
                       "used_cpus": n.used_cpus, "leases": len(n.leases), "job_id": n.job_id,
                       "last_seen_s": round(mono - n.last_seen, 2),
                       "idle_s": round(mono - n.idle_since, 1) if not n.leases else 0.0,
                       "ends_in_s": round(n.ends_at - now) if n.ends_at is not None
                       else None}
                      for n in self.nodes.values()],
            "leases": {"held": len(held), "starting": len(self.leases) - len(held),
                       "queued": self.queued_count(),
                       "queued_by_client": {c: len(q) for c, q in self.queues.items()}},
            "jobs": [{"job_id": j.job_id, "name": j.name, "state": j.state}
                     for j in self.jobs.values()],
            "failures": dict(self.failures),
            "recent_failures": list(self.recent)[-20:],
        }


def _follow(shared: asyncio.Future) -> asyncio.Future:
    """A future with ``shared``'s outcome that its holder may cancel alone (``shield``
    without a task)."""
    answer = shared.get_loop().create_future()

    def copy(_: asyncio.Future) -> None:
        if answer.done():
            return
        if shared.cancelled():
            answer.cancel()
        elif shared.exception() is not None:
            answer.set_exception(shared.exception())
        else:
            answer.set_result(shared.result())

    shared.add_done_callback(copy)
    return answer


def _retrieve(future: asyncio.Future) -> None:
    """Mark a future's exception seen (it went to whoever asked, if anyone still did)."""
    if not future.cancelled():
        future.exception()


def advertised_host(config: FleetConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    if config.host in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()
    return config.host


def serve_forever(state_dir: Path, config: FleetConfig, provider: Any | None) -> None:
    """Run a controller in this process until ``down`` or SIGTERM/SIGINT."""

    async def main() -> None:
        controller = Controller(state_dir, config, provider)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, controller.request_stop)
        await controller.run()

    run_event_loop(main())


def desired_nodes(queued_cpus: int, held_cpus: int, config: FleetConfig) -> int:
    """Workers wanted for this demand: ceil(CPUs / cpus_per_node) within the bounds."""
    wanted = math.ceil((queued_cpus + held_cpus) / config.cpus_per_node)
    return max(config.min_nodes, min(config.max_nodes, wanted))
