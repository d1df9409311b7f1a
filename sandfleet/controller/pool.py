"""The controller's connections to its workers: one per worker, opened on first use."""

from __future__ import annotations

import asyncio
import functools
import logging

from sandfleet.controller.state import Node
from sandfleet.wire.messages import StopSandbox, new_id
from sandfleet.wire.transport import Connection

log = logging.getLogger(__name__)


class WorkerPool:
    """Worker RPCs over one connection per worker (reopened when the worker moves)."""

    def __init__(self, stopping: asyncio.Event, token: str = ""):
        self.token = token
        self.stopping = stopping
        """Set once the controller stops: no more retries."""
        self._conns: dict[str, Connection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.tasks: set[asyncio.Task] = set()
        """RPCs waiting for a connection to open (cancelled when the controller stops)."""

    def call(self, node: Node, message, *, timeout: float) -> asyncio.Future:
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
        task = asyncio.ensure_future(self.rpc(node, message, timeout=timeout))
        self.tasks.add(task)  # cancelled by stop(); its outcome goes to the caller
        task.add_done_callback(self.tasks.discard)
        return task

    async def rpc(self, node: Node, message, *, timeout: float) -> dict:
        conn = self._conns.get(node.worker_id)
        if conn is None or conn.closed or conn.address != node.address:
            lock = self._locks.setdefault(node.worker_id, asyncio.Lock())
            async with lock:  # one connection per worker, even under concurrent RPCs
                conn = self._conns.get(node.worker_id)
                if conn is None or conn.closed or conn.address != node.address:
                    if conn is not None:
                        await conn.close()
                    conn = await Connection.open(node.address, self.token, timeout=5)
                    self._conns[node.worker_id] = conn
        result, _ = await conn.request(message, timeout=timeout)
        return result

    def stop_sandbox(self, node: Node, lease_id: str, reason: str, attempt: int = 0) -> None:
        """Ask the worker to stop the sandbox: three tries over connection errors; after
        those, the worker's next heartbeat learns the lease is gone and stops it then."""
        if attempt and self.stopping.is_set():
            return
        stopped = self.call(node, StopSandbox(
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
            asyncio.get_running_loop().call_later(0.5 * (attempt + 1), self.stop_sandbox,
                                                  node, lease_id, reason, attempt + 1)

    def forget(self, worker_id: str) -> Connection | None:
        """Drop a worker's connection; the caller closes what comes back."""
        self._locks.pop(worker_id, None)
        return self._conns.pop(worker_id, None)

    async def close(self) -> None:
        for conn in self._conns.values():
            await conn.close()
