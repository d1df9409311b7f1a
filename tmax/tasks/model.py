"""The task model: a native task on disk, a draft in memory, and the problems found in them.

Native layout (Harbor / Terminal-Bench 2.x)::

    <task>/instruction.md          what the agent is told
    <task>/task.toml               metadata, timeouts, resources (see ``config.TaskConfig``)
    <task>/environment/            Dockerfile or container.def (Apptainer), plus their files
    <task>/tests/test.sh           verifier: writes /logs/verifier/reward.txt or reward.json
    <task>/solution/solve.sh       reference solution (optional, as in Harbor)
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tmax.tasks.config import TaskConfig
from tmax.tasks.steps import TaskStep, parse_steps

INSTRUCTION = "instruction.md"
TASK_TOML = "task.toml"
ENV_DIR = "environment"
TESTS_DIR = "tests"
SOLUTION_DIR = "solution"
TEST_SCRIPT = "tests/test.sh"
SOLVE_SCRIPT = "solution/solve.sh"
DEFINITION_FILES = ("Dockerfile", "container.def")
REWARD_FILES = ("/logs/verifier/reward.txt", "/logs/verifier/reward.json")

NO_BAKED_TESTS = ("the separate verifier's image has no /tests: tests/Dockerfile must copy "
                  "the tests there (COPY . /tests/), as Harbor uploads none in separate mode")
TASK_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a task: where it is and what to do about it."""

    task: str
    file: str
    """Path relative to the task directory ('' for the directory itself)."""
    message: str
    fix: str = ""
    field: str = ""
    """Dotted key inside the file (task.toml) or a line reference (``line 3``)."""
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        where = self.file or "."
        if self.field:
            where += f" [{self.field}]"
        text = f"{self.task}: {where}: {self.message}"
        return f"{text} -> {self.fix}" if self.fix else text

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class TaskError(Exception):
    """A task that cannot be used; carries every problem found."""

    def __init__(self, problems: list[Problem]):
        if not problems:
            raise ValueError("TaskError needs at least one problem")
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    @property
    def task(self) -> str:
        return self.problems[0].task


class MissingSolution(RuntimeError):
    """A check that runs the reference solution, on a task that has none (solution/ is
    optional in Harbor)."""

    def __init__(self, task: str):
        self.task = task
        super().__init__(f"{task}: the task has no reference solution ({SOLVE_SCRIPT}), so "
                         "the oracle check cannot run; add one to show the task is solvable")


@dataclass(frozen=True)
class FileSpec:
    """A file of a draft: its bytes and its permission bits."""

    data: bytes
    mode: int = 0o644

    @classmethod
    def read(cls, path: Path) -> FileSpec:
        return cls(path.read_bytes(), path.stat().st_mode & 0o777)

    @classmethod
    def script(cls, text: str) -> FileSpec:
        return cls(text.encode(), 0o755)


@dataclass
class TaskDraft:
    """A task in memory, in native layout, ready for ``write_task``.

    ``files`` maps native relative paths (``environment/Dockerfile``, ``tests/test.sh``...)
    to their contents; instruction.md and task.toml are rendered from the other fields.
    """

    task_id: str
    instruction: str
    config: TaskConfig
    files: dict[str, FileSpec] = field(default_factory=dict)
    source_format: str = "native"
    warnings: list[Problem] = field(default_factory=list)


@dataclass(frozen=True)
class Task:
    """A native task on disk that passed validation (warnings allowed)."""

    task_id: str
    root: Path
    instruction: str
    config: TaskConfig
    warnings: tuple[Problem, ...] = ()

    @property
    def environment_dir(self) -> Path:
        return self.root / ENV_DIR

    @property
    def tests_dir(self) -> Path:
        return self.root / TESTS_DIR

    @property
    def solution_dir(self) -> Path:
        return self.root / SOLUTION_DIR

    @property
    def has_solution(self) -> bool:
        return (self.root / SOLVE_SCRIPT).is_file()

    @functools.cached_property
    def steps(self) -> tuple[TaskStep, ...]:
        """A multi-step task's steps (Harbor's ``[[steps]]``, tmax.tasks.steps); () for a
        task of one."""
        return parse_steps(self) if self.config.steps else ()

    @property
    def separate_verifier(self) -> bool:
        """Harbor's separate verifier (``[verifier] environment_mode = "separate"``, or a
        ``[verifier.environment]`` with no mode): test.sh runs in a sandbox of its own, which
        gets only the agent's ``artifacts``."""
        verifier = self.config.verifier
        return verifier.environment_mode == "separate" or \
            (verifier.environment_mode is None and verifier.environment is not None)

    @property
    def verifier_definition(self) -> Path | None:
        """tests/Dockerfile of a separate verifier: its image's definition, tests/ the build
        context, and /tests as the image has it (Harbor uploads no tests/ then). None: the
        verifier runs in a fresh sandbox of the task's own image, tests/ uploaded."""
        path = self.tests_dir / "Dockerfile"
        return path if self.separate_verifier and path.is_file() else None

    @property
    def artifacts(self) -> tuple[str, ...]:
        """What a separate verifier gets from the agent's sandbox, at the same paths:
        /logs/artifacts, then the task's top-level ``artifacts`` (paths, or Harbor's
        ``{source = PATH, ...}`` tables)."""
        paths = ["/logs/artifacts"]
        for item in self.config.artifacts:
            path = item.get("source") if isinstance(item, dict) else item
            if isinstance(path, str) and path.startswith("/") and path not in paths:
                paths.append(path)
        return tuple(paths)

    @property
    def definition(self) -> Path:
        """environment/Dockerfile or environment/container.def (validation ensures one)."""
        for name in DEFINITION_FILES:
            if (self.environment_dir / name).is_file():
                return self.environment_dir / name
        raise FileNotFoundError(self.environment_dir)

    @property
    def definition_kind(self) -> Literal["dockerfile", "apptainer"]:
        return "dockerfile" if self.definition.name == "Dockerfile" else "apptainer"

    @property
    def domain(self) -> str:
        md = self.config.metadata
        return md.domain or md.category or "unknown"

    @property
    def difficulty(self) -> str:
        return self.config.metadata.difficulty

    def summary(self) -> dict:
        """What `tmax tasks ls -o json` prints for one task."""
        return {
            "id": self.task_id,
            "path": str(self.root),
            "domain": self.domain,
            "difficulty": self.difficulty,
            "environment": self.definition_kind,
            "cpus": self.config.environment.cpus,
            "memory_mb": self.config.environment.memory_mb,
            "network": self.config.environment.network,
            "agent_timeout_sec": self.config.agent.timeout_sec,
            "verifier_timeout_sec": self.config.verifier.timeout_sec,
            "tags": list(self.config.metadata.tags),
        }
