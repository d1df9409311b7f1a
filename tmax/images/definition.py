"""Apptainer definition files: parsing, and turning a task's Dockerfile into one."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_SPYTHON_LOCK = threading.Lock()


@dataclass
class Definition:
    """Header (``Bootstrap``, ``From``, ...; keys lower-cased) and sections by name."""

    header: dict[str, str] = field(default_factory=dict)
    sections: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> list[tuple[str, str]]:
        """(source, destination) pairs of %files; a missing destination repeats the source."""
        pairs = []
        for line in self.sections.get("files", "").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                src, *dest = shlex.split(line)
                pairs.append((src, dest[0] if dest else src))
        return pairs

    def render(self) -> str:
        head = "\n".join(f"{k.title() if k != 'osversion' else 'OSVersion'}: {v}"
                         for k, v in self.header.items())
        body = "".join(f"\n%{name}\n{text.rstrip()}\n" for name, text in self.sections.items())
        return head + "\n" + body


def parse_definition(text: str) -> Definition:
    d = Definition()
    current = None
    lines: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("%") and not s.startswith("%%"):
            if current:
                d.sections[current] = "\n".join(lines)
            current, lines = s.split()[0][1:].lower(), []
        elif current:
            lines.append(line)
        elif s and not s.startswith("#") and ":" in s:
            key, _, value = s.partition(":")
            d.header[key.strip().lower()] = value.strip()
    if current:
        d.sections[current] = "\n".join(lines)
    return d


@dataclass(frozen=True)
class TaskDefinition:
    """What a task's environment/ says to build, with its registry base resolved
    (``resolve``: image reference -> local base name, tmax.images.bases)."""

    definition: Definition
    base: str
    workdir: str


def task_definition(env_dir: Path, resolve: Callable[[str], str]) -> TaskDefinition:
    """The task's Apptainer definition (a Dockerfile goes through spython) and its base."""
    if (env_dir / "Dockerfile").is_file():
        from spython.logger import bot
        from spython.main.parse.parsers import DockerParser

        # Parsed by absolute path, never by changing directory: builds run in threads, and
        # a chdir is process-wide (it once made one task read another's Dockerfile). The
        # lock covers spython's global logger level and the stdout swap.
        with _SPYTHON_LOCK:
            quiet, bot.level = bot.level, -3  # its warnings about COPY paths are not for users
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    recipe = DockerParser(str(env_dir.resolve() / "Dockerfile")).recipe
            finally:
                bot.level = quiet
        (stage,) = recipe.values() if len(recipe) == 1 else (list(recipe.values())[-1],)
        sections = {}
        if stage.files:
            sections["files"] = "\n".join(f"    {shlex.quote(s)} {shlex.quote(d)}"
                                          for s, d in stage.files)
        if stage.install:
            sections["post"] = "\n".join(f"    {line}" for line in stage.install)
        if stage.environ:
            sections["environment"] = "\n".join(f"    export {e}" for e in stage.environ)
        definition = Definition({"bootstrap": "docker", "from": stage.fromHeader}, sections)
        workdir = stage.workdir or "/"
    else:
        definition = parse_definition((env_dir / "container.def").read_text())
        workdir = "/root"
    bootstrap = definition.header.get("bootstrap", "").lower()
    if bootstrap not in ("docker", "localimage", "library", "oras", "shub"):
        raise ValueError(f"{env_dir}: unsupported Bootstrap {bootstrap!r} (use docker)")
    base = resolve(definition.header.get("from", ""))
    return TaskDefinition(definition, base, os.path.normpath(workdir))
