"""The orchestrator and the trainer as separate processes: what they hand over, as files.

Both sides share the run folder (on shared scratch when they run on different nodes):

    RUN/handover/batches/step-00000042.npz   one trainer step's samples (orchestrator -> trainer)
    RUN/handover/weights/v00000042/          the policy after 42 steps (trainer -> engines)
    RUN/handover/weights/LATEST              "42": the newest complete weights folder
    RUN/handover/alive/<role>                touched every few seconds while <role> runs
    RUN/handover/done/<role>                 written when <role> finished its work

Every file and folder appears whole or not at all: it is written under a temporary name in
the same folder, then renamed (``os.replace``), so a reader never sees half a batch or half
the weights, whatever crashes when. A batch is plain arrays (``np.savez``, no pickle): the
samples' tokens, inference log-probs, loss masks and lengths, their advantages and the
policy version that sampled each, plus a JSON header (the step, the rollout metrics).
A weights folder is written whole by the trainer backend's exporter (``export_to_path``:
Hugging Face safetensors and a completion marker, for the engines' filesystem weight sync);
``set_latest`` then names it in LATEST.

Waiting is bounded: ``get_batch`` and ``wait_weights`` poll until a deadline and raise
``HandoverTimeout`` (naming the file and how long), and stop early with ``PeerGone`` when
the other side's liveness check says it died.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tmax.train.trainer import Sample

FORMAT = "tmax-batch-v1"


class HandoverError(Exception):
    """A handover file is missing, late or unreadable."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


class HandoverTimeout(HandoverError):
    """Nothing arrived before the deadline."""


class PeerGone(HandoverError):
    """The process that should write the file is gone."""


@dataclass(frozen=True)
class Batch:
    """One trainer step's input."""

    step: int
    samples: list[Sample]
    versions: list[int]
    """The policy version that sampled each sample (same order)."""
    meta: dict[str, Any]
    """The orchestrator's header: rollout metrics of the step, free-form."""


