"""The local runtime's copy of what the agent added to the system folders, for the verifier
(``sandfleet.verifier.additions`` says what and why): made with the agent frozen, from the
agent's own layer, into a folder of the verifier's that ``VERIFIER_SH`` stacks below the
image's folder (a read-only overlay: the image's entries win). A copy, not the agent's
layer itself: the agent, thawed while its verifier runs, cannot add to it or change it."""

from __future__ import annotations

import logging
import os
import shutil
import stat as _stat
from pathlib import Path

from sandfleet.verifier.additions import MERGED_ETC, apt_packages, plan_additions
from sandfleet.verifier.plan import PRISTINE
from sandfleet.verifier.tree import DirTree

log = logging.getLogger(__name__)

MERGED = tuple(f"/{name}" for name in PRISTINE) + MERGED_ETC
"""The image's folders the verifier gets with the agent's additions below them."""
SCRIPT_BYTES = 1 << 20


def stage_additions(image_root: str, upper_root: str, dest: Path, folders: list[str],
                    path: str, tests: Path) -> list[str]:
    """Copy the agent's additions below ``folders`` from its layer ``upper_root`` (a host
    path) into ``dest``/<folder>; returns the folders that got any. Never follows a link
    of the agent's; set-user-ID and set-group-ID bits are dropped. ``tests``: the task's
    tests (what its shell scripts install with apt: ``apt_packages``)."""
    texts = [_head(p, SCRIPT_BYTES) for p in sorted(tests.rglob("*"))
             if p.is_file() and not p.is_symlink() and
             (p.suffix == ".sh" or _head(p, 2) == "#!")]
    plan = plan_additions(DirTree(image_root), DirTree(upper_root), folders, path,
                          apt_packages(texts))
    for where, why in plan.hidden:
        log.info("verifier: hidden from the verifier: %s (%s)", where, why)
    got: list[str] = []
    for where, kind in plan.copy:
        source, target = f"{upper_root}{where}", f"{dest}{where}"
        top = next(f for f in folders if where.startswith(f + "/"))
        if top not in got:
            got.append(top)
        _folders(dest, os.path.dirname(where))  # (folders the image has too: its own win)
        st = os.lstat(source)
        if kind == "dir":
            os.mkdir(target, 0o700)
        elif kind == "link":
            os.symlink(os.readlink(source), target)
        else:
            _copy_file(source, target)
        os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
        if kind != "link":
            os.chmod(target, _stat.S_IMODE(st.st_mode) & ~(_stat.S_ISUID | _stat.S_ISGID))
    return got


def _head(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        return f.read(size).decode(errors="replace")


def _folders(dest: Path, folder: str) -> None:
    """``dest``/``folder`` and the folders above it, 0755 (root's: the overlay's lower)."""
    dest.mkdir(mode=0o755, exist_ok=True)
    at = dest
    for part in folder.strip("/").split("/"):
        at = at / part
        at.mkdir(mode=0o755, exist_ok=True)


def _copy_file(source: str, target: str) -> None:
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{source}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as src, open(target, "xb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    finally:
        os.close(fd)
