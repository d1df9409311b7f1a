"""Lease-independent resources made ahead, so a sandbox's start only takes one.

A ``PreparedPool`` keeps up to ``per_size`` files per size (a local sandbox's formatted
ext4 disk, an Apptainer sandbox's ext3 overlay: whatever ``make(path, size_mb)`` writes)
ready in a folder of its own, made by one background thread at low CPU priority, for the
sizes leases asked for (``want``, or a first ``take``). ``take(size_mb)`` is O(1): it
moves a ready file to where the caller names, or says there is none, and the caller then
makes its own as it would without a pool (a start never fails because the pool is empty).
A file is handed out once and is the taker's from then on (its sandbox deletes it): no
disk is ever reused, so nothing of one lease reaches the next.

Owner and deadline: the pool's folder is ``root/<pid>-<start time>`` of the process that
owns it; a new pool removes every sibling whose process is gone (a crashed worker's
leftovers), ``close`` removes its own, and a file older than ``max_age_s`` is thrown away
and made again. The number kept is bounded by ``room()``, the sandboxes this node may
still start (its quota less those running), so ready files never outnumber the sandboxes
that could use them.

``SANDFLEET_PREPARED=0`` in the environment turns every pool off (``per_size`` 0): each
start makes its own file, as before pools (what the benchmarks compare against).

``ReadyPool`` goes further: whole sandboxes started ahead, for the shapes leases used last
(``local_ready``, ``apptainer_ready``). A runtime on its own starts none
(``SANDFLEET_READY`` or its ``ready`` argument says how many per shape); a worker keeps one
per shape unless those say otherwise.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandfleet.runtime.base import proc_start_time

log = logging.getLogger(__name__)

ENV_VAR = "SANDFLEET_PREPARED"
READY_ENV_VAR = "SANDFLEET_READY"
DEFAULT_PER_SIZE = 2


def per_size_default() -> int:
    """Files kept ready per size: ``$SANDFLEET_PREPARED`` (a count; 0 turns pools off), or
    ``DEFAULT_PER_SIZE``."""
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return DEFAULT_PER_SIZE
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${ENV_VAR}={text!r}: give how many files to keep ready per size "
                         "(0 turns the prepared pool off)") from None
    if value < 0:
        raise ValueError(f"${ENV_VAR}={text!r}: must be 0 or more")
    return value


def ready_default(default: int = 0) -> int:
    """Sandboxes kept started ahead per shape (``ReadyPool``): 0 with
    ``SANDFLEET_PREPARED=0``, else ``$SANDFLEET_READY`` (a count), else ``default`` (0 for a
    runtime on its own; a worker asks for 1)."""
    if per_size_default() == 0:
        return 0
    text = os.environ.get(READY_ENV_VAR, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"${READY_ENV_VAR}={text!r}: give how many sandboxes to keep "
                         "started ahead per shape (0: none)")
    return int(text)


def _owner_alive(name: str) -> bool:
    pid, _, start = name.partition("-")
    return pid.isdigit() and start.isdigit() and proc_start_time(int(pid)) == int(start)


def remove_stale(root: Path) -> list[str]:
    """Remove the pool folders under ``root`` whose owning process is gone; what went."""
    gone = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.is_dir() and not _owner_alive(folder.name):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(str(folder))
    if gone:
        log.info("removed prepared files of ended processes: %s", ", ".join(gone))
    return gone


class PreparedPool:
    """Files made ahead by ``make(path, size_mb)`` (see the module doc)."""

    def __init__(self, root: Path, make: Callable[[Path, int], None], *,
                 per_size: int | None = None, room: Callable[[], int] | None = None,
                 max_age_s: float = 900.0, what: str = "disk"):
        self.root = Path(root)
        self.make, self.what = make, what
        self.per_size = per_size_default() if per_size is None else per_size
        self.room = room or (lambda: self.per_size)
        self.max_age_s = max_age_s
        self.folder = self.root / f"{os.getpid()}-{proc_start_time(os.getpid())}"
        self._ready: dict[int, deque[tuple[Path, float]]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._busy = False
        self._count = 0
        self.made = self.taken = self.missed = 0
        """Files made, handed out, and takes that found none (the caller made its own)."""

    @property
    def enabled(self) -> bool:
        return self.per_size > 0

    def want(self, size_mb: int) -> None:
        """Keep files of ``size_mb`` ready from now on (started in the background)."""
        if not self.enabled:
            return
        with self._cond:
            if self._closed:
                return
            self._ready.setdefault(size_mb, deque())
            if self._thread is None:
                self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
                remove_stale(self.root)
                self.folder.mkdir(mode=0o700, exist_ok=True)
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"prepared-{self.what}")
                self._thread.start()
            self._cond.notify_all()

    def take(self, size_mb: int, dest: Path) -> bool:
        """Move a ready file of ``size_mb`` to ``dest``; False when there is none (then make
        your own). Wants the size from now on either way."""
        if not self.enabled:
            return False
        self.want(size_mb)
        with self._cond:
            queue = self._ready.get(size_mb)
            while queue:
                path, made_at = queue.popleft()
                self._cond.notify_all()  # room for one more
                if time.monotonic() - made_at > self.max_age_s:
                    path.unlink(missing_ok=True)
                    continue
                try:
                    os.rename(path, dest)
                except OSError as e:
                    log.warning("prepared %s %s not taken: %s", self.what, path, e)
                    path.unlink(missing_ok=True)
                    continue
                self.taken += 1
                return True
            self.missed += 1
            return False

    def ready(self) -> dict[int, int]:
        """Files ready now, per size."""
        with self._cond:
            return {size: len(queue) for size, queue in self._ready.items()}

    def idle(self) -> bool:
        """Whether the maker has nothing to do now."""
        with self._cond:
            return not self._busy and (self._closed or self._next() is None)

    def close(self) -> None:
        """Stop making files and remove every file not handed out (the folder with them)."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)

    # ---- the maker thread

    def _next(self) -> int | None:
        """The size to make a file of now (the emptiest wanted one), None if none; drops
        files past their age. Called with the lock held."""
        now = time.monotonic()
        for queue in self._ready.values():
            while queue and now - queue[0][1] > self.max_age_s:
                queue.popleft()[0].unlink(missing_ok=True)
        total = sum(len(q) for q in self._ready.values())
        short = [(len(q), size) for size, q in self._ready.items() if len(q) < self.per_size]
        if not short or total >= max(self.room(), 0):
            return None
        return min(short)[1]

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread:
        except OSError:                                  # its children inherit it
            pass
        while True:
            with self._cond:
                size = self._next()
                while size is None and not self._closed:
                    self._cond.wait(timeout=min(self.max_age_s, 30.0))
                    size = self._next()
                if self._closed or size is None:
                    return
                self._count += 1
                path = self.folder / f"{size}m-{self._count}"
                self._busy = True
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                self.make(tmp, size)
                os.rename(tmp, path)
            except Exception as e:  # noqa: BLE001 - a failed make must not end the pool
                tmp.unlink(missing_ok=True)
                if not self.folder.is_dir():  # its owner removed its state: nothing to keep
                    log.info("prepared %ss: %s is gone; no more are made", self.what,
                             self.folder)
                    with self._cond:
                        self._closed, self._busy = True, False
                        self._ready.clear()
                    return
                log.warning("prepared %s of %d MB not made: %s", self.what, size, e)
                with self._cond:
                    self._busy = False
                    self._cond.wait(timeout=5.0)  # not in a tight loop on a full disk
                continue
            with self._cond:
                self._busy = False
                if self._closed:
                    path.unlink(missing_ok=True)
                    return
                self._ready.setdefault(size, deque()).append((path, time.monotonic()))
                self.made += 1


