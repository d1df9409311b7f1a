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
are matched by id), and the ``Server`` runs each request of a connection in its own task
(bounded per connection), so a slow ``exec`` never delays a ``renew`` on the same socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from sandfleet.errors import ERRORS, InfraError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
PREFIX = struct.Struct(">II")
MAX_HEADER_BYTES = 16 << 20
"""Largest JSON header accepted (a status reply of a large fleet fits)."""
MAX_PAYLOAD_BYTES = 512 << 20
"""Largest binary payload accepted (one file transfer's tar stream)."""
FRAME_TIMEOUT_S = 300.0
"""Once a frame has started, the time its remaining bytes may take."""
ID_MAX = 128


# ---- errors that are not infrastructure failures


class RemoteError(Exception):
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


AnyRequest = Annotated[Ping | Acquire | Renew | Release | Status | Shutdown | Register
                       | Heartbeat | StartSandbox | StopSandbox | Exec | Put | Get,
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


_ids = itertools.count()
_id_prefix = os.urandom(4).hex()


def new_id(prefix: str = "r") -> str:
    """A request id unique to this process and, with high probability, the fleet."""
    return f"{prefix}{_id_prefix}{next(_ids):x}{os.urandom(3).hex()}"


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
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("header is not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    return header, payload


def encode_frame(header: dict | BaseModel, payload: bytes = b"") -> bytes:
    if isinstance(header, BaseModel):
        raw = header.model_dump_json().encode()
    else:
        raw = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(len(raw), len(payload)) + raw + payload


async def write_frame(writer: asyncio.StreamWriter, header: dict | BaseModel,
                      payload: bytes = b"", *, timeout: float = FRAME_TIMEOUT_S) -> None:
    data = encode_frame(header, payload)
    if len(payload) > 1 << 16:
        writer.write(data[:-len(payload)])
        writer.write(payload)
    else:
        writer.write(data)
    if writer.transport.get_write_buffer_size() > 0:
        async with asyncio.timeout(timeout):
            await writer.drain()


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad address {address!r}: want host:port")
    return host.strip("[]"), int(port)


# ---- server

Handler = Callable[[Any, bytes, "Peer"], Awaitable[dict | tuple[dict, bytes] | None]]


class Peer:
    """What a handler knows about the connection a request came on."""

    def __init__(self, address: str):
        self.address = address


class Server:
    """A TCP server that authenticates and validates requests and runs ``handler`` on each.

    ``handler(request, payload, peer)`` returns the result dict, ``(result, payload)``, or
    None; raising sends an error reply. A bad token is answered with Unauthorized and the
    connection closed; an invalid message gets BadRequest; broken framing closes the
    connection. None of these touch other connections.
    """

    def __init__(self, handler: Handler, token: str, *, name: str = "server",
                 max_payload: int = MAX_PAYLOAD_BYTES, per_connection: int = 256,
                 idle_timeout: float | None = None):
        self.handler, self.token, self.name = handler, token, name
        self.max_payload, self.per_connection = max_payload, per_connection
        self.idle_timeout = idle_timeout
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self, host: str, port: int = 0) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, port,
                                                  limit=1 << 20, reuse_address=True)
        sock = self._server.sockets[0].getsockname()
        return sock[0], sock[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._conns.add(task)
        peer_addr = writer.get_extra_info("peername")
        peer = Peer(f"{peer_addr[0]}:{peer_addr[1]}" if peer_addr else "?")
        lock = asyncio.Lock()
        slots = asyncio.Semaphore(self.per_connection)
        running: set[asyncio.Task] = set()
        try:
            while True:
                await slots.acquire()
                try:
                    frame = await read_frame(reader, idle_timeout=self.idle_timeout,
                                             max_payload=self.max_payload)
                except ProtocolError as e:
                    log.warning("%s: closing %s: %s", self.name, peer.address, e)
                    return
                except (TimeoutError, ConnectionError):
                    return
                if frame is None:
                    return
                header, payload = frame
                rid = header.get("id") if isinstance(header.get("id"), str) else ""
                rid = rid[:ID_MAX]
                if not check_token(str(header.get("token", "")), self.token):
                    log.warning("%s: bad token from %s", self.name, peer.address)
                    await self._reply(writer, lock, rid, error=Unauthorized(
                        "bad or missing fleet token").to_dict())
                    return
                try:
                    if header.get("v") != PROTOCOL_VERSION:
                        raise BadRequest(f"protocol version {header.get('v')!r} not supported "
                                         f"(this {self.name} speaks {PROTOCOL_VERSION})")
                    request = REQUEST.validate_python(header)
                except (ValidationError, BadRequest) as e:
                    slots.release()
                    await self._reply(writer, lock, rid, error=error_to_dict(
                        e if isinstance(e, BadRequest) else BadRequest(_short(e))))
                    continue
                job = asyncio.create_task(self._run(request, payload, peer, writer, lock))
                running.add(job)
                job.add_done_callback(running.discard)
                job.add_done_callback(lambda _: slots.release())
        except asyncio.CancelledError:
            pass
        finally:
            for job in list(running):
                job.cancel()
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)
            self._conns.discard(task)

    async def _run(self, request: Any, payload: bytes, peer: Peer,
                   writer: asyncio.StreamWriter, lock: asyncio.Lock) -> None:
        try:
            out = await self.handler(request, payload, peer)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the boundary: every failure becomes an error reply
            if not isinstance(e, (InfraError, RemoteError, FileNotFoundError)):
                log.exception("%s: %s %s failed", self.name, request.type, request.id)
            await self._reply(writer, lock, request.id, error=error_to_dict(e))
            return
        result, data = out if isinstance(out, tuple) else (out or {}, b"")
        await self._reply(writer, lock, request.id, result=result, payload=data)

    @staticmethod
    async def _reply(writer, lock, rid: str, *, result: dict | None = None,
                     error: dict | None = None, payload: bytes = b"") -> None:
        header = {"type": "reply", "v": PROTOCOL_VERSION, "id": rid, "ok": error is None,
                  "result": result or {}, "error": error}
        try:
            async with lock:
                await write_frame(writer, header, payload)
        except (ConnectionError, TimeoutError, RuntimeError) as e:
            log.debug("reply %s not sent: %s", rid, e)


