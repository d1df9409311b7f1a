"""The image store: one content-addressed SIF per task on shared scratch, and a manifest.

Layout of a store folder::

    manifest.json        {"version": 1, "tasks": {task_id: entry}, "bases": {name: entry}}
    manifest.lock        held while the manifest is read-modified-written
    sif/<digest>.sif     task images, named by the digest of their inputs
    bases/<name>-<digest>.sif
    logs/<name>-<digest>.log
    locks/<digest>.lock  held while that digest is being built (two nodes, one build)
    tmp/                 builds in progress; nothing here is ever referenced

The manifest is replaced atomically (temp file + rename) under its lock; an image file
appears under sif/ only complete (renamed from tmp/). A failed or interrupted build leaves
no entry, and the previous entry of that task (an older digest) stays as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock
from pydantic import BaseModel, ConfigDict, Field

from sandfleet import ImageMissing, layers, sif

MANIFEST_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Checks(_Strict):
    """Build-time checks of a task image."""

    runtime: str
    starts: bool
    nop_reward: float | None = None
    oracle_reward: float | None = None
    ok: bool
    reason: str = ""
    note: str = ""
    """What was not checked, and why (e.g. a task without a reference solution)."""
    log: str = ""
    """Path (relative to the store) of the checks' log."""
    inputs: str = ""
    """Digest of what the checks read besides the image (tests/, solution/, the verifier,
    agent and environment settings): checks of other inputs run again on a cached image."""


class BaseEntry(_Strict):
    name: str
    digest: str
    sif: str
    size: int
    sha256: str
    builder: str
    log: str
    built_at: str
    build_seconds: float


class LayerFile(_Strict):
    """A layer of a layered task image (``layers/<sha256>.sqfs``), shared by every task
    whose build made the same bytes."""

    path: str
    size: int
    sha256: str


class ImageEntry(_Strict):
    task_id: str
    digest: str
    sif: str
    """Path relative to the store root."""
    size: int
    sha256: str
    """Hash of the SIF file's bytes, for `tmax images verify`."""
    base: str
    base_digest: str
    builder: str
    log: str
    built_at: str
    build_seconds: float
    workdir: str = "/"
    checks: Checks | None = None
    verifier_sif: str = ""
    """A separate verifier's image (tests/Dockerfile), relative to the store root; "" when
    the verifier runs in the task's own image."""
    verifier_workdir: str = ""
    verifier_size: int = 0
    verifier_sha256: str = ""
    layers: list[LayerFile] = Field(default_factory=list)
    """A layered image (``sif`` is then its layers file, ``sif/<digest>.layers``): its own
    layers, top first; the base below them is ``bases``' entry."""

    def files(self) -> list[tuple[str, int, str]]:
        """(path, size, sha256) of each file the entry uses: its image (a SIF, or a layers
        file and its layers), its verifier's."""
        return [(self.sif, self.size, self.sha256)] + \
            [(la.path, la.size, la.sha256) for la in self.layers] + \
            ([(self.verifier_sif, self.verifier_size, self.verifier_sha256)]
             if self.verifier_sif else [])


