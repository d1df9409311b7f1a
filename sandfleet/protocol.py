"""The fleet's wire format: typed, versioned, authenticated messages over TCP.

Frame::

    +----------------+-----------------+-------------------+------------------+
    | header length  | payload length  | header (JSON)     | payload (bytes)  |
    | uint32, BE     | uint32, BE      | UTF-8 object      | raw, optional    |
    +----------------+-----------------+-------------------+------------------+

Both lengths are checked against the reader's limits *before* anything is read, so a
malicious length never allocates memory; a frame that breaks the framing (bad lengths, a
header that is not a JSON object) closes that connection and only that one. The payload
carries bulk bytes without JSON escaping: exec output, tar streams of files.

A ``Server`` checks each frame's token as soon as its header is complete, before a byte of
its payload is kept, and then bounds the payload by the request's type
(``PAYLOAD_BYTES``: only ``put`` and ``verify`` carry one). Until a connection has presented the token its header may be at most
``PREAUTH_HEADER_BYTES`` (a client whose first request is larger sends a ``ping`` before
it); it must do so within ``WireLimits.auth_timeout_s``, and each peer IP may hold only so
many such connections (and so many in all). Authenticated connections idle for
``WireLimits.idle_timeout_s`` are closed; a ``Connection`` counts itself closed after half
that, so its owner opens a new one instead of racing the server's close. Rejections are
logged once per peer per interval.

Every request is a pydantic model with ``extra="forbid"`` and a ``type`` discriminator,
carrying the protocol version ``v``, a request id ``id`` and the fleet's ``token``. A reply
carries the request's ``id`` and either ``result`` or ``error``: an infrastructure failure
as ``InfraError.to_dict()``, anything else as ``{"error": <name>, "message": ...}`` with a
name from ``REMOTE_ERRORS``. ``error_from_dict`` rebuilds the exception on the other side
from those two allow-lists only.

Request ids make retries safe: the controller answers a repeated ``acquire`` id with the
lease it already granted (or joins the wait already under way); ``renew`` and ``release``
are idempotent anyway.

Discovery: ``<state dir>/controller.json`` (``ControllerInfo``, mode 0600, written
atomically) names the controller's address and the fleet token.

Connections are multiplexed: a ``Connection`` may have many requests in flight (replies
are matched by id), and the ``Server`` answers a request its handler can answer at once on
the spot and runs any other in a task of its own (bounded per connection), so a slow
``exec`` never delays a ``renew`` on the same socket.

Both ends are ``asyncio.Protocol``s, not streams: frames are parsed as bytes arrive, and
the frames a connection sends in one turn of the event loop leave in one write. A busy
controller pays no task, timer or system call per frame it need not.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import itertools
import logging
import math
import os
import random
import socket
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import from_json, to_json

from sandfleet.errors import ERRORS, InfraError, SandfleetError

log = logging.getLogger(__name__)
T = TypeVar("T")

PROTOCOL_VERSION = 1
PREFIX = struct.Struct(">II")
MAX_HEADER_BYTES = 16 << 20
"""Largest JSON header accepted (a status reply of a large fleet fits)."""
MAX_PAYLOAD_BYTES = 512 << 20
"""Largest binary payload accepted (one file transfer's tar stream)."""
FRAME_TIMEOUT_S = 300.0
"""Once a frame has started, the time its remaining bytes may take."""
PREAUTH_HEADER_BYTES = 64 << 10
"""Largest header a server reads before the connection has presented its token."""
PAYLOAD_BYTES: dict[str, int] = {"put": MAX_PAYLOAD_BYTES, "verify": MAX_PAYLOAD_BYTES}
"""Largest payload of each request type; any other request carries none."""
IDLE_TIMEOUT_S = 900.0
"""A server closes an authenticated connection with nothing in flight silent this long."""
ID_MAX = 128


# ---- errors that are not infrastructure failures


class RemoteError(SandfleetError):
    """An error reply that is not an infrastructure failure (a bad request, a bad token)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(message)

    def to_dict(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "message": self.message}


class ProtocolError(RemoteError):
    """Broken framing: the connection is closed."""


class BadRequest(RemoteError):
    """A message that does not parse or validate, or asks for something impossible."""


class Unauthorized(RemoteError):
    """A missing or wrong fleet token."""


class UnknownLease(RemoteError):
    """A worker that holds no such lease (the controller knows why: ask it)."""


class LeaseClosed(RemoteError):
    """A lease its holder already released."""


REMOTE_ERRORS: dict[str, type[Exception]] = {
    **{cls.__name__: cls for cls in (RemoteError, BadRequest, Unauthorized, UnknownLease,
                                     LeaseClosed)},
    "FileNotFoundError": FileNotFoundError,
    "TimeoutError": TimeoutError,
}


def error_to_dict(exc: BaseException) -> dict[str, Any]:
    """The wire form of an exception raised by a handler."""
    if isinstance(exc, (InfraError, RemoteError)):
        return exc.to_dict()
    if isinstance(exc, (FileNotFoundError, TimeoutError)):
        return {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, (ValueError, ValidationError, KeyError)):
        return {"error": "BadRequest", "message": str(exc)[:2000]}
    return {"error": "RemoteError", "message": f"{type(exc).__name__}: {exc}"[:2000]}


def error_from_dict(data: dict[str, Any]) -> Exception:
    """Rebuild an error reply: infra errors from ``ERRORS``, others from ``REMOTE_ERRORS``."""
    name = str(data.get("error", ""))
    if name in ERRORS:
        return InfraError.from_dict(data)
    cls = REMOTE_ERRORS.get(name, RemoteError)
    message = str(data.get("message", name))
    if cls is RemoteError and name not in REMOTE_ERRORS:
        message = f"{name}: {message}"
    return cls(message)


# ---- messages


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Request(Message):
    v: int = PROTOCOL_VERSION
    """Protocol version; a server answers other versions with BadRequest."""
    id: str = Field(min_length=1, max_length=ID_MAX)
    """Request id: the reply carries it; a retry reuses it."""
    token: str = Field(default="", max_length=256)
    """The fleet's auth token (from the state dir's controller.json)."""


class Ping(Request):
    type: Literal["ping"] = "ping"


class Acquire(Request):
    """Client -> controller: a sandbox lease, granted when a worker slot is free."""

    type: Literal["acquire"] = "acquire"
    image: str = Field(min_length=1, max_length=4096)
    """Path of the SIF image, readable on the worker nodes."""
    cpus: int = Field(default=2, ge=1, le=1024)
    memory_mb: int = Field(default=2048, ge=16)
    storage_mb: int | None = Field(default=None, ge=16)
    """Disk quota of the sandbox's writable layer (the fleet's default if unset)."""
    ttl_s: float | None = Field(default=None, gt=0, le=7 * 86400)
    """The lease expires this long after its last renewal (the fleet's default if unset)."""
    network: bool = False
    wait_s: float | None = Field(default=None, ge=0)
    """How long to queue for capacity before CapacityTimeout (the fleet's default if
    unset)."""
    client: str = Field(default="", max_length=256)
    """Who asks (fair queueing is round-robin over clients)."""
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    max_lifetime_s: float | None = Field(default=None, gt=0)
    """Hard deadline of the sandbox; the fleet's maximum when unset or larger."""


class Renew(Request):
    """Client -> controller: push the lease's expiry to now + ttl; its state back."""

    type: Literal["renew"] = "renew"
    lease_id: str = Field(max_length=ID_MAX)


class Release(Request):
    type: Literal["release"] = "release"
    lease_id: str = Field(max_length=ID_MAX)


class Status(Request):
    type: Literal["status"] = "status"


class Shutdown(Request):
    """To the controller: ``sandfleet down``. To a worker: stop sandboxes and exit."""

    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


class LeaseActivity(Message):
    idle_s: float
    """Seconds since the lease's last exec, put or get started or ended."""
    pinned: bool = False
    """A command is running on it now (pinned leases do not expire)."""


class Register(Request):
    """Worker -> controller, at start and whenever the controller does not know it."""

    type: Literal["register"] = "register"
    worker_id: str = Field(max_length=ID_MAX)
    name: str = Field(default="", max_length=256)
    """The provider's name for the worker (``local-0``, the Slurm job id)."""
    address: str = Field(max_length=512)
    node: str = Field(max_length=256)
    slots: int = Field(ge=1)
    """CPUs this worker hands out."""
    memory_mb: int = Field(ge=16)
    job_id: str = Field(default="", max_length=128)
    ends_at: float | None = None
    """Wall-clock time the worker's job ends (Slurm time limit), if any."""
    leases: dict[str, LeaseActivity] = Field(default_factory=dict)
    """Sandboxes it runs now, by lease id."""


class Heartbeat(Request):
    type: Literal["heartbeat"] = "heartbeat"
    worker_id: str = Field(max_length=ID_MAX)
    leases: dict[str, LeaseActivity] = Field(default_factory=dict)
    lost: dict[str, str] = Field(default_factory=dict)
    """Leases whose sandbox died under the worker: lease id -> reason."""
    leaving: str = Field(default="", max_length=1000)
    """Set by a worker about to exit (SIGTERM, scancel, preemption, time limit): why. Its
    leases then fail with NodeLost at once instead of after ``lost_after_s``."""


class StartSandbox(Request):
    """Controller -> worker: start the lease's sandbox; replies once commands can run."""

    type: Literal["start_sandbox"] = "start_sandbox"
    lease_id: str = Field(max_length=ID_MAX)
    spec: dict[str, Any]
    """A ``SandboxSpec.to_dict()``."""


class StopSandbox(Request):
    type: Literal["stop_sandbox"] = "stop_sandbox"
    lease_id: str = Field(max_length=ID_MAX)
    reason: str = ""


class Exec(Request):
    """Client -> worker: one command in the lease's persistent shell."""

    type: Literal["exec"] = "exec"
    lease_id: str = Field(max_length=ID_MAX)
    command: str = Field(max_length=1 << 20)
    timeout: float = Field(gt=0, le=7 * 86400)


class Put(Request):
    """Client -> worker: the payload (a tar stream) unpacked at ``path`` in the sandbox.

    The archive holds one member tree named ``name``; it lands as ``path`` (file or dir).
    """

    type: Literal["put"] = "put"
    lease_id: str = Field(max_length=ID_MAX)
    path: str = Field(min_length=1, max_length=4096)
    name: str = Field(min_length=1, max_length=255)


class Get(Request):
    """Client -> worker: a tar stream of ``path`` (one member tree named by its basename)."""

    type: Literal["get"] = "get"
    lease_id: str = Field(max_length=ID_MAX)
    path: str = Field(min_length=1, max_length=4096)


class Verify(Request):
    """Client -> worker: run a task's verifier beside the lease's sandbox.

    The payload is a tar stream of the tests folder (one member tree named ``name``), which
    the verifier sees as /tests; the reply's payload is a tar stream of what it left in
    /logs/verifier (one member tree named ``verifier``). See the runtime's ``verify``.
    """

    type: Literal["verify"] = "verify"
    lease_id: str = Field(max_length=ID_MAX)
    name: str = Field(min_length=1, max_length=255)
    command: list[str] = Field(min_length=1, max_length=256)
    cwd: str | None = Field(default=None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    timeout: float = Field(gt=0, le=7 * 86400)
    agent_system: bool = False
    """Let the verifier run the agent's system tools (/usr, /bin, /lib, /etc) instead of
    the image's: a task opts in when it grades what the agent installed."""


AnyRequest = Annotated[Ping | Acquire | Renew | Release | Status | Shutdown | Register
                       | Heartbeat | StartSandbox | StopSandbox | Exec | Put | Get | Verify,
                       Field(discriminator="type")]
REQUEST = TypeAdapter(AnyRequest)


class Reply(Message):
    type: Literal["reply"] = "reply"
    v: int = PROTOCOL_VERSION
    id: str = Field(max_length=ID_MAX)
    ok: bool
    result: dict[str, Any] = Field(default_factory=dict)
    error: dict[str, Any] | None = None


class Grant(Message):
    """The result of ``acquire`` (and, with ``state``, of ``renew``)."""

    lease_id: str
    sandbox_id: str
    worker_id: str
    worker_address: str
    node: str
    granted_at: float
    """Wall-clock time of the grant: the rollout's time budget starts here."""
    queued_s: float
    """Seconds the acquire waited for a free slot (the sandbox's start is not included)."""
    expires_at: float
    ttl_s: float


class ExecReply(Message):
    """The result of ``exec``; the output (UTF-8) is the payload."""

    exit_code: int
    timed_out: bool
    oom: bool
    duration_s: float


class VerifyReply(ExecReply):
    """The result of ``verify``; the payload is the tar stream of /logs/verifier."""

    output: str
    """The verifier's stdout and stderr (its last 64 KiB)."""


_ids = itertools.count()
_id_prefix = os.urandom(4).hex()


def new_id(prefix: str = "r") -> str:
    """A request id unique to this process and, with high probability, the fleet (the
    random tail, from ``random``'s generator, which is reseeded in a forked child, tells a
    fork's ids from its parent's; no system call per id)."""
    return f"{prefix}{_id_prefix}{next(_ids):x}{random.getrandbits(24):06x}"


def check_token(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


# ---- frames


async def read_frame(reader: asyncio.StreamReader, *, idle_timeout: float | None = None,
                     max_header: int = MAX_HEADER_BYTES, max_payload: int = MAX_PAYLOAD_BYTES,
                     frame_timeout: float = FRAME_TIMEOUT_S) -> tuple[dict, bytes] | None:
    """The next frame as (header, payload); None at a clean end of stream.

    ProtocolError on broken framing (lengths over the limits, a truncated frame, a header
    that is not a JSON object); TimeoutError when no frame starts within ``idle_timeout``.
    """
    try:
        if idle_timeout is None:
            prefix = await reader.readexactly(PREFIX.size)
        else:
            async with asyncio.timeout(idle_timeout):  # asyncio.timeout: no task per call
                prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ProtocolError("truncated frame prefix") from None
    header_len, payload_len = PREFIX.unpack(prefix)
    if not 2 <= header_len <= max_header:
        raise ProtocolError(f"header length {header_len} outside [2, {max_header}]")
    if payload_len > max_payload:
        raise ProtocolError(f"payload length {payload_len} over {max_payload}")
    try:
        async with asyncio.timeout(frame_timeout):
            raw = await reader.readexactly(header_len)
            payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError:
        raise ProtocolError("truncated frame") from None
    except TimeoutError:
        raise ProtocolError(f"frame not complete after {frame_timeout:.0f}s") from None
    return _header(raw), payload


def encode_frame(header: dict | BaseModel, payload: bytes = b"") -> bytes:
    return _prefixed(header, len(payload)) + payload


def _prefixed(header: dict | BaseModel, payload_len: int) -> bytes:
    """A frame's prefix and header (ValueError when the header is not JSON-serializable)."""
    raw = to_json(header)
    return PREFIX.pack(len(raw), payload_len) + raw


async def write_frame(writer: asyncio.StreamWriter, header: dict | BaseModel,
                      payload: bytes = b"", *, timeout: float = FRAME_TIMEOUT_S) -> None:
    if len(payload) > 1 << 16:  # no copy of a large payload
        writer.writelines((_prefixed(header, len(payload)), payload))
    else:
        writer.write(encode_frame(header, payload))
    if writer.transport.get_write_buffer_size() > 0:
        async with asyncio.timeout(timeout):
            await writer.drain()


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad address {address!r}: want host:port")
    return host.strip("[]"), int(port)


# ---- frames on a transport: what Server and Connection share


class _Framed(asyncio.Protocol):
    """One TCP connection's frames, parsed as its bytes arrive: no task, await or timer per
    frame (a fleet's controller handles thousands a second).

    The limits of ``read_frame``: both lengths are checked before a byte of the frame is
    kept, a frame once started must be complete within ``frame_timeout``, and broken framing
    closes this connection only. A frame is written whole, so frames never interleave; a
    peer that lets our writes pile up past the transport's high-water mark for
    ``frame_timeout`` is disconnected.
    """

    def __init__(self, name: str, *, max_header: int = MAX_HEADER_BYTES,
                 max_payload: int = MAX_PAYLOAD_BYTES, frame_timeout: float = FRAME_TIMEOUT_S):
        self.name, self.frame_timeout = name, frame_timeout
        self.max_header, self.max_payload = max_header, max_payload
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer = self.ip = "?"
        self.closing = False
        self.write_paused = False
        self._chunks: list[bytes] = []
        """The bytes of an incomplete frame."""
        self._have = 0
        self._need = 0
        """Bytes the incomplete frame needs in all (its prefix's and header's, while its
        header is incomplete)."""
        self._head: tuple[dict, int, int] | None = None
        """The incomplete frame's header, once checked: (header, its length, payload length)."""
        self._started = 0.0
        self._frame_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._drained: list[asyncio.Future] = []
        self._out: list[bytes] = []
        """Frames queued this turn of the event loop."""

    def frame_received(self, header: dict, payload: bytes) -> None:
        raise NotImplementedError

    def connection_made(self, transport) -> None:
        self.transport = transport
        addr = transport.get_extra_info("peername")
        self.peer = f"{addr[0]}:{addr[1]}" if addr else "?"
        self.ip = str(addr[0]) if addr else "?"

    def data_received(self, data: bytes) -> None:
        fresh = not self._chunks
        if not fresh:
            self._chunks.append(data)
            self._have += len(data)
            if self._have < self._need:
                return
            data, self._chunks, self._have = b"".join(self._chunks), [], 0
        head, self._head = self._head, None  # the checked header of the frame at data[0]
        pos, size, need = 0, len(data), PREFIX.size
        try:
            while not self.closing:
                if head is None:
                    if size - pos < PREFIX.size:
                        need = PREFIX.size
                        break
                    header_len, payload_len = PREFIX.unpack_from(data, pos)
                    if not 2 <= header_len <= self.max_header:
                        raise ProtocolError(f"header length {header_len} outside "
                                            f"[2, {self.max_header}]")
                    if payload_len > self.max_payload:
                        raise ProtocolError(f"payload length {payload_len} over "
                                            f"{self.max_payload}")
                    need = PREFIX.size + header_len
                    if size - pos < need:  # only the header's bytes are waited for
                        break
                    header = _header(data[pos + PREFIX.size:pos + need])
                    self.header_received(header, payload_len)  # before the payload is kept
                    if self.closing:
                        return
                    head = (header, header_len, payload_len)
                header, header_len, payload_len = head
                need = PREFIX.size + header_len + payload_len
                if size - pos < need:
                    break
                start, pos, head = pos + PREFIX.size + header_len, pos + need, None
                self.frame_received(header, data[start:pos] if payload_len else b"")
        except ProtocolError as e:
            self.fail(e)
            return
        if pos < size and not self.closing:
            rest = data[pos:] if pos else data
            self._chunks, self._have, self._need, self._head = [rest], len(rest), need, head
            if pos or fresh:  # a frame began in these bytes
                self._started = self.loop.time()
            if self._frame_timer is None:
                self._frame_timer = self.loop.call_at(self._started + self.frame_timeout,
                                                      self._frame_late)

    def header_received(self, header: dict, payload_len: int) -> None:
        """A frame's header, before any of its payload is kept: raise ProtocolError (or
        close) to refuse the frame."""

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held now."""
        return self._have

    def _frame_late(self) -> None:
        self._frame_timer = None
        if not self._chunks or self.closing:
            return
        left = self._started + self.frame_timeout - self.loop.time()
        if left > 0:
            self._frame_timer = self.loop.call_later(left, self._frame_late)
        else:
            self.fail(ProtocolError(f"frame not complete after {self.frame_timeout:.0f}s"))

    def eof_received(self) -> bool | None:
        if self._chunks:
            self.fail(ProtocolError("truncated frame"))
        return None  # the transport closes

    def fail(self, error: Exception) -> None:
        """Broken framing (or a peer that reads nothing): drop this connection now, with
        whatever it has not taken yet."""
        if not self.closing:
            self.log_failure(f"closing {self.peer}: {error}")
            self.closing = True
            if self.transport is not None:
                self.transport.abort()

    def log_failure(self, what: str) -> None:
        log.warning("%s: %s", self.name, what)

    def close(self) -> None:
        """Close once what was queued is written."""
        self.flush()
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._chunks, self._have, self._head = [], 0, None
        for timer in (self._frame_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._wake_drained(ConnectionResetError(f"connection to {self.peer} closed"))

    def send(self, header: dict | BaseModel, payload: bytes = b"") -> None:
        """Queue one frame (ConnectionResetError once the connection is closing). The
        frames queued in one turn of the event loop go out in one write at its end: one
        system call, not one per frame."""
        if self.closing or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError(f"connection to {self.peer} closed")
        if not self._out:
            self.loop.call_soon(self.flush)
        if len(payload) > 1 << 16:  # no copy of a large payload
            self._out += (_prefixed(header, len(payload)), payload)
        else:
            self._out.append(encode_frame(header, payload))

    def flush(self) -> None:
        """Write the queued frames now."""
        out, self._out = self._out, []
        if not out or self.transport is None or self.transport.is_closing():
            return
        if len(out) == 1:
            self.transport.write(out[0])
        elif max(map(len, out)) > 1 << 16:
            for data in out:
                self.transport.write(data)
        else:
            self.transport.write(b"".join(out))

    def pause_writing(self) -> None:
        self.write_paused = True
        self._write_timer = self.loop.call_later(self.frame_timeout, self.fail, ProtocolError(
            f"it read nothing for {self.frame_timeout:.0f}s"))

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        self._wake_drained(None)

    async def drained(self) -> None:
        """Return once the transport takes writes again."""
        if self.write_paused and not self.closing:
            future = self.loop.create_future()
            self._drained.append(future)
            await future
        if self.closing:
            raise ConnectionResetError(f"connection to {self.peer} closed")

    def _wake_drained(self, error: Exception | None) -> None:
        waiters, self._drained = self._drained, []
        settle(waiters, error)


def settle(futures: list[asyncio.Future], error: BaseException | None) -> None:
    """Resolve the futures not done yet: with None, or with ``error``."""
    for future in futures:
        if not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)


def _header(raw: bytes) -> dict:
    try:
        header = from_json(raw)
    except ValueError:
        raise ProtocolError("header is not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    return header


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


# ---- server

HandlerResult = dict | tuple[dict, bytes] | None
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

    ``handler(request, payload, peer)`` returns the result dict, ``(result, payload)`` or
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


class _Served(_Framed):
    """A connection to a ``Server``: each header checked as it completes, each request
    handled as its frame does."""

    def __init__(self, server: Server):
        limits = server.limits
        super().__init__(server.name, max_header=limits.preauth_header_bytes,
                         max_payload=max(limits.payload_bytes.values(), default=0))
        self.server = server
        self.running: set[asyncio.Future] = set()
        self.backlog: deque[tuple[dict, bytes]] = deque()
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

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.peer_info = Peer(self.peer)
        if not self.server._admit(self):
            self.closing = True
            transport.abort()
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

    def header_received(self, header: dict, payload_len: int) -> None:
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

    def _refuse(self, header: dict, error: RemoteError, why: str) -> None:
        """Answer the frame with ``error`` and drop the connection without reading on: the
        reply and an end of stream go out, the peer's further bytes stay unread."""
        rid = header.get("id") if isinstance(header.get("id"), str) else ""
        self.server.rejections.note(self.ip, f"{self.peer}: {why}")
        self._reply(rid[:ID_MAX], error=error.to_dict())
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

    def frame_received(self, header: dict, payload: bytes) -> None:
        if self.backlog or len(self.running) >= self.server.per_connection:
            self.backlog.append((header, payload))
            self._pace()
        else:
            self._handle(header, payload)

    def _handle(self, header: dict, payload: bytes) -> None:
        server = self.server
        rid = header.get("id") if isinstance(header.get("id"), str) else ""
        rid = rid[:ID_MAX]
        try:
            if header.get("v") != PROTOCOL_VERSION:
                raise BadRequest(f"protocol version {header.get('v')!r} not supported "
                                 f"(this {server.name} speaks {PROTOCOL_VERSION})")
            request = REQUEST.validate_python(header)
        except (ValidationError, BadRequest) as e:
            self._reply(rid, error=error_to_dict(
                e if isinstance(e, BadRequest) else BadRequest(_short(e))))
            return
        try:
            out = server.handler(request, payload, self.peer_info)
        except Exception as e:  # noqa: BLE001 - the boundary: every failure becomes a reply
            self._failed(request, e)
            return
        if out is None or isinstance(out, (dict, tuple)):
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

    def _reply(self, rid: str, *, result: dict | None = None, error: dict | None = None,
               payload: bytes = b"") -> None:
        header = {"type": "reply", "v": PROTOCOL_VERSION, "id": rid, "ok": error is None,
                  "result": result or {}, "error": error}
        self._last = self.loop.time()
        try:
            self.send(header, payload)
        except ConnectionError as e:
            log.debug("reply %s not sent: %s", rid, e)
        except ValueError as e:  # a result that is not JSON: a bug, but the asker hears of it
            log.error("%s: reply %s not serializable: %s", self.name, rid, e)
            self.send({**header, "ok": False, "result": {}, "error": RemoteError(
                f"reply not serializable: {e}"[:2000]).to_dict()})


def _short(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'message'}: {err['msg']}"
                     for err in e.errors()[:5])


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
        header: dict | Request = message
        if not message.token:
            header = message.model_dump()
            header["token"] = self.token
        framed = self._framed
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
            if self._framed.write_paused:
                await self._framed.drained()
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
        self._used = self._framed.loop.time()
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
        self._sweep = self._framed.loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._sweep, self._sweep_at = None, math.inf
        now, earliest = self._framed.loop.time(), math.inf
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


class _Replies(_Framed):
    """A ``Connection``'s transport: replies matched to requests as they arrive."""

    def __init__(self, conn: Connection):
        super().__init__(f"connection to {conn.address}")
        self.conn = conn
        self.gone = self.loop.create_future()

    def frame_received(self, header: dict, payload: bytes) -> None:
        try:
            reply = Reply.model_validate(header)
        except ValidationError as e:
            error = ProtocolError(f"bad reply from {self.conn.address}: {_short(e)}")
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


# ---- discovery: the state dir's controller.json

CONTROLLER_FILE = "controller.json"


class ControllerInfo(Message):
    """``<state dir>/controller.json`` (mode 0600): how workers and clients reach the
    controller, and the token they must present."""

    address: str
    """host:port the controller listens on, as others reach it."""
    token: str
    pid: int
    """The controller process (with ``pid_start``, its start time, it names it for good)."""
    pid_start: int | None = None
    host: str = ""
    """The machine the controller runs on."""
    started_at: float = 0.0
    v: int = PROTOCOL_VERSION


def read_controller_info(state_dir: str | os.PathLike) -> ControllerInfo | None:
    """The state dir's controller.json, or None when there is none (or it is unreadable)."""
    from pathlib import Path

    try:
        return ControllerInfo.model_validate_json(Path(state_dir, CONTROLLER_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_private(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable and writable by its owner only."""
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
