"""The controller's lease desk: acquire (queue, place, start, grant), renew, release and
the end of a lease (see the package doc for the rules).

``LeaseDesk`` owns the queues of waiting acquires and the futures of those in flight; it
records leases in the controller's ``Registry``, asks workers to start and stop sandboxes
through the ``WorkerPool``, and reaches the rest of the controller (journal, scaler,
token, whether it stops) through the ``LeaseHost`` protocol the ``Controller`` implements.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import NoReturn, Protocol

from sandfleet.config import FleetConfig
from sandfleet.controller import placement
from sandfleet.controller.journal import Event, LeaseEnded
from sandfleet.controller.placement import Queues
from sandfleet.controller.pool import WorkerPool
from sandfleet.controller.scaler import Scaler
from sandfleet.controller.state import Lease, Node, Registry, Waiter
from sandfleet.errors import (
    BadRequest,
    CapacityTimeout,
    InfraError,
    LeaseClosed,
    NodeLost,
    SandboxLost,
)
from sandfleet.wire.messages import Acquire, SandboxSpecModel, StartSandbox, new_id
from sandfleet.wire.server import Peer

log = logging.getLogger(__name__)


class LeaseHost(Protocol):
    """What the lease desk needs of the controller."""

    token: str
    scaler: Scaler | None

    @property
    def stopping(self) -> bool:
        """The controller is going down: no new acquires, no second start attempts."""

    def commit(self, event: Event) -> asyncio.Future:
        """Journal ``event`` (group commit); done once it is on disk."""

    def log_later(self, event: Event) -> None:
        """Journal ``event`` in the background."""


class LeaseDesk:
    """Acquires, grants, renewals, releases and ends of leases (see the module doc)."""

    def __init__(self, reg: Registry, config: FleetConfig, pool: WorkerPool, host: LeaseHost):
        self.reg, self.config, self.pool, self.host = reg, config, pool, host
        self.queues = Queues()
        self.inflight: dict[str, asyncio.Future] = {}
        """The future of every acquire still waiting or starting, by request id."""

    def close_all(self) -> None:
        """``sandfleet down``: fail the waiting acquires and end every lease."""
        for waiter in list(self.queues):
            self._fail_waiter(waiter, CapacityTimeout(
                time.monotonic() - waiter.enqueued, "the fleet is shutting down"))
        self.queues.clear()
        for lease in list(self.reg.leases.values()):
            self.end(lease, "released", {"error": "LeaseClosed",
                                         "message": "the fleet was shut down"})

    # ---- acquire: queue, place, start, grant

    def acquire(self, req: Acquire, peer: Peer) -> dict | asyncio.Future:
        """The answer to an acquire: at once for a repeated id whose lease exists, else a
        future of the grant (the asker's own: the server cancels it when the asker hangs
        up, which drops the wait if it is still queued)."""
        if req.id in self.reg.by_request:
            return self.renew(self.reg.by_request[req.id])
        if req.id in self.inflight:
            return _follow(self.inflight[req.id])
        why = placement.too_big(req, self.config)
        if why is not None:
            raise BadRequest(why)
        if self.host.stopping:
            raise CapacityTimeout(0.0, "the fleet is shutting down")
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        self.inflight[req.id] = future
        wait_s = self.config.acquire_wait_s if req.wait_s is None else req.wait_s
        waiter = Waiter(req, req.client or peer.address.rpartition(":")[0], future, wait_s)
        self.queues.push(waiter)
        self.schedule()
        if waiter.queued:  # no slot for it now
            self._arm(waiter)
            if self.host.scaler is not None:
                self.host.scaler.kick()
        answer = _follow(future)
        answer.add_done_callback(functools.partial(self._asker_done, waiter))
        return answer

    def _asker_done(self, waiter: Waiter, answer: asyncio.Future) -> None:
        if answer.cancelled() and self.queues.withdraw(waiter):  # the asker hung up
            self._fail_waiter(waiter, CapacityTimeout(0.0, "the asker went away"))
        if waiter.future.done():
            self.inflight.pop(waiter.request.id, None)

    def _arm(self, waiter: Waiter) -> None:
        if waiter.timer is None:
            left = waiter.wait_s - (time.monotonic() - waiter.enqueued)
            waiter.timer = asyncio.get_running_loop().call_later(max(0.0, left),
                                                                 self._wait_timeout, waiter)

    def _wait_timeout(self, waiter: Waiter) -> None:
        if not self.queues.withdraw(waiter):
            return  # already placed: the start proceeds
        up = sum(1 for n in self.reg.nodes.values() if n.state == "up")
        self._fail_waiter(waiter, CapacityTimeout(
            time.monotonic() - waiter.enqueued,
            f"{self.queues.count()} others queued, {len(self.reg.leases)} leases held on "
            f"{up} nodes (max {self.config.max_nodes})"))
        self.reg.failures["capacity"] += 1

    def _fail_waiter(self, waiter: Waiter, error: BaseException) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        if not waiter.future.done():
            waiter.future.set_exception(error)
        self.inflight.pop(waiter.request.id, None)

    def _place(self, cpus: int, memory_mb: int) -> Node | None:
        return placement.best_fit(self.reg.free, cpus, memory_mb, now=time.time(),
                                  mono=time.monotonic(),
                                  drain_s=placement.drain_before_s(self.config))

    def schedule(self) -> None:
        """Grant what fits: round-robin over clients, FIFO within each."""
        if self.queues:
            self.queues.schedule(self._place, self._grant)

    def _grant(self, waiter: Waiter, node: Node) -> None:
        """Reserve a slot on ``node`` for ``waiter`` and ask the worker to start it."""
        req = waiter.request
        lease = Lease(new_id("L"), req.id, waiter.client, node.worker_id, node.node,
                      node.address, placement.sandbox_spec(req, self.config), req.cpus,
                      req.memory_mb, req.ttl_s or self.config.lease_ttl_s)
        self.reg.reserve(lease, node)
        self.reg.index(node)
        lease.queued_s = round(time.monotonic() - waiter.enqueued, 4)  # until a slot, not start
        started = self.pool.call(node, StartSandbox(
            id=new_id(), token=self.host.token, lease_id=lease.lease_id,
            spec=SandboxSpecModel.model_validate(lease.spec)),  # as pydantic reads the dict
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
            self.reg.unreserve(lease, node)
            node.unschedulable_until = time.monotonic() + self.config.lost_after_s
            if waiter.attempts < 2 and not waiter.future.done() \
                    and not self.host.stopping:
                waiter.attempts += 1
                log.warning("start of %s on %s failed (%s); queued again", lease.lease_id,
                            node.worker_id, e)
                self.queues.push_front(waiter)
                self._arm(waiter)
                self.schedule()
                return
            self._start_failed(waiter, NodeLost(node.node, f"sandbox start failed: {e}"))
            return
        if e is not None:  # ImageMissing, SandboxStartError...: they go to the asker
            self.reg.unreserve(lease, node)
            self._start_failed(waiter, e)
            return
        if self.reg.leases.get(lease.lease_id) is not lease:  # node lost or fleet down
            self._start_failed(waiter, InfraError.from_dict(
                self.reg.ended.get(lease.lease_id, {}).get("error")
                or NodeLost(node.node, "lost while the sandbox started").to_dict()))
            return
        lease.granted_at = lease.renewed_at = time.time()
        lease.state = "held"
        self.reg.by_request[waiter.request.id] = lease.lease_id
        self.host.commit(lease.record()).add_done_callback(
            functools.partial(self._granted, waiter, lease))

    def _granted(self, waiter: Waiter, lease: Lease, journaled: asyncio.Future) -> None:
        _retrieve(journaled)  # a journal error is logged there; the fleet keeps serving
        if waiter.timer is not None:
            waiter.timer.cancel()
        self.inflight.pop(waiter.request.id, None)
        if not waiter.future.done():
            waiter.future.set_result(lease.grant())

    def _start_failed(self, waiter: Waiter, error: BaseException) -> None:
        self.reg.note(getattr(error, "cause", "bad_request"), str(error)[:500])
        self._fail_waiter(waiter, error)
        self.schedule()

    # ---- renew, release, end

    def renew(self, lease_id: str) -> dict:
        lease = self.reg.leases.get(lease_id)
        if lease is not None:
            if lease.state == "held":
                lease.renewed_at = time.time()
            return {**lease.grant(), "state": lease.state}
        self._raise_ended(lease_id)

    def _raise_ended(self, lease_id: str) -> NoReturn:
        ended = self.reg.ended.get(lease_id)
        if ended is None:
            raise SandboxLost(lease_id, "no such lease in this fleet")
        error = ended["error"]
        if error.get("error") == "LeaseClosed":
            raise LeaseClosed(error.get("message", "lease released"))
        raise InfraError.from_dict(error)

    def release(self, lease_id: str) -> dict | asyncio.Future:
        """The answer to a release: at once when the lease had ended, else a future that
        resolves once its end is journaled."""
        lease = self.reg.leases.get(lease_id)
        if lease is None:
            return {"released": True, "was": self.reg.ended.get(lease_id, {}).get("cause")}
        self.end(lease, "released", {"error": "LeaseClosed", "message": "lease released"})
        return self._journaled(LeaseEnded(lease_id, "released",
                                          self.reg.ended[lease_id]["error"], lease.request_id),
                               {"released": True, "was": "held"})

    def end(self, lease: Lease, cause: str, error: dict, *, stop: bool = True) -> None:
        """End a lease: free its slot, remember why, stop its sandbox. Journaled by callers
        that await; the others go through ``end_logged``."""
        reg = self.reg
        if reg.leases.get(lease.lease_id) is not lease:
            return
        node = reg.nodes.get(lease.worker_id)
        if node is not None:
            reg.unreserve(lease, node)
        else:
            del reg.leases[lease.lease_id]
        reg.remember_end(lease.lease_id, cause, error, lease.request_id)
        if cause != "released":
            reg.note(cause, error.get("message", "")[:500], lease_id=lease.lease_id,
                     node=lease.node, count=cause != "expired")
            log.info("lease %s ended: %s (%s)", lease.lease_id, cause, error.get("message"))
        if stop and node is not None and node.state in ("up", "draining") \
                and lease.state == "held":
            self.pool.stop_sandbox(node, lease.lease_id, cause)
        self.schedule()

    def end_logged(self, lease: Lease, cause: str, error: dict, *, stop: bool = True) -> None:
        self.end(lease, cause, error, stop=stop)
        self.host.log_later(LeaseEnded(lease.lease_id, cause, error, lease.request_id))

    def _journaled(self, event, result: dict) -> asyncio.Future:
        """A future of ``result``, resolved once ``event`` is journaled (or failed to be:
        logged by the journal; the fleet keeps serving)."""
        answer = asyncio.get_running_loop().create_future()

        def resolve(done: asyncio.Future) -> None:
            if not done.cancelled():
                done.exception()  # retrieved: logged by the journal
            if not answer.done():
                answer.set_result(result)

        self.host.commit(event).add_done_callback(resolve)
        return answer


def _follow(shared: asyncio.Future) -> asyncio.Future:
    """A future with ``shared``'s outcome that its holder may cancel alone (``shield``
    without a task)."""
    answer = shared.get_loop().create_future()

    def copy(_: asyncio.Future) -> None:
        if answer.done():
            return
        if shared.cancelled():
            answer.cancel()
        elif (error := shared.exception()) is not None:
            answer.set_exception(error)
        else:
            answer.set_result(shared.result())

    shared.add_done_callback(copy)
    return answer


def _retrieve(future: asyncio.Future) -> None:
    """Mark a future's exception seen (it went to whoever asked, if anyone still did)."""
    if not future.cancelled():
        future.exception()