class Manifest(_Strict):
    version: int = MANIFEST_VERSION
    tasks: dict[str, ImageEntry] = Field(default_factory=dict)
    bases: dict[str, BaseEntry] = Field(default_factory=dict)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ImageStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        for sub in ("sif", "bases", "layers", "logs", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.manifest_path = self.root / "manifest.json"
        self._lock = FileLock(str(self.root / "manifest.lock"))

    # ------------------------------------------------------------------ manifest

    def read(self) -> Manifest:
        if not self.manifest_path.exists():
            return Manifest()
        try:
            return Manifest.model_validate_json(self.manifest_path.read_text())
        except ValueError as e:
            raise ValueError(f"{self.manifest_path}: unreadable manifest ({e}); "
                             "move it aside and rebuild with `tmax images build`") from None

    def update(self, change: Callable[[Manifest], None]) -> Manifest:
        """Read, change and atomically rewrite the manifest under its lock."""
        with self._lock:
            manifest = self.read()
            change(manifest)
            tmp = self.manifest_path.with_name(f".manifest.{os.getpid()}.tmp")
            tmp.write_text(manifest.model_dump_json(indent=2))
            os.replace(tmp, self.manifest_path)
            return manifest

    @contextlib.contextmanager
    def building(self, digest: str, timeout: float = -1) -> Iterator[None]:
        """Hold the build lock of ``digest`` (other builders of it wait, then find it built)."""
        with FileLock(str(self.root / "locks" / f"{digest}.lock"), timeout=timeout):
            yield

    def tmp_path(self, name: str) -> Path:
        return self.root / "tmp" / f"{name}.{os.getpid()}.{time.monotonic_ns()}"

    def publish(self, built: Path, relative: str) -> tuple[int, str]:
        """Move a finished file from tmp/ to its final name; returns (size, sha256)."""
        final = self.root / relative
        digest = file_sha256(built)
        size = built.stat().st_size
        os.replace(built, final)
        return size, digest

    def publish_layer(self, built: Path, name: str = "") -> LayerFile:
        """Move a finished layer to ``layers/<sha256>.sqfs``, or to ``layers/<name>.sqfs``
        (what stands for it: another build's of that name is kept and used); one already
        there is kept (the built file dropped). Two builds publishing at once: the first
        file stays."""
        rel = f"layers/{name or file_sha256(built)}.sqfs"
        final = self.root / rel
        try:
            os.link(built, final)  # never replaces: the entries using it recorded its sha
        except FileExistsError:
            pass
        built.unlink()
        return LayerFile(path=rel, size=final.stat().st_size, sha256=file_sha256(final))

    def path(self, relative: str) -> Path:
        return self.root / relative

    # ------------------------------------------------------------------ lookups

    def task_image(self, task_id: str, digest: str) -> ImageEntry:
        """The built image of a task at ``digest``; ImageMissing when it is not there.

        Never builds: a missing image at run time is an error, not a retry.
        """
        entry = self.read().tasks.get(task_id)
        wanted = self.root / "sif" / f"{digest}.sif"
        if entry is None:
            raise ImageMissing(str(wanted), f"task {task_id}: no image in {self.root}; "
                               "run `tmax images build` first")
        if entry.digest != digest:
            raise ImageMissing(str(wanted), f"task {task_id}: image is out of date (built from "
                               "other inputs); run `tmax images build`")
        for rel, _, _ in entry.files():  # its separate verifier's image too
            try:
                readable(self.root / rel)
            except sif.SifError as e:
                raise ImageMissing(str(self.root / rel), f"task {task_id}: {e.reason}; run "
                                   "`tmax images build`") from None
        return entry

    # ------------------------------------------------------------------ maintenance

    def verify(self, deep: bool = True) -> list[dict]:
        """Problems of every image in the manifest (missing, resized, changed, corrupt)."""
        manifest = self.read()
        problems = []
        files = [(f"task {k}", f) for k, v in manifest.tasks.items() for f in v.files()] + \
                [(f"base {k}", (v.sif, v.size, v.sha256)) for k, v in manifest.bases.items()]
        for name, (rel, size, sha) in files:
            path = self.root / rel
            reason = ""
            if not path.exists():
                reason = "file missing"
            elif path.stat().st_size != size:
                reason = f"size {path.stat().st_size} != recorded {size} (truncated?)"
            else:
                try:
                    readable(path)
                except sif.SifError as e:
                    reason = e.reason
                if not reason and deep and file_sha256(path) != sha:
                    reason = "content changed since it was built (sha256 mismatch)"
            if reason:
                problems.append({"image": name, "path": str(path), "reason": reason})
        return problems

    def gc(self, tmp_age_s: float = 6 * 3600, keep_tasks: set[str] | None = None,
           dry_run: bool = False) -> list[Path]:
        """Remove unreferenced images and logs, and stale tmp/ leftovers.

        With ``keep_tasks``, manifest entries of other tasks are dropped first.
        """
        if keep_tasks is not None and not dry_run:
            def keep(m: Manifest) -> None:
                for t in [t for t in m.tasks if t not in keep_tasks]:
                    del m.tasks[t]

            self.update(keep)
        manifest = self.read()
        if keep_tasks is not None and dry_run:
            manifest.tasks = {k: v for k, v in manifest.tasks.items() if k in keep_tasks}
        referenced = {f for e in manifest.tasks.values() for f, _, _ in e.files()} | \
                     {e.sif for e in manifest.bases.values()} | \
                     {e.log for e in manifest.tasks.values()} | \
                     {e.log for e in manifest.bases.values()} | \
                     {e.checks.log for e in manifest.tasks.values() if e.checks and e.checks.log}
        removed = []
        for sub in ("sif", "bases", "layers", "logs"):
            for path in (self.root / sub).iterdir():
                if f"{sub}/{path.name}" not in referenced:
                    removed.append(path)
        now = time.time()
        for path in (self.root / "tmp").iterdir():
            if now - path.lstat().st_mtime > tmp_age_s:
                removed.append(path)
        if not dry_run:
            for path in removed:
                if path.is_dir() and not path.is_symlink():
                    remove_tree(path)
                else:
                    path.unlink(missing_ok=True)
        return removed


def readable(path: Path) -> None:
    """``sif.SifError`` unless ``path`` is a usable image file: a SIF, a layers file whose
    layers are, or a layer (squashfs)."""
    if path.suffix == ".sqfs":
        with open(path, "rb") as f:
            if f.read(4) != sif.SQUASHFS_MAGIC:
                raise sif.SifError(path, "corrupt: not a squashfs layer")
    else:
        layers.read(path)


def own_bytes(manifest: Manifest) -> dict[str, int]:
    """Bytes of each task's files that no other task uses (its layers file and its own
    layers; its whole SIF for a single-file image); bases and shared layers are not
    counted."""
    users: dict[str, set[str]] = {}
    for tid, e in manifest.tasks.items():
        for rel, _, _ in e.files():
            users.setdefault(rel, set()).add(tid)
    return {tid: sum(size for rel, size, _ in e.files() if users[rel] == {tid})
            for tid, e in manifest.tasks.items()}


def remove_tree(path: Path) -> None:
    """rm -rf that stays on one file system (a build's mounts are not followed)."""
    if path.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], timeout=600, check=False)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def digest_of(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:32]


def tree_digest(root: Path) -> str:
    """Digest of a folder's files: relative paths, modes, symlink targets, contents."""
    parts: list[bytes | str] = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            parts += [rel, "link", os.readlink(path)]
        elif path.is_file():
            parts += [rel, oct(path.stat().st_mode & 0o7777), file_sha256(path)]
        elif path.is_dir():
            parts += [rel, "dir"]
    return digest_of(*parts)


def default_store() -> str:
    """$TMAX_IMAGE_STORE, else $TMAX_SCRATCH/tmax/images, else ~/.tmax/images."""
    if os.environ.get("TMAX_IMAGE_STORE"):
        return os.environ["TMAX_IMAGE_STORE"]
    scratch = os.environ.get("TMAX_SCRATCH")
    return str(Path(scratch) / "tmax" / "images") if scratch else \
        str(Path.home() / ".tmax" / "images")


def default_cache() -> str:
    """Node-local cache of extracted root filesystems ($TMAX_CACHE or ~/.cache/tmax)."""
    return os.environ.get("TMAX_CACHE", str(Path.home() / ".cache" / "tmax"))
