"""task.toml: the native (Harbor / Terminal-Bench 2.x) task metadata, as a strict schema.

Unknown keys are an error at load time. Free-form data a task author wants to keep goes
under ``[metadata.extra]``; the axes a task generator sampled go under ``[metadata.axes]``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DOMAINS: tuple[str, ...] = (
    "security",
    "software-engineering",
    "data-science",
    "data-processing",
    "data-querying",
    "scientific-computing",
    "system-administration",
    "file-operations",
    "debugging",
)
"""The nine task domains of the TMax recipe."""

Domain = Literal[
    "security",
    "software-engineering",
    "data-science",
    "data-processing",
    "data-querying",
    "scientific-computing",
    "system-administration",
    "file-operations",
    "debugging",
]
Difficulty = Literal["easy", "medium", "hard"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Metadata(_Strict):
    author_name: str = ""
    """Who wrote the task."""
    author_email: str = ""
    difficulty: Difficulty = "medium"
    """easy | medium | hard."""
    category: str = ""
    """Free-form category (Harbor's field); TMax uses ``domain`` for its nine domains."""
    domain: Domain | None = None
    """One of the nine TMax domains (see ``DOMAINS``)."""
    tags: tuple[str, ...] = ()
    skills: tuple[str, ...] = ()
    """Short names of the skills the task exercises."""
    axes: dict[str, str] = Field(default_factory=dict)
    """Values a task generator sampled for this task, by axis name."""
    source: str = ""
    """Where the task came from (e.g. ``converted from terminal-bench-1``)."""
    extra: dict[str, str | int | float | bool | list[str]] = Field(default_factory=dict)
    """Anything else; kept, never interpreted."""


class Verifier(_Strict):
    timeout_sec: float = Field(120.0, gt=0)
    """Wall-clock limit for tests/test.sh."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for the verifier."""
    agent_system: bool = False
    """Run the verifier with the agent's /usr, /bin, /lib and /etc instead of the image's
    as built: for tasks that grade what the agent installed. An agent can then change the
    tools that grade it (audits flag such tasks as hackable)."""


class Agent(_Strict):
    timeout_sec: float = Field(900.0, gt=0)
    """Episode time budget, counted from the moment the sandbox lease is granted."""


class Solution(_Strict):
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for solution/solve.sh."""


class Environment(_Strict):
    build_timeout_sec: float = Field(600.0, gt=0)
    docker_image: str | None = None
    """A prebuilt image to use instead of building environment/ (Harbor's field)."""
    cpus: int = Field(2, ge=1)
    memory_mb: int = Field(2048, ge=64)
    storage_mb: int = Field(10240, ge=16)
    gpus: int = Field(0, ge=0)
    network: bool = False
    """Whether the sandbox gets a network; off unless the task needs it."""


class TaskConfig(_Strict):
    """The whole of task.toml."""

    version: str = "1.0"
    metadata: Metadata = Field(default_factory=Metadata)
    verifier: Verifier = Field(default_factory=Verifier)
    agent: Agent = Field(default_factory=Agent)
    solution: Solution = Field(default_factory=Solution)
    environment: Environment = Field(default_factory=Environment)

    def to_toml_dict(self) -> dict:
        """A plain dict for tomli_w, without None values (TOML has no null)."""
        return _drop_none(self.model_dump(mode="json"))


def _drop_none(value):
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    return value
