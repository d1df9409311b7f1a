"""The server end of the wire: a ``Server`` that carries frames over TCP for a handler.

A ``Server`` checks each frame's token as soon as its header is complete, before a byte of
its payload is kept, and then bounds the payload by the request's type
(``PAYLOAD_BYTES``: only ``put`` and ``verify`` carry one). Until a connection has
presented the token its header may be at most ``PREAUTH_HEADER_BYTES`` (a client whose
first request is larger sends a ``ping`` before it); it must do so within
``WireLimits.auth_timeout_s``, and each peer IP may hold only so many such connections (and
so many in all). Authenticated connections idle for ``WireLimits.idle_timeout_s`` are
closed. Rejections are logged once per peer per interval. Every request is validated into
its message (``REQUEST``); a version other than ``PROTOCOL_VERSION`` or an invalid message
gets BadRequest.

The ``Server`` answers a request its handler can answer at once on the spot and runs any
other in a task of its own (bounded per connection), so a slow ``exec`` never delays a
``renew`` on the same socket. Its connections are ``FramedProtocol``s
(``sandfleet.wire.frames``): frames are parsed as bytes arrive, and the frames a connection
sends in one turn of the event loop leave in one write. The client end and the event loop
are ``sandfleet.wire.transport``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import math
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from sandfleet.errors import (
    BadRequest,
    InfraError,
    RemoteError,
    Unauthorized,
    error_to_dict,
)
from sandfleet.wire.frames import (
    MAX_HEADER_BYTES,
    PREAUTH_HEADER_BYTES,
    FramedProtocol,
    Header,
)
from sandfleet.wire.messages import (
    ID_MAX,
    PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    REQUEST,
    reply_header,
    validation_summary,
)

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 900.0
"""A server closes an authenticated connection with nothing in flight silent this long."""


def check_token(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


HandlerResult = dict | BaseModel | tuple[dict | BaseModel, bytes] | None
Handler = Callable[[Any, bytes, "Peer"], HandlerResult | Awaitable[HandlerResult]]
"""``handler(request, payload, peer)``: the result now, or an awaitable of it (a coroutine
runs as a task of its own; a future is awaited as it is, and cancelled with the connection)."""


class Peer:
    """What a handler knows about the connection a request came on."""

    def __init__(self, address: str):
        self.address = address


@dataclass(frozen=True)
class WireLimits:
    """What a ``Server`` grants each peer; the defaults hold for a controller or worker
    reachable from a whole cluster."""

    auth_timeout_s: float = 5.0
    """A new connection must deliver a frame header with the right token within this."""
    idle_timeout_s: float | None = IDLE_TIMEOUT_S
    """An authenticated connection with nothing in flight silent this long is closed (None:
    never); clients open a new one after half of it."""
    per_peer: int = 4096
    """Most connections at once from one IP (an orchestrator's sync leases each hold one
    to their worker)."""
    unauthenticated_per_peer: int = 256
    """Most connections at once from one IP that have not presented the token yet."""
    preauth_header_bytes: int = PREAUTH_HEADER_BYTES
    """Largest header read before the token is checked."""
    header_bytes: int = MAX_HEADER_BYTES
    """Largest header of an authenticated connection."""
    payload_bytes: Mapping[str, int] = field(default_factory=lambda: dict(PAYLOAD_BYTES))
    """Largest payload by request type; other types carry none."""
    log_interval_s: float = 60.0
    """Rejections of one peer are logged at most once per this interval."""


class _Rejections:
    """Rejected connections and frames, logged once per peer IP per interval (a flood of
    them costs one line a minute, with the count of those not logged)."""

    def __init__(self, name: str, interval: float):
        self.name, self.interval = name, interval
        self._seen: dict[str, tuple[float, int]] = {}
        """Peer IP -> (when it was last logged, rejections since)."""

    def note(self, ip: str, what: str) -> None:
        now = time.monotonic()
        logged, since = self._seen.get(ip, (-math.inf, 0))
        if now - logged < self.interval:
            self._seen[ip] = (logged, since + 1)
            return
        if len(self._seen) >= 4096:  # many peers: forget those quiet for an interval
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.interval}
        self._seen[ip] = (now, 0)
        more = f" (and {since} more from {ip} since its last report)" if since else ""
        log.warning("%s: rejected %s%s", self.name, what, more)


class Server:
    """A TCP server that authenticates and validates requests and runs ``handler`` on each.

    ``handler(request, payload, peer)`` returns the result (its request's ``Result`` model,
    or a dict of its fields), ``(result, payload)`` or
    None, or an awaitable of one (see ``Handler``); raising sends an error reply. A request
    answered at once costs no task; an awaitable runs concurrently with the connection's
    other requests (at most ``per_connection`` of them; past that the connection is not read
    until one ends), so a slow ``exec`` never delays a ``renew`` on the same socket. A bad
    token is answered with Unauthorized and the connection closed, and a payload over its
    type's bound with BadRequest and the same, both before the payload is read; an invalid
    message gets BadRequest; broken framing closes the connection. None of these touch
    other connections. A connection that ends cancels its requests still running.
    ``limits`` (``WireLimits``) bounds what each peer may hold before and after it
    authenticates.
    """

    def __init__(self, handler: Handler, token: str, *, name: str = "server",
                 limits: WireLimits | None = None, per_connection: int = 256):
        self.handler, self.token, self.name = handler, token, name
        self.limits = limits or WireLimits()
        self.per_connection = per_connection
        self.rejections = _Rejections(name, self.limits.log_interval_s)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Served] = set()
        self._peers: dict[str, list[int]] = {}
        """Peer IP -> [its connections, those not authenticated yet]."""

    async def start(self, host: str, port: int = 0) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Served(self), host, port,
                                                reuse_address=True)
        sock = self._server.sockets[0].getsockname()
        return sock[0], sock[1]

    def _admit(self, conn: _Served) -> bool:
        """Count a new connection against its peer's caps; False (logged) when over one."""
        counts = self._peers.setdefault(conn.ip, [0, 0])
        if counts[0] >= self.limits.per_peer:
            self.rejections.note(conn.ip, f"{conn.peer}: {counts[0]} connections open "
                                          f"from {conn.ip} (at most {self.limits.per_peer})")
            return False
        if counts[1] >= self.limits.unauthenticated_per_peer:
            self.rejections.note(conn.ip, f"{conn.peer}: {counts[1]} unauthenticated "
                                          f"connections open from {conn.ip} (at most "
                                          f"{self.limits.unauthenticated_per_peer})")
            return False
        counts[0] += 1
        counts[1] += 1
        return True

    def _release(self, conn: _Served) -> None:
        counts = self._peers[conn.ip]
        counts[0] -= 1
        counts[1] -= not conn.authenticated
        if not counts[0]:
            del self._peers[conn.ip]

    def peer_connections(self, ip: str) -> tuple[int, int]:
        """(connections, unauthenticated ones) open from ``ip`` now."""
        counts = self._peers.get(ip, (0, 0))
        return counts[0], counts[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        running = [job for conn in list(self._conns) for job in conn.running]
        for conn in list(self._conns):
            conn.close()
        for job in running:
            job.cancel()
        if running:
            await asyncio.wait(running, timeout=2)
        await asyncio.sleep(0)  # let closed transports report it
        for conn in list(self._conns):  # still flushing to a peer that reads nothing
            conn.transport.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)