def _short(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'message'}: {err['msg']}"
                     for err in e.errors()[:5])


# ---- client connection


class Connection:
    """One multiplexed client connection: ``request()`` may be called concurrently."""

    def __init__(self, address: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, token: str):
        self.address, self.token = address, token
        self._reader, self._writer = reader, writer
        self._pending: dict[str, asyncio.Future] = {}
        self._lock = asyncio.Lock()
        self._closed: BaseException | None = None
        self._task = asyncio.create_task(self._read_loop())

    @classmethod
    async def open(cls, address: str, token: str, *, timeout: float = 10.0) -> Connection:
        host, port = parse_address(address)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=1 << 20), timeout)
        return cls(address, reader, writer, token)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def _read_loop(self) -> None:
        error: BaseException = ConnectionResetError(f"connection to {self.address} closed")
        try:
            while True:
                frame = await read_frame(self._reader)
                if frame is None:
                    break
                header, payload = frame
                try:
                    reply = Reply.model_validate(header)
                except ValidationError as e:
                    error = ProtocolError(f"bad reply from {self.address}: {_short(e)}")
                    break
                future = self._pending.pop(reply.id, None)
                if future is not None and not future.done():
                    future.set_result((reply, payload))
        except asyncio.CancelledError:
            error = ConnectionAbortedError(f"connection to {self.address} closed")
        except (ProtocolError, ConnectionError, OSError) as e:
            error = e if isinstance(e, ConnectionError) else \
                ConnectionResetError(f"connection to {self.address}: {e}")
        finally:
            self._closed = error
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(error)
            self._pending.clear()
            self._writer.close()

    async def request(self, message: Request, payload: bytes = b"", *,
                      timeout: float | None = 30.0) -> tuple[dict, bytes]:
        """Send ``message`` (its token filled in) and wait for its reply: (result, payload).

        An error reply raises the rebuilt exception; a lost connection raises
        ConnectionError; no reply within ``timeout`` raises TimeoutError.
        """
        if self._closed is not None:
            raise ConnectionResetError(f"connection to {self.address} closed")
        if not message.token:
            message = message.model_copy(update={"token": self.token})
        future = asyncio.get_running_loop().create_future()
        self._pending[message.id] = future
        try:
            async with self._lock:
                await write_frame(self._writer, message, payload)
            async with asyncio.timeout(timeout):
                reply, data = await future
        except TimeoutError:
            raise TimeoutError(f"no reply from {self.address} to {message.type} "
                               f"within {timeout}s") from None
        except (OSError, RuntimeError) as e:
            if isinstance(e, ConnectionError):
                raise
            raise ConnectionResetError(f"connection to {self.address}: {e}") from None
        finally:
            self._pending.pop(message.id, None)
        if not reply.ok:
            raise error_from_dict(reply.error or {})
        return reply.result, data

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task


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
