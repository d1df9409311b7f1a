"""What the probes read without a sandbox: image listings, the paths a verifier and an
instruction name, which outputs are programs, leak matches and mutations. Pure functions.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

PROBE_DIR = "/tmp/.tmax-audit-"
"""Prefix of a probe sandbox's own folder (a random suffix per sandbox, made fresh: a task
cannot plant links there); left out of every listing."""

PRUNED = ("/proc", "/sys", "/dev", "/run", "/logs", "/tests", "/solution")
"""Never listed: kernel and runtime mounts, the verifier's and oracle's folders."""

SCRATCH = ("/tmp/", "/var/tmp/", "/var/cache/", "/var/lib/apt/", "/var/lib/dpkg/",
           "/var/log/", "/root/.cache/", "/usr/share/locale/", "/usr/share/man/")
"""Written by tools as a side effect: never an answer location or a replayed output."""

PROGRAM_SUFFIXES = frozenset({
    ".py", ".sh", ".bash", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".rs", ".go", ".js",
    ".mjs", ".ts", ".rb", ".pl", ".php", ".java", ".kt", ".scala", ".lua", ".r", ".jl",
    ".awk", ".sed", ".mk", ".cmake", ".s", ".asm", ".zig", ".hs", ".ml", ".swift"})
PROGRAM_NAMES = frozenset({"Makefile", "makefile", "GNUmakefile", "CMakeLists.txt",
                           "Dockerfile", "Cargo.toml", "go.mod", "setup.py", "pyproject.toml"})


@dataclass(frozen=True)
class Stat:
    """One regular file of a listing."""

    size: int
    mtime: str
    mode: int


def listing_command(folder: str) -> str:
    """A POSIX find that writes ``size<TAB>mtime<TAB>mode<TAB>path<NUL>`` for each regular
    file to ``folder``/files (not to stdout: a listing is larger than a command's output
    cap); ``folder`` itself is left out."""
    prune = " -o ".join(f"-path {p}" for p in (*PRUNED, folder))
    return (f"find / \\( {prune} \\) -prune -o -type f "
            f"-printf '%s\\t%T@\\t%m\\t%p\\0' > {folder}/files 2>/dev/null; "
            f"test -s {folder}/files")


def parse_listing(data: bytes) -> dict[str, Stat]:
    """``listing_command``'s output as path -> ``Stat``; malformed records are skipped."""
    files: dict[str, Stat] = {}
    for record in data.split(b"\0"):
        parts = record.decode("utf-8", "surrogateescape").split("\t", 3)
        if len(parts) != 4:
            continue
        size, mtime, mode, path = parts
        try:
            files[path] = Stat(int(size), mtime, int(mode, 8))
        except ValueError:
            continue
    return files


def is_scratch(path: str) -> bool:
    return path.startswith(SCRATCH) or "/__pycache__/" in path or path.endswith(".pyc")


def added(files: dict[str, Stat], base: dict[str, Stat] | None) -> list[str]:
    """Files of ``files`` that ``base`` lacks or holds with another size or time (what the
    task's build and the runtime put in; scratch folders too: an answer may hide there);
    every file without a base."""
    return sorted(p for p, s in files.items()
                  if base is None or (b := base.get(p)) is None or
                  (b.size, b.mtime) != (s.size, s.mtime))


def changed(before: dict[str, Stat], after: dict[str, Stat]) -> list[str]:
    """Files new or changed (size, time or mode) from ``before`` to ``after``: what a run
    wrote, scratch left out."""
    return sorted(p for p, s in after.items() if not is_scratch(p) and before.get(p) != s)


def is_program(path: str, data: bytes, mode: int) -> bool:
    """Source code, a build file, a script or a binary: what a task asks an agent to write
    and a verifier should run."""
    name = PurePosixPath(path).name
    return (PurePosixPath(path).suffix.lower() in PROGRAM_SUFFIXES or name in PROGRAM_NAMES
            or data.startswith((b"#!", b"\x7fELF")) or bool(mode & 0o111))


