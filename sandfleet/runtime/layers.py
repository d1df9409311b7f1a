"""Layered images: a task's image as a stack of read-only squashfs layers.

An image a sandbox starts from is either a SIF (one layer: its squashfs partition) or a
*layers file*: a small JSON document naming the layers, top first, the base last::

    {"sandfleet_layers": 1, "layers": ["../layers/3f0c....sqfs", "../bases/debian.sif"]}

Each entry is a plain squashfs file (a layer: only what the task changed, deletions as
overlayfs whiteouts, character devices 0/0) or a SIF (its squashfs partition); relative
paths are read from the layers file's folder. Both runtimes stack them (the local runtime
with overlayfs lower layers, Apptainer with read-only ``--overlay`` images over the base),
so shared layers (a base, the verifier tools) are stored once and share one page cache.
This module is the format's one owner: ``tmax`` writes layers files with ``write``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sandfleet.runtime import sif

SUFFIX = ".layers"
FORMAT_KEY, FORMAT = "sandfleet_layers", 1
MAX_LAYERS = 16
"""More lower layers than this is refused (overlayfs takes up to 500; a task has 2-3)."""


@dataclass(frozen=True)
class Layer:
    path: Path
    """The file (absolute, resolved): a squashfs, or a SIF holding one."""
    offset: int
    size: int


def is_layered(image: Path | str) -> bool:
    return str(image).endswith(SUFFIX)


def _squashfs(path: Path) -> Layer:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise sif.SifError(path, "no such file") from None
    if magic == sif.SQUASHFS_MAGIC:
        return Layer(path, 0, size)
    part = sif.read_partition(path)  # SifError: not a SIF either
    return Layer(path, part.offset, part.size)


def read(image: Path | str) -> list[Layer]:
    """The image's layers, top first (one for a SIF); ``sif.SifError`` naming the file and
    what is wrong when one cannot be used."""
    image = Path(image)
    if not is_layered(image):
        part = sif.read_partition(image)
        return [Layer(image.resolve(), part.offset, part.size)]
    try:
        data = json.loads(image.read_text())
    except FileNotFoundError:
        raise sif.SifError(image, "no such file") from None
    except (OSError, ValueError) as e:
        raise sif.SifError(image, f"not a layers file: {e}") from None
    if not isinstance(data, dict) or data.get(FORMAT_KEY) != FORMAT or \
            not isinstance(data.get("layers"), list) or set(data) != {FORMAT_KEY, "layers"}:
        raise sif.SifError(image, f'not a layers file: expected {{"{FORMAT_KEY}": {FORMAT}, '
                                  '"layers": [paths, top first]}')
    names = data["layers"]
    if not 1 <= len(names) <= MAX_LAYERS or not all(isinstance(n, str) and n for n in names):
        raise sif.SifError(image, f"layers: 1 to {MAX_LAYERS} file paths expected")
    layers = []
    for i, name in enumerate(names):
        try:
            layers.append(_squashfs((image.parent / name).resolve()))
        except sif.SifError as e:
            raise sif.SifError(image, f"layer {name}: {e.reason}") from None
        if layers[-1].offset and i < len(names) - 1:
            raise sif.SifError(image, f"layer {name}: only the base (the last layer) may be "
                                      "a SIF; the others are squashfs files")
    return layers


def apptainer_args(image: Path | str) -> list[str]:
    """What stands for the image at the end of an Apptainer command line: the SIF, or the
    layers as read-only overlays (bottom to top: Apptainer's last ``--overlay`` is the
    topmost; a writable overlay is above them wherever it is given) then the base."""
    if not is_layered(image):
        return [str(image)]
    found = read(image)
    args = [a for la in reversed(found[:-1]) for a in ("--overlay", f"{la.path}:ro")]
    return args + [str(found[-1].path)]


def write(image: Path, layers: list[Path]) -> None:
    """Write a layers file naming ``layers`` (top first) relative to its folder; atomic."""
    image = Path(image)
    if not is_layered(image):
        raise ValueError(f"{image}: a layers file's name ends with {SUFFIX}")
    names = [os.path.relpath(Path(p).resolve(), image.parent.resolve()) for p in layers]
    tmp = image.with_name(f".{image.name}.{os.getpid()}")
    tmp.write_text(json.dumps({FORMAT_KEY: FORMAT, "layers": names}) + "\n")
    os.replace(tmp, image)
    read(image)  # what we wrote must read back


def identity(image: Path | str) -> list[tuple[str, int, int, int, int]]:
    """(path, device, inode, mtime, size) of the image's file and each layer's: a file
    replaced at the same path is another image."""
    files = [Path(image)] + ([la.path for la in read(image)] if is_layered(image) else [])
    out = []
    for path in files:
        st = os.stat(path)
        out.append((str(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    return out


def whiteouts(layer: Layer, timeout: float = 300) -> list[str]:
    """Paths (relative, no leading /) a layer deletes from those below it."""
    out = subprocess.run(["unsquashfs", "-o", str(layer.offset), "-lls", "-n", "-d", "",
                          str(layer.path)], capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL, check=False)
    if out.returncode != 0:
        raise sif.SifError(layer.path, f"unsquashfs -lls failed: {out.stderr.strip()[-500:]}")
    found = []
    for line in out.stdout.splitlines():
        fields = line.split(None, 5)
        # crw-r--r-- root/root  0,  0 2026-12-04 18:13 /a/b  (size column is "major, minor")
        if line.startswith("c") and len(fields) == 6 and fields[2] == "0," and \
                fields[3] == "0":
            found.append(fields[5].split(" ", 1)[1].lstrip("/"))
    return found


def cat(image: Path | str, member: str, timeout: float = 300) -> str | None:
    """The text of file ``member`` (relative: ``var/lib/dpkg/status``) of the image as
    built, from the topmost layer that has it (None where none has it, or a layer above
    removes it); read with unsquashfs, nothing unpacked."""
    for layer in read(image):
        listed = subprocess.run(["unsquashfs", "-o", str(layer.offset), "-lls", "-n", "-d",
                                 "", str(layer.path), member], capture_output=True, text=True,
                                timeout=timeout, stdin=subprocess.DEVNULL, check=False)
        entry = [line for line in listed.stdout.splitlines()
                 if line.endswith(f" /{member}")]
        if not entry:
            continue
        if not entry[0].startswith("-"):  # a whiteout (or a folder, a link): not a file
            return None
        out = subprocess.run(["unsquashfs", "-o", str(layer.offset), "-cat", str(layer.path),
                              member], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL, check=False)
        return out.stdout if out.returncode == 0 else None
    return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _apply(layer: Path, root: Path) -> None:
    """Move an unpacked layer's entries over ``root`` as overlayfs shows a layer over what
    is below: a whiteout removes, a folder merges (its attributes the layer's), anything
    else replaces."""
    for entry in sorted(os.listdir(layer)):
        src, dest = layer / entry, root / entry
        st = src.lstat()
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            _remove(dest)
        elif stat.S_ISDIR(st.st_mode):
            if not dest.is_dir() or dest.is_symlink():
                _remove(dest)
                dest.mkdir()
            _apply(src, dest)
            if os.geteuid() == 0:
                os.chown(dest, st.st_uid, st.st_gid)
            os.chmod(dest, stat.S_IMODE(st.st_mode))
            os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns))
        else:
            _remove(dest)
            os.rename(src, dest)


def flatten(image: Path | str, out: Path, *, timeout: float = 1800, nice: int = 0) -> Path:
    """One squashfs file holding the image's merged root (what a sandbox of it sees before
    anything is written), for readers that take one file (Apptainer's verifier binds
    folders of the pristine image from it). Atomic; needs unsquashfs and mksquashfs (as
    an ordinary user, files keep that user's ids, and devices are left out)."""
    found = read(image)
    out.parent.mkdir(parents=True, exist_ok=True)
    low = ["nice", "-n", str(nice)] if nice else []  # (a merge ahead of need: at nice 19)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        root = Path(tmp) / "root"
        for i, layer in enumerate(reversed(found)):  # the base first
            dest = root if i == 0 else Path(tmp) / f"layer{i}"
            proc = subprocess.run([*low, "unsquashfs", "-o", str(layer.offset), "-n", "-q",
                                   "-no-progress", "-d", str(dest), str(layer.path)],
                                  capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, check=False)
            if proc.returncode != 0 and os.geteuid() == 0:
                raise sif.SifError(layer.path, f"unsquashfs: {proc.stderr.strip()[-500:]}")
            if i:
                _apply(dest, root)
        tmp_out = Path(tmp) / "merged.sqfs"
        proc = subprocess.run([*low, "mksquashfs", str(root), str(tmp_out), "-noappend", "-quiet",
                               "-no-progress", "-comp", "gzip", "-Xcompression-level", "1"],
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
        if proc.returncode != 0:
            raise sif.SifError(image, f"flattening: mksquashfs: {proc.stderr.strip()[-500:]}")
        os.replace(tmp_out, out)
    return out