REFUSED_LINGER_S = 1.0
"""A refused connection's reply gets this long to reach its peer before the connection is
dropped (it is not read meanwhile)."""


class _Served(FramedProtocol):
    """A connection to a ``Server``: each header checked as it completes, each request
    handled as its frame does."""

    def __init__(self, server: Server):
        limits = server.limits
        super().__init__(server.name, max_header=limits.preauth_header_bytes,
                         max_payload=max(limits.payload_bytes.values(), default=0))
        self.server = server
        self.transport: asyncio.Transport  # set at once: connection_made
        self.running: set[asyncio.Future] = set()
        self.backlog: deque[tuple[Header, bytes]] = deque()
        """Frames read past ``per_connection`` running requests."""
        self.peer_info = Peer("?")
        self.authenticated = False
        """A frame header with the fleet's token has come on this connection."""
        self.admitted = False
        self._reading = True
        self._last = 0.0
        """When a byte last came or a reply last left."""
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._graced = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.peer_info = Peer(self.peer)
        if not self.server._admit(self):
            self.closing = True
            self.transport.abort()
            return
        self.admitted = True
        self.server._conns.add(self)
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):  # a peer gone without a word
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 60)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 15)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)
        self._last = self.loop.time()
        self._check_at(self._last + self.server.limits.auth_timeout_s)

    def _check_at(self, when: float) -> None:
        self._due = when
        self._timer = self.loop.call_at(when, self._check_idle)

    def _check_idle(self) -> None:
        """The auth deadline, then the idle timeout: one timer per connection."""
        self._timer = None
        if self.closing:
            return
        now, limits = self.loop.time(), self.server.limits
        if not self.authenticated:
            if now - self._due > 0.1 and not self._graced:  # the loop stalled: first
                self._graced = True                          # read what came meanwhile
                self._check_at(now + 0.1)
                return
            self.server.rejections.note(self.ip, f"{self.peer}: no frame with the token "
                                                 f"within {limits.auth_timeout_s:g}s")
            self.closing = True
            self.transport.abort()
            return
        if limits.idle_timeout_s is None:
            return
        if self.running or self.backlog or self._chunks or self.write_paused:
            self._last = now  # busy is not idle
        if now - self._last < limits.idle_timeout_s:
            self._check_at(self._last + limits.idle_timeout_s)
        else:
            log.debug("%s: closing %s, idle for %.0fs", self.name, self.peer,
                      now - self._last)
            self.close()

    def data_received(self, data: bytes) -> None:
        self._last = self.loop.time()
        super().data_received(data)

    def log_failure(self, what: str) -> None:
        self.server.rejections.note(self.ip, what)

    def header_received(self, header: Header, payload_len: int) -> None:
        if not check_token(str(header.get("token", "")), self.server.token):
            self._refuse(header, Unauthorized("bad or missing fleet token"), "bad token")
            return
        if not self.authenticated and self.admitted:
            self.authenticated = True
            self.max_header = self.server.limits.header_bytes
            self.server._peers[self.ip][1] -= 1
        if payload_len:
            kind = header.get("type")
            limit = self.server.limits.payload_bytes.get(kind, 0) \
                if isinstance(kind, str) else 0
            if payload_len > limit:
                self._refuse(header, BadRequest(
                    f"a {str(kind)[:40]!r} request carries at most {limit} payload bytes, "
                    f"not {payload_len}"), f"payload of {payload_len} bytes")

    def _refuse(self, header: Header, error: RemoteError, why: str) -> None:
        """Answer the frame with ``error`` and drop the connection without reading on: the
        reply and an end of stream go out, the peer's further bytes stay unread."""
        rid = header.get("id")
        self.server.rejections.note(self.ip, f"{self.peer}: {why}")
        self._reply(rid[:ID_MAX] if isinstance(rid, str) else "", error=error.to_dict())
        self.flush()
        self.closing = True
        transport = self.transport
        transport.pause_reading()
        if transport.can_write_eof():
            transport.write_eof()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(REFUSED_LINGER_S, transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.admitted:
            self.admitted = False
            self.server._release(self)
        self.server._conns.discard(self)
        self.backlog.clear()
        for job in list(self.running):
            job.cancel()

    def frame_received(self, header: Header, payload: bytes) -> None:
        if self.backlog or len(self.running) >= self.server.per_connection:
            self.backlog.append((header, payload))
            self._pace()
        else:
            self._handle(header, payload)

    def _handle(self, header: Header, payload: bytes) -> None:
        server = self.server
        rid = header.get("id")
        rid = rid[:ID_MAX] if isinstance(rid, str) else ""
        try:
            if header.get("v") != PROTOCOL_VERSION:
                raise BadRequest(f"protocol version {header.get('v')!r} not supported "
                                 f"(this {server.name} speaks {PROTOCOL_VERSION})")
            request = REQUEST.validate_python(header)
        except (ValidationError, BadRequest) as e:
            self._reply(rid, error=error_to_dict(
                e if isinstance(e, BadRequest) else BadRequest(validation_summary(e))))
            return
        try:
            out = server.handler(request, payload, self.peer_info)
        except Exception as e:  # noqa: BLE001 - the boundary: every failure becomes a reply
            self._failed(request, e)
            return
        if out is None or isinstance(out, (dict, tuple, BaseModel)):
            self._answer(request.id, out)
            return
        job = out if asyncio.isfuture(out) else asyncio.ensure_future(out)
        self.running.add(job)
        job.add_done_callback(functools.partial(self._done, request))

    def _done(self, request: Any, job: asyncio.Future) -> None:
        self.running.discard(job)
        if not job.cancelled():
            error = job.exception()
            if error is None:
                self._answer(request.id, job.result())
            else:
                self._failed(request, error)
        while self.backlog and len(self.running) < self.server.per_connection \
                and not self.closing:
            self._handle(*self.backlog.popleft())
        self._pace()

    def _pace(self) -> None:
        """Read while the backlog is empty and the peer takes our replies."""
        reading = not self.backlog and not self.write_paused
        if reading != self._reading and not self.closing:
            self._reading = reading
            if reading:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._pace()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._pace()

    def _failed(self, request: Any, error: BaseException) -> None:
        if not isinstance(error, (InfraError, RemoteError, FileNotFoundError)):
            log.error("%s: %s %s failed", self.name, request.type, request.id,
                      exc_info=error)
        self._reply(request.id, error=error_to_dict(error))

    def _answer(self, rid: str, out: HandlerResult) -> None:
        result, data = out if isinstance(out, tuple) else (out or {}, b"")
        self._reply(rid, result=result, payload=data)

    def _reply(self, rid: str, *, result: dict | BaseModel | None = None,
               error: dict | None = None, payload: bytes = b"") -> None:
        header = reply_header(rid, result=result, error=error)
        self._last = self.loop.time()
        try:
            self.send(header, payload)
        except ConnectionError as e:
            log.debug("reply %s not sent: %s", rid, e)
        except ValueError as e:  # a result that is not JSON: a bug, but the asker hears of it
            log.error("%s: reply %s not serializable: %s", self.name, rid, e)
            self.send({**header, "ok": False, "result": {}, "error": RemoteError(
                f"reply not serializable: {e}"[:2000]).to_dict()})

