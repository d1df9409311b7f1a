"""Transport: client connections that carry frames over TCP, and the event loop.

A ``Connection`` is multiplexed: it may have many requests in flight (replies are matched
by id), and ``call`` sends one without a coroutine, for callers that chain callbacks. A
first request whose header is larger than ``PREAUTH_HEADER_BYTES`` goes after a ``ping``
(a server reads no more before the token). Idle connections are closed by the server after
``IDLE_TIMEOUT_S`` (``WireLimits.idle_timeout_s``); a ``Connection`` counts itself closed
after half that, so its owner opens a new one instead of racing the server's close.

The server end is ``sandfleet.wire.server`` (``Server``, ``Peer``, ``WireLimits``). Both
ends are ``FramedProtocol``s (``sandfleet.wire.frames``), not streams: frames are parsed as
bytes arrive, and the frames a connection sends in one turn of the event loop leave in one
write. A busy controller pays no task, timer or system call per frame it need not.

``run_event_loop`` (``new_event_loop``: uvloop where installed) runs servers and TMax's
rollout loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Coroutine
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_core import to_json

from sandfleet.errors import ProtocolError, error_from_dict
from sandfleet.wire.frames import PREAUTH_HEADER_BYTES, FramedProtocol, Header
from sandfleet.wire.messages import Ping, Reply, Request, new_id, validation_summary
from sandfleet.wire.server import IDLE_TIMEOUT_S

log = logging.getLogger(__name__)
T = TypeVar("T")


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad address {address!r}: want host:port")
    return host.strip("[]"), int(port)



def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where uvloop is installed, else asyncio's: uvloop costs the
    controller a third less CPU per lease, and workers and clients less per exec."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on ``new_event_loop()``'s loop: servers and TMax's rollout loops
    run on it."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


# ---- client connection


class Connection:
    """One multiplexed client connection: ``request()`` may be called concurrently;
    ``call()`` is the same without a coroutine, for callers that chain callbacks.

    ``idle_s`` is the server's idle timeout: once nothing has been in flight for half of
    it, the connection counts as ``closed``, so its owner opens a new one rather than send
    on one the server may be closing at that moment.
    """

    def __init__(self, address: str, token: str, *, idle_s: float | None = IDLE_TIMEOUT_S):
        self.address, self.token = address, token
        self.reuse_s = math.inf if idle_s is None else idle_s / 2
        self._used = 0.0
        """When a request last left, or its reply or timeout last came."""
        self._fresh = True
        self._pending: dict[str, tuple[asyncio.Future, float, str, float | None]] = {}
        """Request id -> (future, deadline, request type, timeout)."""
        self._closed: BaseException | None = None
        self._framed: _Replies | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = math.inf

    @classmethod
    async def open(cls, address: str, token: str, *, timeout: float = 10.0,
                   idle_s: float | None = IDLE_TIMEOUT_S) -> Connection:
        host, port = parse_address(address)
        conn = cls(address, token, idle_s=idle_s)
        loop = asyncio.get_running_loop()
        _, conn._framed = await asyncio.wait_for(
            loop.create_connection(lambda: _Replies(conn), host, port), timeout)
        conn._used = loop.time()
        return conn

    @property
    def _wire(self) -> _Replies:
        framed = self._framed
        if framed is None:
            raise ConnectionResetError(f"connection to {self.address} not open")
        return framed

    @property
    def closed(self) -> bool:
        """No new request should go on it: it is closed, lost, or idle for ``reuse_s``."""
        return self._closed is not None or (
            not self._pending and self._framed is not None
            and self._framed.loop.time() - self._used > self.reuse_s)

    def call(self, message: Request, payload: bytes = b"", *,
             timeout: float | None = 30.0) -> asyncio.Future:
        """Send ``message`` (its token filled in); a future of its reply's (result,
        payload), or of the rebuilt exception of an error reply, ConnectionError when the
        connection is lost, TimeoutError when no reply comes within ``timeout``.
        ConnectionResetError at once when the connection is closed."""
        if self._closed is not None:
            raise ConnectionResetError(f"connection to {self.address} closed")
        header: Header | Request = message
        if not message.token:
            header = message.model_dump()
            header["token"] = self.token
        framed = self._wire
        if self._fresh:
            self._fresh = False
            if len(to_json(header)) > PREAUTH_HEADER_BYTES:  # too large to authenticate
                framed.send(Ping(id=new_id("p"), token=self.token))  # reply ignored
        framed.send(header, payload)
        framed.flush()  # a client's request leaves now, not at the end of the loop's turn
        future = framed.loop.create_future()
        self._used = now = framed.loop.time()
        deadline = math.inf if timeout is None else now + timeout
        self._pending[message.id] = (future, deadline, message.type, timeout)
        if deadline < self._sweep_at:
            self._expire_at(deadline)
        return future

    async def request(self, message: Request, payload: bytes = b"", *,
                      timeout: float | None = 30.0) -> tuple[dict, bytes]:
        """``call()``, awaited: (result, payload), or the exception."""
        future = self.call(message, payload, timeout=timeout)
        try:
            framed = self._wire
            if framed.write_paused:
                await framed.drained()
        except BaseException:
            self._pending.pop(message.id, None)
            if future.done() and not future.cancelled():
                future.exception()  # the connection's end: raised here already
            future.cancel()
            raise
        try:
            return await future
        finally:
            if future.cancelled():  # the asker gave up
                self._pending.pop(message.id, None)

    def _reply(self, reply: Reply, payload: bytes) -> None:
        self._used = self._wire.loop.time()
        entry = self._pending.pop(reply.id, None)
        if entry is None or entry[0].done():
            return
        if reply.ok:
            entry[0].set_result((reply.result, payload))
        else:
            entry[0].set_exception(error_from_dict(reply.error or {}))

    def _expire_at(self, when: float) -> None:
        """One timer for all of the connection's requests: at the earliest deadline."""
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep_at = when
        self._sweep = self._wire.loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._sweep, self._sweep_at = None, math.inf
        now, earliest = self._wire.loop.time(), math.inf
        self._used = now
        for rid, (future, deadline, kind, timeout) in list(self._pending.items()):
            if future.done():
                del self._pending[rid]
            elif deadline <= now:
                del self._pending[rid]
                future.set_exception(TimeoutError(
                    f"no reply from {self.address} to {kind} within {timeout}s"))
            else:
                earliest = min(earliest, deadline)
        if earliest < math.inf:
            self._expire_at(earliest)

    def _lost(self, error: BaseException) -> None:
        if self._closed is None:
            self._closed = error
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep, self._sweep_at = None, math.inf
        pending, self._pending = self._pending, {}
        for future, *_ in pending.values():
            if not future.done():
                future.set_exception(self._closed)

    async def close(self) -> None:
        self._lost(ConnectionAbortedError(f"connection to {self.address} closed"))
        framed = self._framed
        if framed is not None and framed.transport is not None:
            framed.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(framed.gone), 1)
            if not framed.gone.done():
                framed.transport.abort()


class _Replies(FramedProtocol):
    """A ``Connection``'s transport: replies matched to requests as they arrive."""

    def __init__(self, conn: Connection):
        super().__init__(f"connection to {conn.address}")
        self.conn = conn
        self.gone = self.loop.create_future()

    def frame_received(self, header: Header, payload: bytes) -> None:
        try:
            reply = Reply.model_validate(header)
        except ValidationError as e:
            error = ProtocolError(f"bad reply from {self.conn.address}: {validation_summary(e)}")
            self.conn._lost(error)
            raise error from None
        self.conn._reply(reply, payload)

    def fail(self, error: Exception) -> None:
        self.conn._lost(ConnectionResetError(f"connection to {self.conn.address}: {error}"))
        super().fail(error)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.conn._lost(exc if isinstance(exc, ConnectionError) else ConnectionResetError(
            f"connection to {self.conn.address} closed"))
        if not self.gone.done():
            self.gone.set_result(None)
