"""Apptainer definition files: parsing, and turning a task's Dockerfile into one."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tmax.images.dockerbuild import STAGING, environment_section, stage_script
from tmax.tasks.dockerfile import DEFAULT_PATH, Stage
from tmax.tasks.dockerfile import parse as parse_dockerfile


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


WORKDIR_LABEL = "org.tmax.workdir"
"""A base's %labels entry naming its WORKDIR (the Terminal-Bench bases start in /app)."""


def labelled_workdir(definition_text: str) -> str | None:
    """The WORKDIR a base definition declares in %labels (``org.tmax.workdir /app``)."""
    for line in parse_definition(definition_text).sections.get("labels", "").splitlines():
        key, _, value = line.strip().partition(" ")
        if key == WORKDIR_LABEL and value.strip():
            return value.strip()
    return None


@dataclass(frozen=True)
class TaskDefinition:
    """What a task's environment/ says to build, with its registry base resolved
    (``resolve``: image reference -> local base name, tmax.images.bases).

    A Dockerfile becomes ``definition`` = its final stage as a build script (%post, see
    tmax.images.dockerbuild) with the staged files (%files) and ENV (%environment);
    ``stages`` are the stages it needs, with their bases (earlier ones: COPY --from)."""

    definition: Definition
    base: str
    workdir: str
    stages: tuple[tuple[Stage, str], ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def entrypoint(self) -> tuple[str, ...]:
        """The final stage's ENTRYPOINT (a Dockerfile's; () for none)."""
        return self.stages[-1][0].entrypoint if self.stages else ()

    @property
    def user(self) -> str:
        """The final stage's USER (a Dockerfile's, as written; "" for root): who the
        sandbox's commands run as, as in Docker."""
        return self.stages[-1][0].user if self.stages else ""

    @property
    def stage_bases(self) -> tuple[str, ...]:
        """The bases of earlier stages (COPY --from) other than the final stage's, once
        each, in order: each stage is built over its own base, as in Docker."""
        return tuple(dict.fromkeys(b for _, b in self.stages if b != self.base))

    @property
    def start_command(self) -> str:
        """What a sandbox of the image runs first, in the background: its ENTRYPOINT as
        Harbor starts it (tmax.tasks.dockerfile.entrypoint_command); "" for none."""
        from tmax.tasks.dockerfile import entrypoint_command

        return entrypoint_command(self.entrypoint, self.workdir)


def task_definition(env_dir: Path, resolve: Callable[[str], str],
                    base_workdir: Callable[[str], str] = lambda base: "/",
                    base_path: Callable[[str], str] | None = None) -> TaskDefinition:
    """The task's Apptainer definition and its base (``base_workdir``: a base's WORKDIR,
    where a Dockerfile's relative paths start; ``base_path``: its PATH)."""
    if (env_dir / "Dockerfile").is_file():
        return dockerfile_definition((env_dir / "Dockerfile").read_text(errors="replace"),
                                     resolve, base_workdir, base_path)
    definition = parse_definition((env_dir / "container.def").read_text())
    bootstrap = definition.header.get("bootstrap", "").lower()
    if bootstrap not in ("docker", "localimage", "library", "oras", "shub"):
        raise ValueError(f"{env_dir}: unsupported Bootstrap {bootstrap!r} (use docker)")
    base = resolve(definition.header.get("from", ""))
    return TaskDefinition(definition, base, "/root")


def dockerfile_definition(text: str, resolve: Callable[[str], str],
                          base_workdir: Callable[[str], str] = lambda base: "/",
                          base_path: Callable[[str], str] | None = None) -> TaskDefinition:
    """A Dockerfile as a TaskDefinition (``DockerfileError`` for what cannot be built)."""
    bases: dict[str, str] = {}

    def base_of(image: str) -> str:
        if image not in bases:
            bases[image] = resolve(image)
        return bases[image]

    def workdir_of(image: str) -> str:
        return base_workdir(base_of(image))

    def path_of(image: str) -> str:
        return base_path(base_of(image)) if base_path else DEFAULT_PATH

    parsed = parse_dockerfile(text, workdir_of, path_of)
    needed = parsed.needed()
    final = parsed.final
    sections = {"files": f"    {STAGING.lstrip('/')} {STAGING}", "post": _indent(stage_script(final))}
    if final.env:
        sections["environment"] = environment_section(final)
    definition = Definition({"bootstrap": "docker", "from": final.image}, sections)
    notes = [n for stage in needed for n in stage.notes]
    if final.user:
        notes.append(f"USER {final.user} at the end ignored: sandboxes start a root shell")
    return TaskDefinition(definition, bases[final.image], final.workdir,
                          tuple((s, bases[s.image]) for s in needed), tuple(notes))


def _indent(script: str) -> str:
    return "\n".join(f"    {line}" if line else "" for line in script.splitlines())
