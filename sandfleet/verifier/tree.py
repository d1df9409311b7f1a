"""Read-only views of a file tree for the verifier plan (``sandfleet.verifier.plan``).

The plan asks a tree five questions, never following a link at the last component:
``kind(path)``, ``names(path)``, ``link(path)``, ``read(path)``. ``MemoryTree`` answers
them from a hand-built table (the plan's unit tests, and a runtime that lists a tree
another way); ``DirTree`` answers them from a folder of this machine (``/proc/<pid>/root``
plus a prefix: the local runtime). Both are pure readers: they change nothing.
"""

from __future__ import annotations

import os
import stat as _stat
from typing import Protocol


class Tree(Protocol):
    """A file tree seen read-only; paths are absolute paths of the tree ("/usr/bin")."""

    def kind(self, path: str) -> str:
        """"dir", "file" (regular), "link", "other" or "" (nothing there); a link at the
        last component is a "link", never what it points to."""

    def names(self, path: str) -> list[str]:
        """The entries of folder ``path``, sorted ([] where it is not a folder)."""

    def link(self, path: str) -> str:
        """The target of link ``path``."""

    def read(self, path: str, limit: int = 65536) -> str:
        """A regular file's text (its first ``limit`` bytes), "" for anything else."""


class MemoryTree:
    """A tree from a table: ``{"/usr/bin": "dir", "/usr/bin/python3": "file",
    "/bin": "link:usr/bin", "/venv/pyvenv.cfg": "file:home = /usr/bin"}``. Folders above
    an entry exist without being named; ``"file:TEXT"`` gives a file's text."""

    def __init__(self, entries: dict[str, str]):
        self.entries: dict[str, str] = {"/": "dir"}
        for path, what in entries.items():
            path = "/" + path.strip("/")
            parts = path.strip("/").split("/")
            for k in range(1, len(parts)):
                self.entries.setdefault("/" + "/".join(parts[:k]), "dir")
            self.entries[path] = what

    def kind(self, path: str) -> str:
        what = self.entries.get(_norm(path), "")
        return what.split(":", 1)[0] if what else ""

    def names(self, path: str) -> list[str]:
        path = _norm(path)
        if self.kind(path) != "dir":
            return []
        prefix = path.rstrip("/") + "/"
        return sorted({p[len(prefix):] for p in self.entries
                       if p.startswith(prefix) and "/" not in p[len(prefix):] and p != prefix})

    def link(self, path: str) -> str:
        what = self.entries.get(_norm(path), "")
        if not what.startswith("link:"):
            raise OSError(f"{path}: not a link")
        return what[len("link:"):]

    def read(self, path: str, limit: int = 65536) -> str:
        what = self.entries.get(_norm(path), "")
        return what[len("file:"):][:limit] if what.startswith("file:") else ""


class DirTree:
    """The tree under folder ``base`` of this machine (``base`` + path), links never
    followed at the last component (the components above are the caller's to trust)."""

    def __init__(self, base: str):
        self.base = base.rstrip("/")

    def _lstat(self, path: str) -> os.stat_result | None:
        try:
            return os.lstat(f"{self.base}{path}")
        except (FileNotFoundError, NotADirectoryError):
            return None

    def kind(self, path: str) -> str:
        st = self._lstat(path)
        if st is None:
            return ""
        return ("dir" if _stat.S_ISDIR(st.st_mode) else "file" if _stat.S_ISREG(st.st_mode)
                else "link" if _stat.S_ISLNK(st.st_mode) else "other")

    def names(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(f"{self.base}{path}")) if self.kind(path) == "dir" else []
        except OSError:
            return []

    def link(self, path: str) -> str:
        return os.readlink(f"{self.base}{path}")

    def read(self, path: str, limit: int = 65536) -> str:
        try:
            fd = os.open(f"{self.base}{path}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return ""
        try:
            return os.read(fd, limit).decode("utf-8", "replace") \
                if _stat.S_ISREG(os.fstat(fd).st_mode) else ""
        finally:
            os.close(fd)


def _norm(path: str) -> str:
    return "/" + path.strip("/")
