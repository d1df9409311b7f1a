"""Harbor's multi-step tasks (``[[steps]]``, schema 1.1+): one sandbox, several instructions
in order, each graded by its own verifier.

A step is ``steps/<name>/``: ``instruction.md`` (required), ``tests/`` (merged over the
task's top-level ``tests/``, the step's files winning, and uploaded as /tests for that
step's verifier), ``solution/solve.sh`` (the oracle's for that step), ``workdir/`` (copied
into the sandbox's working directory before the step's agent starts; a ``setup.sh`` there
runs from the working directory, then is the script's to remove). Its ``[[steps]]`` table may
set ``min_reward`` (a number, or ``{key = number}`` on reward.json's keys: below it, the
steps after it do not run), ``[steps.agent] timeout_sec``, ``[steps.verifier] timeout_sec``
and ``env``, ``[steps.healthcheck]`` (a command that must succeed before the agent starts)
and ``artifacts``.

The task's reward is ``multi_step_reward`` of the step rewards: ``mean`` (Harbor's default;
a step that did not run counts 0) or ``final`` (the last step's; 0 when it did not run).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tmax.tasks.config import TaskConfig

STEPS_DIR = "steps"
KNOWN_KEYS = frozenset({"name", "min_reward", "agent", "verifier", "healthcheck", "artifacts",
                        "solution", "environment"})


class TaskLike(Protocol):
    """What the steps read of a task (a ``tmax.tasks.model.Task``; this module sits below
    the task model, which lists its steps)."""

    @property
    def config(self) -> TaskConfig: ...

    @property
    def root(self) -> Path: ...

    @property
    def tests_dir(self) -> Path: ...


class StepError(ValueError):
    """A ``[[steps]]`` entry TMax cannot run; ``field`` names it (``steps[i].key``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class TaskStep:
    """One step of a multi-step task (see the module doc)."""

    index: int
    name: str
    root: Path
    """steps/<name>/ of the task."""
    instruction: str
    agent_timeout_sec: float
    verifier_timeout_sec: float
    verifier_env: dict[str, str] = field(default_factory=dict)
    min_reward: float | dict[str, float] | None = None
    healthcheck: dict[str, Any] | None = None
    artifacts: tuple[str, ...] = ()

    @property
    def tests_dir(self) -> Path:
        return self.root / "tests"

    @property
    def solve_script(self) -> Path:
        return self.root / "solution" / "solve.sh"

    @property
    def workdir_dir(self) -> Path:
        return self.root / "workdir"

    def passes(self, reward: float, metrics: dict[str, float]) -> bool:
        """Whether the steps after this one run (``min_reward``: on the reward, or on
        reward.json's keys; a key the verifier did not write fails it)."""
        if self.min_reward is None:
            return True
        if isinstance(self.min_reward, dict):  # reward.txt's value is the "reward" key
            named = {"reward": reward, **metrics}
            return all(named.get(k, -math.inf) >= v for k, v in self.min_reward.items())
        return reward >= self.min_reward


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StepError(where, f"expected a number, got {value!r}")
    return float(value)


def parse_steps(task: TaskLike) -> tuple[TaskStep, ...]:
    """The task's steps, in order; ``StepError`` for an entry that cannot run."""
    config = task.config
    steps: list[TaskStep] = []
    names: set[str] = set()
    for i, raw in enumerate(config.steps or ()):
        where = f"steps[{i}]"
        name = raw.get("name")
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise StepError(f"{where}.name", f"a step needs a name (a folder of steps/), "
                            f"got {name!r}")
        if name in names:
            raise StepError(f"{where}.name", f"two steps are named {name!r}")
        names.add(name)
        root = task.root / STEPS_DIR / name
        instruction = root / "instruction.md"
        if not instruction.is_file() or not instruction.read_text(errors="replace").strip():
            raise StepError(f"{where}.name", f"{STEPS_DIR}/{name}/instruction.md is missing "
                            "or empty")
        agent, verifier = raw.get("agent") or {}, raw.get("verifier") or {}
        if not isinstance(agent, dict) or not isinstance(verifier, dict):
            raise StepError(where, "[steps.agent] and [steps.verifier] must be tables")
        env = verifier.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise StepError(f"{where}.verifier.env", "expected a table of strings")
        min_reward = raw.get("min_reward")
        if isinstance(min_reward, dict):
            min_reward = {str(k): _number(v, f"{where}.min_reward.{k}")
                          for k, v in min_reward.items()}
        elif min_reward is not None:
            min_reward = _number(min_reward, f"{where}.min_reward")
        health = raw.get("healthcheck")
        if health is not None:
            if not (isinstance(health, dict) and isinstance(health.get("command"), str)):
                raise StepError(f"{where}.healthcheck", "expected a table with a command")
            for key in ("interval_sec", "timeout_sec", "retries", "start_period_sec"):
                if key in health:
                    _number(health[key], f"{where}.healthcheck.{key}")
        artifacts: list[str] = []
        for item in raw.get("artifacts") or ():
            path = item.get("source") if isinstance(item, dict) else item
            if not isinstance(path, str) or not path.startswith("/"):
                raise StepError(f"{where}.artifacts", f"expected absolute paths, got {item!r}")
            artifacts.append(path)
        steps.append(TaskStep(
            i, name, root, instruction.read_text(),
            _number(agent.get("timeout_sec", config.agent.timeout_sec),
                    f"{where}.agent.timeout_sec"),
            _number(verifier.get("timeout_sec", config.verifier.timeout_sec),
                    f"{where}.verifier.timeout_sec"),
            {**config.verifier.env, **env}, min_reward, health, tuple(artifacts)))
    return tuple(steps)


def multi_step_reward(rewards: list[float], n_steps: int, strategy: str | None) -> float:
    """The task's reward from the rewards of the steps that ran (in order; the rest did
    not run): ``mean`` over all ``n_steps`` (a step that did not run counts 0; the
    default), or ``final``: the last step's, 0 when it did not run."""
    if n_steps <= 0:
        raise ValueError("a multi-step task has at least one step")
    if (strategy or "mean") == "final":
        return rewards[-1] if len(rewards) == n_steps else 0.0
    return sum(rewards) / n_steps


def merged_tests(task: TaskLike, step: TaskStep, dest: Path) -> Path:
    """``dest``: the task's tests/ with the step's tests/ over it (what /tests is for the
    step's verifier)."""
    if task.tests_dir.is_dir():
        shutil.copytree(task.tests_dir, dest, symlinks=True)
    else:
        dest.mkdir(parents=True)
    if step.tests_dir.is_dir():
        shutil.copytree(step.tests_dir, dest, symlinks=True, dirs_exist_ok=True)
    return dest


def healthcheck_command(check: dict[str, Any]) -> tuple[str, int, float, float]:
    """(command, attempts, seconds between them, timeout of one) of a ``healthcheck``
    table, with Docker's defaults (3 retries, 30 s interval, 30 s timeout)."""
    retries = int(check.get("retries", 3))
    return (check["command"], max(1, retries + 1), float(check.get("interval_sec", 30)),
            float(check.get("timeout_sec", 30)))