@dataclass
class Ready:
    """A sandbox started ahead, waiting in a ``ReadyPool``."""

    name: str
    """The runtime's name for it until handed out (one no sandbox id can be)."""
    home: Path
    record: Any
    """Its record (``alive()``), the runtime's kind."""
    made_at: float
    go: int = -1
    """The local runtime's: write end of pid 1's lifetime pipe (closing it ends it)."""


class ReadyPool:
    """Whole sandboxes started ahead for the *shapes* (the part of a spec a sandbox is made
    for) leases used last, handed out once each: the generic half. A runtime fills the
    hooks ``shape``, ``_start``, ``_adopt`` and ``_end`` (``local_ready``,
    ``apptainer_ready``). ``per_shape`` per shape for the ``shapes`` shapes used last,
    never more than ``room()``; a sandbox older than ``max_age_s`` is ended, never handed
    out; ``per_shape`` None: ``ready_default()``. Its folder is ``root/<pid>-<start>``."""

    def __init__(self, root: Path, room: Callable[[], int], *, per_shape: int | None = None,
                 shapes: int = 4, max_age_s: float = 120.0):
        self.per_shape = ready_default() if per_shape is None else per_shape
        self.room, self.shapes, self.max_age_s = room, shapes, max_age_s
        self.tag = f"{os.getpid()}-{proc_start_time(os.getpid())}"
        self.root = Path(root)
        self.folder = self.root / self.tag
        self._ready: dict[str, deque[Ready]] = {}
        self._wanted: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._count = 0
        self._busy = False
        self._enders: list[threading.Thread] = []
        self.taken = self.missed = 0
        """Hand-outs, and takes that found none (the caller started its own)."""

    # ---- the hooks

    def shape(self, spec: Any) -> str:
        raise NotImplementedError

    def _start(self, number: int, spec: Any, extra: Any) -> Ready:
        """Start sandbox ``number`` of ``spec``'s shape ahead (ended again on error)."""
        raise NotImplementedError

    def _adopt(self, item: Ready, sandbox_id: str, spec: Any) -> None:
        """Make ``item`` the lease's ``sandbox_id`` with ``spec`` applied."""
        raise NotImplementedError

    def _end(self, item: Ready, also: str = "") -> None:
        """End ``item`` and remove what it left (``also``: a lease's name it half took)."""
        raise NotImplementedError

    # ---- what the runtime calls

    def want(self, spec: Any, extra: Any = None) -> None:
        """Keep sandboxes of ``spec``'s shape ready (``extra``: what ``_start`` needs)."""
        if self.per_shape <= 0:
            return
        try:
            key = self.shape(spec)
        except OSError:  # its image is gone already
            return
        with self._cond:
            if self._closed:
                return
            self._wanted[key] = (spec, extra)
            self._wanted.move_to_end(key)
            while len(self._wanted) > self.shapes:
                old, _ = self._wanted.popitem(last=False)
                for item in self._ready.pop(old, deque()):
                    self._end_later(item)
            if self._thread is None:
                self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="ready-sandboxes")
                self._thread.start()
            self._cond.notify_all()

    def take(self, sandbox_id: str, spec: Any) -> bool:
        """Make a ready sandbox of ``spec``'s shape the lease's ``sandbox_id``; False when
        there is none or the hand-out failed (that one is ended; start one as without)."""
        if self.per_shape <= 0:
            return False
        try:
            key = self.shape(spec)
        except OSError:  # its image is gone: the caller's start says so
            return False
        with self._cond:
            queue, item = self._ready.get(key), None
            while queue:
                item = queue.popleft()
                if time.monotonic() - item.made_at < self.max_age_s and item.record.alive():
                    break
                self._end_later(item)
                item = None
            self._cond.notify_all()
            if item is None:
                self.missed += 1
                return False
        try:
            self._adopt(item, sandbox_id, spec)
        except Exception as e:  # noqa: BLE001 - never fail a start for the pool's sake
            log.warning("ready sandbox %s not handed to %s: %s", item.name, sandbox_id, e)
            self._end(item, also=sandbox_id)
            return False
        self.taken += 1
        return True

    def ready(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._ready.values())

    def idle(self) -> bool:
        """Whether the maker has nothing to do now (every shape kept has its sandboxes)."""
        with self._cond:
            return not self._busy and (self._closed or self._next() is None)

    def items(self) -> list[Ready]:
        with self._cond:
            return [item for queue in self._ready.values() for item in queue]

    def close(self) -> None:
        """End every sandbox still waiting, and the maker."""
        with self._cond:
            self._closed = True
            items = [item for queue in self._ready.values() for item in queue]
            self._ready.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=120)
        for item in items:
            self._end(item)
        for ender in list(self._enders):
            ender.join(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _end_later(self, item: Ready) -> None:
        """End ``item`` in a thread of its own (``close`` waits for it)."""
        thread = threading.Thread(target=self._end, args=(item,), daemon=True)
        self._enders = [t for t in self._enders if t.is_alive()] + [thread]
        thread.start()

    # ---- the maker

    def _next(self) -> tuple[str, Any, Any] | None:
        """A shape short of sandboxes, the one used last first (lock held)."""
        if self.room() <= 0:
            return None
        for key in reversed(self._wanted):
            if len(self._ready.get(key, ())) < self.per_shape:
                return key, *self._wanted[key]
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                for queue in self._ready.values():
                    while queue and now - queue[0].made_at > self.max_age_s:
                        self._end_later(queue.popleft())
                job = None if self._closed else self._next()
                while job is None and not self._closed:
                    self._cond.wait(timeout=min(self.max_age_s / 2, 30.0))
                    job = self._next()
                if self._closed or job is None:
                    return
                self._count += 1
                number = self._count
                self._busy = True
            key, spec, extra = job
            try:
                item = self._start(number, spec, extra)
            except Exception as e:  # noqa: BLE001 - a failed start must not end the maker
                log.warning("sandbox ahead for %s not started: %s",
                            getattr(spec, "image", spec), e)
                with self._cond:
                    self._busy = False
                    if not Path(getattr(spec, "image", "")).is_file():
                        self._wanted.pop(key, None)  # its image is gone: not again
                    self._cond.wait(timeout=5.0)
                continue
            with self._cond:
                self._busy = False
                keep = not self._closed and key in self._wanted
                if keep:
                    self._ready.setdefault(key, deque()).append(item)
            if not keep:  # here, in the thread close() waits for
                self._end(item)
