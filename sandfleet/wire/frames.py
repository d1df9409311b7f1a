"""Frames: the one framing implementation, shared by servers and clients.

::

    +----------------+-----------------+-------------------+------------------+
    | header length  | payload length  | header (JSON)     | payload (bytes)  |
    | uint32, BE     | uint32, BE      | UTF-8 object      | raw, optional    |
    +----------------+-----------------+-------------------+------------------+

Both lengths are checked against the reader's limits (``frame_lengths``) *before*
anything is read, so a malicious length never allocates memory; a frame that breaks the
framing (bad lengths, a header that is not a JSON object: ``decode_header``) raises
``ProtocolError``, which closes that connection and only that one. The payload carries
bulk bytes without JSON escaping: exec output, tar streams of files.

Three readers, one set of rules: ``FramedProtocol`` (an ``asyncio.Protocol`` that parses
frames as bytes arrive: servers and the async client), ``read_frame`` (an asyncio stream)
and ``recv_frame`` (a blocking socket: the sync client's exec). ``encode_frame`` writes them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any, TypeVar, cast

from pydantic import BaseModel
from pydantic_core import from_json, to_json

from sandfleet.errors import ProtocolError

log = logging.getLogger(__name__)

PREFIX = struct.Struct(">II")
"""Header length, payload length: big-endian uint32 each."""
MAX_HEADER_BYTES = 16 << 20
"""Largest JSON header accepted (a status reply of a large fleet fits)."""
MAX_PAYLOAD_BYTES = 512 << 20
"""Largest binary payload accepted (one file transfer's tar stream)."""
FRAME_TIMEOUT_S = 300.0
"""Once a frame has started, the time its remaining bytes may take."""
PREAUTH_HEADER_BYTES = 64 << 10
"""Largest header a server reads before the connection has presented its token."""
LARGE_PAYLOAD = 1 << 16
"""Payloads larger than this are written beside their prefix, not copied into one buffer."""

Header = dict[str, Any]
T = TypeVar("T")


def frame_lengths(data: bytes, offset: int = 0, *, max_header: int = MAX_HEADER_BYTES,
                  max_payload: int = MAX_PAYLOAD_BYTES) -> tuple[int, int]:
    """The (header, payload) lengths of the prefix at ``data[offset:]``, checked against
    the limits (ProtocolError when outside them)."""
    header_len, payload_len = PREFIX.unpack_from(data, offset)
    if not 2 <= header_len <= max_header:
        raise ProtocolError(f"header length {header_len} outside [2, {max_header}]")
    if payload_len > max_payload:
        raise ProtocolError(f"payload length {payload_len} over {max_payload}")
    return header_len, payload_len


def decode_header(raw: bytes) -> Header:
    """A frame's header: a JSON object (ProtocolError otherwise)."""
    try:
        header = from_json(raw)
    except ValueError:
        raise ProtocolError("header is not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    return header


def encode_head(header: Header | BaseModel, payload_len: int) -> bytes:
    """A frame's prefix and header (ValueError when the header is not JSON-serializable)."""
    raw = to_json(header)
    return PREFIX.pack(len(raw), payload_len) + raw


def encode_frame(header: Header | BaseModel, payload: bytes = b"") -> bytes:
    """One whole frame: prefix, header (a dict or a message, as JSON), payload."""
    return encode_head(header, len(payload)) + payload


# ---- frames on an asyncio stream, and on a blocking socket


async def read_frame(reader: asyncio.StreamReader, *, idle_timeout: float | None = None,
                     max_header: int = MAX_HEADER_BYTES, max_payload: int = MAX_PAYLOAD_BYTES,
                     frame_timeout: float = FRAME_TIMEOUT_S) -> tuple[Header, bytes] | None:
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
    header_len, payload_len = frame_lengths(prefix, max_header=max_header,
                                            max_payload=max_payload)
    try:
        async with asyncio.timeout(frame_timeout):
            raw = await reader.readexactly(header_len)
            payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError:
        raise ProtocolError("truncated frame") from None
    except TimeoutError:
        raise ProtocolError(f"frame not complete after {frame_timeout:.0f}s") from None
    return decode_header(raw), payload


async def write_frame(writer: asyncio.StreamWriter, header: Header | BaseModel,
                      payload: bytes = b"", *, timeout: float = FRAME_TIMEOUT_S) -> None:
    if len(payload) > LARGE_PAYLOAD:  # no copy of a large payload
        writer.writelines((encode_head(header, len(payload)), payload))
    else:
        writer.write(encode_frame(header, payload))
    if writer.transport.get_write_buffer_size() > 0:
        async with asyncio.timeout(timeout):
            await writer.drain()


def recv_frame(sock: socket.socket, *, max_header: int = MAX_HEADER_BYTES,
               max_payload: int = MAX_PAYLOAD_BYTES,
               decode: Callable[[bytes], T] = decode_header,  # type: ignore[assignment]
               ) -> tuple[T, bytes]:
    """The next frame from a blocking socket (its own timeout applies to each read), its
    header read by ``decode`` (``decode_header``; a model's ``model_validate_json`` parses
    it straight into the model). ProtocolError on broken framing (or whatever ``decode``
    raises on a bad header); ConnectionResetError when the peer closes first."""
    header_len, payload_len = frame_lengths(_recv_exactly(sock, PREFIX.size),
                                            max_header=max_header, max_payload=max_payload)
    header = decode(_recv_exactly(sock, header_len))
    return header, _recv_exactly(sock, payload_len) if payload_len else b""


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionResetError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


# ---- frames on a transport: what servers and client connections share


class FramedProtocol(asyncio.Protocol):
    """One TCP connection's frames, parsed as its bytes arrive: no task, await or timer per
    frame (a fleet's controller handles thousands a second).

    The limits of ``read_frame``: both lengths are checked before a byte of the frame is
    kept, a frame once started must be complete within ``frame_timeout``, and broken framing
    closes this connection only. A frame is written whole, so frames never interleave; a
    peer that lets our writes pile up past the transport's high-water mark for
    ``frame_timeout`` is disconnected. Subclasses fill ``frame_received`` (and may refuse a
    frame in ``header_received``, before its payload is kept).
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
        self._head: tuple[Header, int, int] | None = None
        """The incomplete frame's header, once checked: (header, its length, payload length)."""
        self._started = 0.0
        self._frame_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._drained: list[asyncio.Future] = []
        self._out: list[bytes] = []
        """Frames queued this turn of the event loop."""

    def frame_received(self, header: Header, payload: bytes) -> None:
        raise NotImplementedError

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # TCP: a full transport
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
                    header_len, payload_len = frame_lengths(
                        data, pos, max_header=self.max_header, max_payload=self.max_payload)
                    need = PREFIX.size + header_len
                    if size - pos < need:  # only the header's bytes are waited for
                        break
                    header = decode_header(data[pos + PREFIX.size:pos + need])
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

    def header_received(self, header: Header, payload_len: int) -> None:
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

    def send(self, header: Header | BaseModel, payload: bytes = b"") -> None:
        """Queue one frame (ConnectionResetError once the connection is closing). The
        frames queued in one turn of the event loop go out in one write at its end: one
        system call, not one per frame."""
        if self.closing or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError(f"connection to {self.peer} closed")
        if not self._out:
            self.loop.call_soon(self.flush)
        if len(payload) > LARGE_PAYLOAD:  # no copy of a large payload
            self._out += (encode_head(header, len(payload)), payload)
        else:
            self._out.append(encode_frame(header, payload))

    def flush(self) -> None:
        """Write the queued frames now."""
        out, self._out = self._out, []
        if not out or self.transport is None or self.transport.is_closing():
            return
        if len(out) == 1:
            self.transport.write(out[0])
        elif max(map(len, out)) > LARGE_PAYLOAD:
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
