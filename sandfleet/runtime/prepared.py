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
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from sandfleet.runtime.base import proc_start_time

log = logging.getLogger(__name__)

ENV_VAR = "SANDFLEET_PREPARED"
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
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                self.make(tmp, size)
                os.rename(tmp, path)
            except Exception as e:  # noqa: BLE001 - a failed make must not end the pool
                log.warning("prepared %s of %d MB not made: %s", self.what, size, e)
                tmp.unlink(missing_ok=True)
                with self._cond:
                    self._cond.wait(timeout=5.0)  # not in a tight loop on a full disk
                continue
            with self._cond:
                if self._closed:
                    path.unlink(missing_ok=True)
                    return
                self._ready.setdefault(size, deque()).append((path, time.monotonic()))
                self.made += 1
