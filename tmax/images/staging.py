"""What a build's script copies in, staged before it runs: the sources of every COPY/ADD
of a Dockerfile stage (the build context, heredocs, URLs, other stages and images), laid
out as the plan's script expects them (``tmax.images.plan``). This reads the build context
and fetches ADD's URLs: the executing side of a plan."""

from __future__ import annotations

import glob
import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from tmax.images.types import BuildError
from tmax.tasks.confine import Escape, expand_source
from tmax.tasks.dockerfile import Copy, Stage

ImageRoot = Callable[[str], Path]
"""An image reference -> a folder standing in for that image's root (COPY --from=image)."""


def stage_files(stage: Stage, context: Path, dest: Path, *, image_root: ImageRoot,
                stage_root: Callable[[int], Path] | None = None, ca: Path | None = None
                ) -> None:
    """Stage every COPY/ADD of ``stage`` under ``dest`` (the image's /.tmax-build/s<n>):
    from the build context, heredocs, URLs, other stages (``stage_root``: the root
    filesystem a stage built) and images (``image_root``); ``ca``: the certificates RUN
    steps trust."""
    dest.mkdir(parents=True, exist_ok=True)
    if ca is not None:
        shutil.copyfile(ca, dest / "ca.crt")
        (dest / "ca.crt").chmod(0o644)
    for step in stage.steps:
        if not isinstance(step, Copy) or (step.from_stage is not None and stage_root is None):
            continue  # (the Apptainer builder copies from stages with "%files from")
        folder = dest / f"c{step.line}"
        folder.mkdir(parents=True)
        n = 0
        for name, body in step.inline:
            entry = folder / str(n)
            entry.mkdir()
            (entry / name).write_text(body)
            n += 1
        for src in step.sources:
            for match in _matches(step, src, context, image_root, stage_root):
                entry = folder / str(n)
                entry.mkdir()
                n += _stage_one(step, match, entry, src)
        if n > 1 and not step.into_dir:
            raise BuildError(f"Dockerfile line {step.line}",
                             f"{len(step.sources)} source(s) match {n} files: the destination "
                             f"{step.dest!r} must end with '/'")


def _matches(step: Copy, src: str, context: Path, image_root: ImageRoot,
             stage_root: Callable[[int], Path] | None) -> list[Path]:
    where = f"Dockerfile line {step.line}"
    if step.add and re.match(r"https?://", src):
        return [Path(src)]  # fetched by _stage_one
    if step.from_stage is not None or step.from_image:
        if step.from_stage is not None and stage_root is not None:
            root = stage_root(step.from_stage)
        else:
            root = image_root(step.from_image)
        matches = _in_root(root, src)
        if not matches:
            raise BuildError(where, f"COPY --from={step.from_image or step.from_stage}: "
                             f"{src!r} not found")
        return matches
    try:
        matches = expand_source(context, src)
    except Escape as e:
        raise BuildError(where, str(e)) from None
    if not matches:
        raise BuildError(where, f"source {src!r} not found in the build context {context}")
    return matches


def _in_root(root: Path, src: str) -> list[Path]:
    """Matches of absolute ``src`` in another image's root, never leaving it."""
    parts = PurePosixPath("/", src).parts[1:]
    if ".." in parts:
        return []
    base = os.path.realpath(root)
    found = sorted(glob.glob(os.path.join(glob.escape(base), *parts)))
    return [Path(m) for m in found
            if os.path.realpath(os.path.dirname(m)).startswith(base)]


def _stage_one(step: Copy, match: Path, entry: Path, src: str) -> int:
    """Put one match into ``entry``; 1 (one thing staged)."""
    if step.add and re.match(r"https?://", src):
        name = PurePosixPath(urllib.parse.urlparse(src).path).name or "index.html"
        try:
            with urllib.request.urlopen(src, timeout=300) as r, open(entry / name, "wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            raise BuildError(f"Dockerfile line {step.line}", f"ADD {src}: {e}") from None
        (entry / name).chmod(0o600)
        return 1
    if step.add and match.is_file() and _is_archive(match):
        target = entry / match.name
        target.mkdir()
        with tarfile.open(match) as archive:
            archive.extractall(target, filter="tar")  # no links or paths leaving target
        return 1
    if match.is_dir() and not match.is_symlink():
        shutil.copytree(match, entry / match.name, symlinks=True)
    else:
        shutil.copy2(match, entry / match.name, follow_symlinks=False)
    return 1


def _is_archive(path: Path) -> bool:
    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


def staging_dir(parent: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix="stage-", dir=parent))