def _atomic_file(path: Path, write: Callable[[Path], None]) -> Path:
    """``write`` to a temporary file of this writer's own (process and thread: the
    orchestrator writes from threads), then rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


def _wait(path_of: Callable[[], Path | None], what: Path, timeout: float, poll: float,
          alive: Callable[[], bool] | None) -> Path:
    deadline = time.monotonic() + timeout
    while True:
        found = path_of()
        if found is not None:
            return found
        if alive is not None and not alive():
            raise PeerGone(what, "the process that writes it is gone")
        if time.monotonic() >= deadline:
            raise HandoverTimeout(what, f"not there after {timeout:.0f} s")
        time.sleep(poll)


class Handover:
    """The handover folder of one run (``RUN/handover``)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.root = Path(run_dir) / "handover"
        self.batches = self.root / "batches"
        self.weights = self.root / "weights"
        self.batches.mkdir(parents=True, exist_ok=True)
        self.weights.mkdir(parents=True, exist_ok=True)

    # ---- batches (orchestrator -> trainer)

    def batch_path(self, step: int) -> Path:
        return self.batches / f"step-{step:08d}.npz"

    def put_batch(self, step: int, samples: list[Sample], versions: list[int],
                  meta: dict[str, Any] | None = None) -> Path:
        """Write step ``step``'s batch atomically (a rewrite replaces it whole)."""
        if len(versions) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(versions)} versions")
        for i, s in enumerate(samples):
            if not len(s.tokens) == len(s.old_logp) == len(s.mask):
                raise ValueError(f"sample {i}: tokens, old_logp and mask differ in length")
        header = {"format": FORMAT, "step": step, "meta": meta or {}}
        arrays: dict[str, np.ndarray] = {
            "lengths": np.array([len(s.tokens) for s in samples], dtype=np.int64),
            "tokens": np.array([t for s in samples for t in s.tokens], dtype=np.int64),
            "old_logp": np.array([x for s in samples for x in s.old_logp], dtype=np.float32),
            "mask": np.array([m for s in samples for m in s.mask], dtype=np.int8),
            "advantages": np.array([s.advantage for s in samples], dtype=np.float32),
            "versions": np.array(versions, dtype=np.int64),
            "header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
        }

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy stubs: allow_pickle
                f.flush()
                os.fsync(f.fileno())

        return _atomic_file(self.batch_path(step), write)

    def read_batch(self, step: int) -> Batch:
        path = self.batch_path(step)
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(z["header"].tobytes())
                lengths, tokens = z["lengths"].tolist(), z["tokens"].tolist()
                old, mask = z["old_logp"].tolist(), z["mask"].tolist()
                adv, versions = z["advantages"].tolist(), z["versions"].tolist()
        except FileNotFoundError:
            raise HandoverError(path, "no such batch") from None
        except (OSError, ValueError, KeyError) as e:
            raise HandoverError(path, f"not a readable batch ({e})") from None
        if header.get("format") != FORMAT or header.get("step") != step:
            raise HandoverError(path, f"expected {FORMAT} for step {step}, found "
                                f"{header.get('format')!r} for step {header.get('step')!r}")
        samples, at = [], 0
        for n, a in zip(lengths, adv, strict=True):
            samples.append(Sample(tokens[at:at + n], old[at:at + n], mask[at:at + n], a))
            at += n
        return Batch(step, samples, versions, header["meta"])

    def get_batch(self, step: int, *, timeout: float, poll: float = 0.2,
                  alive: Callable[[], bool] | None = None) -> Batch:
        """Step ``step``'s batch, waiting for it up to ``timeout`` seconds."""
        path = self.batch_path(step)
        _wait(lambda: path if path.exists() else None, path, timeout, poll, alive)
        return self.read_batch(step)

    def drop_batches_before(self, step: int) -> None:
        """Remove the batches the trainer is done with (steps below ``step``)."""
        for p in self.batches.glob("step-*.npz"):
            if int(p.stem.split("-")[1]) < step:
                p.unlink(missing_ok=True)

    # ---- weights (trainer -> engines)

    def weights_path(self, version: int) -> Path:
        return self.weights / f"v{version:08d}"

    def set_latest(self, version: int, path: Path | None = None) -> Path:
        """Name ``v<version>`` (written whole by someone else, e.g. a trainer backend's
        ``export_to_path(weights, version)``) as the newest weights."""
        folder = self.weights_path(version)
        if path is not None and Path(path).resolve() != folder.resolve():
            raise HandoverError(Path(path), f"weights version {version} belong in {folder}")
        if not folder.is_dir():
            raise HandoverError(folder, "no such weights folder")
        _atomic_file(self.weights / "LATEST", lambda p: _write_text(p, f"{version}\n"))
        return folder

    def latest_weights(self) -> tuple[int, Path] | None:
        """The newest complete weights: ``(version, folder)``, or None before any."""
        try:
            version = int((self.weights / "LATEST").read_text())
        except (FileNotFoundError, ValueError):
            return None
        path = self.weights_path(version)
        return (version, path) if path.is_dir() else None

    def wait_weights(self, min_version: int, *, timeout: float, poll: float = 0.2,
                     alive: Callable[[], bool] | None = None) -> tuple[int, Path]:
        """The newest weights once their version is at least ``min_version``."""
        def newer() -> Path | None:
            latest = self.latest_weights()
            return latest[1] if latest and latest[0] >= min_version else None

        _wait(newer, self.weights_path(min_version), timeout, poll, alive)
        latest = self.latest_weights()
        assert latest is not None
        return latest

    def prune_weights(self, keep: int) -> None:
        """Keep the ``keep`` newest weights folders (engines may still be loading them)."""
        folders = sorted(p for p in self.weights.glob("v*") if p.is_dir())
        for old in folders[:-keep] if keep else folders:
            shutil.rmtree(old, ignore_errors=True)


    # ---- the engines' state (orchestrator -> `tmax-train status`)

    def put_engines(self, engines: list[dict[str, Any]]) -> Path:
        """What each inference engine serves now (``EnginePool.describe``), whole."""
        text = json.dumps({"engines": engines, "at": time.time()}, indent=1) + "\n"
        return _atomic_file(self.root / "engines.json", lambda p: _write_text(p, text))

    def engines(self) -> list[dict[str, Any]]:
        """The last ``put_engines``; [] before any (or when it cannot be read)."""
        try:
            return list(json.loads((self.root / "engines.json").read_text())["engines"])
        except (OSError, ValueError, KeyError, TypeError):
            return []

# ---- liveness (files, so that it works across nodes on shared scratch)


class Heartbeat:
    """``with Heartbeat(handover, "trainer-0"):`` touches ``alive/<role>`` every
    ``every_s`` seconds from a daemon thread while the block runs."""

    def __init__(self, handover: Handover, role: str, every_s: float = 5.0):
        self.path = handover.root / "alive" / role
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _beat(self) -> None:
        while True:
            self.path.touch()
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.path.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.path.unlink(missing_ok=True)


def alive(handover: Handover, role: str, stale_s: float = 60.0) -> bool:
    """Whether ``role``'s heartbeat is fresher than ``stale_s`` seconds."""
    try:
        return time.time() - (handover.root / "alive" / role).stat().st_mtime < stale_s
    except FileNotFoundError:
        return False


def mark_done(handover: Handover, role: str) -> None:
    done = handover.root / "done"
    done.mkdir(parents=True, exist_ok=True)
    _atomic_file(done / role, lambda p: _write_text(p, f"{time.time()}\n"))


def is_done(handover: Handover, role: str) -> bool:
    return (handover.root / "done" / role).exists()