def normalized(data: bytes) -> str:
    """Text with line ends and trailing blanks made uniform, blank edges stripped."""
    text = data.decode("utf-8", "replace").replace("\r\n", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip()


MAX_JSON_BYTES = 1 << 20
"""Larger files are not compared as JSON values (only as text)."""


@functools.lru_cache(maxsize=256)  # (the same answers, against every file of the image)
def structured(data: bytes) -> str | None:
    """A JSON document's value written one way (keys sorted, no spaces), for an object or
    an array; None for anything else."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict | list) or not value:
        return None
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def spaced(text: str) -> str:
    """``text`` with every run of blanks (line ends, tabs, alignment) one space."""
    return " ".join(text.split())


def leak_matches(candidate: bytes, targets: dict[str, bytes], min_chars: int) -> list[str]:
    """The names of ``targets`` (answers: oracle outputs, tests/ data) that ``candidate``
    equals or contains, compared as ``normalized`` text, with blanks made one space
    (a table aligned otherwise), or as JSON values (another layout or key order, which a
    verifier comparing parsed objects cannot tell apart); targets shorter than
    ``min_chars`` are not searched for (a short value matches anything)."""
    text = normalized(candidate)
    flat = spaced(text)
    value = structured(candidate) if len(candidate) <= MAX_JSON_BYTES else None
    hits = []
    for name, target in targets.items():
        want = normalized(target)
        if len(want) < min_chars:
            continue
        if want in text or spaced(want) in flat or \
                (value is not None and len(target) <= MAX_JSON_BYTES and
                 structured(target) == value):
            hits.append(name)
    return hits


_ABS = re.compile(r"(?<![\w.$~-])(/(?:[\w.+-]+/)*[\w.+-]+)")
_NAME = re.compile(r"(?<![\w/.-])([\w+-][\w.+-]*\.[A-Za-z0-9]{1,8})(?![\w/])")


_REL = re.compile(r"(?<![\w./~$-])((?:[\w.+-]+/)+[\w.+-]+)")
_HOME = re.compile(r"(?<![\w/])(?:~|\$HOME|\$\{HOME\})/")
_BARE = re.compile(r"\b(" + "|".join(sorted(n for n in PROGRAM_NAMES if "." not in n))
                   + r")\b")


def named_paths(text: str) -> tuple[set[str], set[str]]:
    """(absolute paths, relative names) that ``text`` names: relative names are file names
    with an extension, relative paths with a folder, and build files (Makefile); ``~/`` and
    ``$HOME/`` are /root/ (the agent's home)."""
    text = _HOME.sub("/root/", text)
    absolute = {m.rstrip(".") for m in _ABS.findall(text)}
    names = {m.rstrip(".") for m in (*_NAME.findall(text), *_REL.findall(text),
                                     *_BARE.findall(text))}
    return absolute, names


def verifier_text(tests_dir: Path, max_bytes: int = 1 << 20) -> str:
    """The text of the verifier's sources (tests/ files that read as UTF-8)."""
    parts = []
    for path in sorted(tests_dir.rglob("*")):
        if path.is_file() and path.stat().st_size <= max_bytes:
            try:
                parts.append(path.read_text())
            except (UnicodeDecodeError, OSError):
                continue
    return "\n".join(parts)


def mentions(text_paths: tuple[set[str], set[str]], path: str, workdir: str, *,
             exact: bool = False) -> bool:
    """Whether ``text_paths`` (of ``named_paths``) names ``path``: as itself, relative to
    ``workdir``, by file name, or by a folder it is in (other than / and ``workdir``: a
    task that says "extract it into /app/logs/" names the files that land there).
    ``exact``: only as itself or relative to ``workdir``."""
    absolute, names = text_paths
    p = PurePosixPath(path)
    if path in absolute:
        return True
    if exact:  # the path itself, or relative to the workdir
        try:
            return str(p.relative_to(workdir)) in names
        except ValueError:
            return False
    if any(str(a) in absolute for a in p.parents
           if str(a) not in ("/", workdir.rstrip("/") or "/")):
        return True
    try:
        relative = str(p.relative_to(workdir))
    except ValueError:
        relative = None
    if relative and relative in names:
        return True
    return p.name in names or any(a.endswith("/" + p.name) for a in absolute)


TOOL_STATE = (".git", ".hg", ".svn")
"""Folders of a tool's own bookkeeping (version control): what the oracle's commands leave
there as a side effect (reflogs, refs caches) proves nothing about the verifier."""


def mutation_candidates(paths: list[str], verifier: tuple[set[str], set[str]],
                        workdir: str) -> list[str]:
    """The outputs the mutation probe may empty or alter, those the verifier names first.
    A file inside a tool's bookkeeping folder counts only where the verifier names that
    file itself (a verifier that checks a repository's history through git names the
    repository, not ``.git/logs/HEAD``)."""
    def tool_state(path: str) -> bool:
        return any(part in TOOL_STATE for part in PurePosixPath(path).parts) and \
            not mentions(verifier, path, workdir, exact=True)

    kept = [p for p in paths if not tool_state(p)]
    return [p for p in kept if mentions(verifier, p, workdir)] or kept


def instruction_names_other(instruction: tuple[set[str], set[str]], path: str) -> str | None:
    """An absolute path the instruction names with ``path``'s file name but another
    folder (the instruction says /app/report.txt, the verifier reads /app/out/report.txt)."""
    name = PurePosixPath(path).name
    others = sorted(a for a in instruction[0] if PurePosixPath(a).name == name and a != path)
    return others[0] if others else None


def mutations(data: bytes) -> list[tuple[str, bytes]]:
    """Wrong variants of an output: emptied, and altered (each digit moved up by one; with
    no digits, each line reversed; a marker line appended when that changes nothing)."""
    text = data.decode("utf-8", "replace")
    altered = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), text)
    if altered == text:
        altered = "\n".join(line[::-1] for line in text.split("\n"))
    if altered == text:
        altered = text + "\ntmax mutation probe\n"
    return [("empty", b""), ("altered", altered.encode())]


__all__ = ["PROBE_DIR", "PRUNED", "Stat", "added", "changed", "instruction_names_other",
           "is_program", "is_scratch", "leak_matches", "listing_command", "mentions",
           "mutation_candidates", "mutations", "named_paths", "normalized", "parse_listing", "verifier_text"]
