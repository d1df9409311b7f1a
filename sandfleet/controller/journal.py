"""The controller's journal: typed events, the file they live in, and ONE replay.

``journal.jsonl`` in the state dir holds one JSON object per line, ``{"e": <kind>, ...,
"t": <unix time>}``. Each kind is one small dataclass below; ``encode`` writes it with its
fields in declaration order and ``t`` last (omitted when unset), byte for byte what the
controller always wrote, so an existing state dir replays unchanged.

``Journal`` appends events with group commit (one writer thread, one fsync for every batch
that waits) and swaps in a snapshot when it grows; ``load`` reads the file back, skipping
a torn last line (a crash mid-write); ``replay`` folds the events into what is still live.
Renewals are never journaled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any, ClassVar

from pydantic_core import to_json

from sandfleet.wire.frames import settle

log = logging.getLogger(__name__)

JOURNAL = "journal.jsonl"


# ---- the events


@dataclass
class Event:
    """One journal line; ``kind`` is its ``"e"``."""

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        EVENTS[cls.kind] = cls

    def to_dict(self) -> dict:
        """``{"e": kind, <fields in declaration order>, "t": t}`` (no ``t`` when unset).
        Every kind declares ``t`` last, and the dataclass ``__init__`` sets the fields in
        declaration order, so ``__dict__`` holds them in the order of the line."""
        data = {"e": self.kind, **self.__dict__}
        if data["t"] is None:
            del data["t"]
        return data


EVENTS: dict[str, type[Event]] = {}


@dataclass
class FleetDown(Event):
    """``sandfleet down`` finished: everything before this line is over."""

    kind: ClassVar[str] = "down"
    t: float | None = None


@dataclass
class Meta(Event):
    """The next worker index (written at the top of every snapshot)."""

    kind: ClassVar[str] = "meta"
    next_index: int = 0
    t: float | None = None


@dataclass
class NodeJoined(Event):
    """A worker registered (first time, or again after it was lost)."""

    kind: ClassVar[str] = "node"
    worker_id: str
    name: str
    address: str
    node: str
    slots: int
    memory_mb: int
    job_id: str = ""
    ends_at: float | None = None
    registered_at: float = 0.0
    t: float | None = None


@dataclass
class NodeEnded(Event):
    """A worker was lost or released."""

    kind: ClassVar[str] = "node_end"
    worker_id: str
    reason: str = ""
    t: float | None = None


@dataclass
class LeaseGranted(Event):
    """A lease's sandbox started on its worker: the lease is held."""

    kind: ClassVar[str] = "grant"
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
    t: float | None = None


@dataclass
class LeaseEnded(Event):
    """A lease ended (released, expired, lost...); ``error`` is what its holder learns."""

    kind: ClassVar[str] = "end"
    lease_id: str
    cause: str
    error: dict
    request_id: str | None = None
    t: float | None = None


@dataclass
class JobSubmitted(Event):
    """The scaler submitted worker ``name`` as provider job ``job_id``."""

    kind: ClassVar[str] = "job"
    job_id: str
    name: str
    index: int = 0
    t: float | None = None


@dataclass
class JobEnded(Event):
    """A worker job ended or was cancelled."""

    kind: ClassVar[str] = "job_end"
    job_id: str
    t: float | None = None


def encode(event: Event) -> bytes:
    """One journal line (with its newline)."""
    return to_json(event.to_dict()) + b"\n"


def decode(data: Any) -> Event | None:
    """The event a parsed line holds; None (logged) when it is none this code knows."""
    if not isinstance(data, dict) or "e" not in data:
        return None
    cls = EVENTS.get(data["e"])
    if cls is None:
        log.warning("journal: unknown event kind %r skipped", data["e"])
        return None
    try:
        return cls(**{k: v for k, v in data.items() if k != "e"})
    except TypeError as e:
        log.warning("journal: malformed %r event skipped: %s", data["e"], e)
        return None


def load(path: Path) -> list[Event]:
    """Every event in the journal; a torn last line (a crash mid-write) is skipped."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for i, line in enumerate(lines):
        try:
            data = json.loads(line)
        except ValueError:
            log.warning("%s: line %d unreadable, skipped", path, i + 1)
            continue
        event = decode(data)
        if event is not None:
            events.append(event)
    return events


def rewrite(path: Path, events: Iterable[Event]) -> None:
    """Replace the journal with ``events`` (atomic: write, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, b"".join(encode(e) for e in events))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


# ---- replay


@dataclass
class Replayed:
    """What a journal says is live: the last word on every node, lease and job."""

    nodes: dict[str, NodeJoined] = field(default_factory=dict)
    leases: dict[str, LeaseGranted] = field(default_factory=dict)
    ends: dict[str, LeaseEnded] = field(default_factory=dict)
    """Ended leases, in the order they first ended."""
    jobs: dict[str, JobSubmitted] = field(default_factory=dict)
    next_index: int = 0


def replay(events: Iterable[Event]) -> Replayed:
    """Fold ``events`` into the live state. Idempotent: a snapshot followed by events it
    already holds folds to the same state."""
    state = Replayed()
    for ev in events:
        if isinstance(ev, FleetDown):
            state.nodes.clear()
            state.leases.clear()
            state.jobs.clear()
            state.ends.clear()
        elif isinstance(ev, NodeJoined):
            state.nodes[ev.worker_id] = ev
        elif isinstance(ev, NodeEnded):
            state.nodes.pop(ev.worker_id, None)
        elif isinstance(ev, LeaseGranted):
            state.leases[ev.lease_id] = ev
        elif isinstance(ev, LeaseEnded):
            state.leases.pop(ev.lease_id, None)
            state.ends[ev.lease_id] = ev
        elif isinstance(ev, JobSubmitted):
            state.jobs[ev.job_id] = ev
            state.next_index = max(state.next_index, int(ev.index) + 1)
        elif isinstance(ev, JobEnded):
            state.jobs.pop(ev.job_id, None)
        elif isinstance(ev, Meta):
            state.next_index = max(state.next_index, int(ev.next_index))
    return state


# ---- the file


class Journal:
    """Append-only JSON lines, fsync'd by group commit: ``commit(event)`` returns a future
    that resolves once the event (and every one before it) is on disk.

    One writer thread owns the file: the events committed in one turn of the event loop
    reach it as one batch, and it writes and fsyncs whatever batches wait when it is free
    (one fsync for all of them), so the loop never blocks on the disk and pays no executor
    round trip per batch. A snapshot swap is queued behind the writes before it.
    """

    load = staticmethod(load)
    rewrite = staticmethod(rewrite)

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

    def commit(self, event: Event) -> asyncio.Future:
        """Queue ``event`` (stamped with the time now unless it has one); the future
        resolves once it (and every event before it) is on disk, or fails with the OSError
        that kept it off (logged here)."""
        if event.t is None:  # type: ignore[attr-defined]
            event.t = round(time.time(), 3)  # type: ignore[attr-defined]
        line = encode(event)
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

    async def append(self, event: Event) -> None:
        await self.commit(event)

    def _hand_over(self) -> None:
        if self._lines:
            self._queue.put(("write", b"".join(self._lines), self._waiters))
            self._lines, self._waiters = [], []

    async def swap(self, events: list[Event]) -> None:
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
                        rewrite(self.path, what)
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
