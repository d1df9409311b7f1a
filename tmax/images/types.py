"""The image build's shared types: the Apptainer definition (``Definition``, read by
``tmax.tasks.container_def``), a task's build plan (``TaskDefinition``), the build error, and
the paths both builders agree on.

Pure: nothing here runs a command or touches the network. The layers around it:
``plan`` turns a task's Dockerfile (or container.def) into a ``TaskDefinition``;
``installers`` and ``verifier_tools`` plan what a build adds; ``builders`` (Apptainer, local)
execute a plan, with ``rootfs`` and the ``*staging`` modules; ``build`` runs the whole of it
for a task into the store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tmax.tasks.container_def import Definition, parse_definition
from tmax.tasks.dockerfile import DEFAULT_PATH, Stage, entrypoint_command

__all__ = ["DEFAULT_PATH", "STAGING", "BuildError", "Definition", "TaskDefinition",
           "labelled_workdir", "parse_definition"]

STAGING = "/.tmax-build"
"""Where a build stages what its script copies in (removed at the end of the build)."""


class BuildError(Exception):
    """A build step failed; ``log`` is the build log's path."""

    def __init__(self, what: str, reason: str, log: Path | None = None):
        self.what, self.reason, self.log = what, reason, log
        super().__init__(f"{what}: {reason}" + (f" (log: {log})" if log else ""))


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
    tmax.images.plan) with the staged files (%files) and ENV (%environment);
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
        return entrypoint_command(self.entrypoint, self.workdir)

