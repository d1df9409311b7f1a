"""What a task's folder may point at: one rule for validation, the host check and image builds.

Host-side tools read a task's folder as whoever runs them, often root: validation globs
COPY sources, ``tmax tasks check`` copies files into its sandbox, the image build copies them
into the image, ``tmax tasks convert`` copies the whole folder. A task is untrusted input, so
nothing in its folder may lead those tools elsewhere on the machine:

- A symlink stays inside the part of the task it lies in. environment/, tests/ and
  solution/ are each copied on their own (into the image, /tests, /solution), so a link in
  one of them must resolve inside it; any other link inside the task folder. Links that stay
  inside are kept and copied as links, as Docker does (a fixture tree may hold them; a task
  may be about them). A link out is refused even where it would mean something else in the
  image (``-> /usr/bin/python3``): the tools read the folder on this machine, where it names
  this machine's file. Such links are made at build time (``RUN ln -s``, ``%post``).
- A COPY/ADD/%files source, normalised and glob-expanded, stays inside environment/ (the
  build context); a leading '/' means environment/'s root, as Docker reads it.

Hard links are not looked at: making one to a file needs the rights to read it already.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from tmax.tasks.model import ENV_DIR, SOLUTION_DIR, TESTS_DIR, Problem

PARTS = (ENV_DIR, TESTS_DIR, SOLUTION_DIR)
"""Task folders copied on their own: a link in one must stay in it."""


class Escape(ValueError):
    """A COPY/ADD/%files source that leads outside environment/."""

    def __init__(self, src: str):
        self.src = src
        super().__init__(f"source {src!r} leaves {ENV_DIR}/")


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def expand_source(env_dir: Path, src: str) -> list[Path]:
    """The paths a COPY/ADD/%files source names, sorted: relative to ``env_dir``, normalised,
    glob-expanded (``*`` skips dotfiles, as the image build always has).

    Raises ``Escape`` when the source, or anything it matches (through links), is outside
    ``env_dir``; an empty list when nothing matches.
    """
    base = os.path.realpath(env_dir)
    rel = os.path.normpath(src.lstrip("/") or ".")
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise Escape(src)
    matches = sorted(glob.glob(os.path.join(glob.escape(base), rel)))
    if any(not _within(os.path.realpath(m), base) for m in matches):
        raise Escape(src)
    return [Path(m) for m in matches]


def link_problems(root: Path, task_id: str) -> list[Problem]:
    """A problem for each symlink under ``root`` that resolves outside its part of the task."""
    real_root = os.path.realpath(root)
    problems = []
    for folder, dirs, files in os.walk(root):  # never descends into linked folders
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                continue
            rel = Path(path).relative_to(root)
            part = rel.parts[0] if len(rel.parts) > 1 and rel.parts[0] in PARTS else ""
            bound = os.path.join(real_root, part) if part else real_root
            if _within(os.path.realpath(path), bound):
                continue
            where = f"{part}/" if part else "the task folder"
            problems.append(Problem(
                task_id, rel.as_posix(), f"symlink to {os.readlink(path)!r} leaves {where}",
                f"replace the link with the file it points to, or point it inside {where}; "
                "a link meant for the image is made at build time (RUN ln -s, %post)"))
    return problems
