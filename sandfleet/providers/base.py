"""What every provider is: three blocking calls (the scaler runs them in threads) and two
poll intervals.

- ``submit(name, index) -> job id``: start one worker called ``name`` (the index staggers
  Slurm walltimes);
- ``poll(job_ids) -> {job id: pending | running | ended}``: ONE call for every job (a
  batched ``squeue``), ``None`` when the answer is unknown this time;
- ``cancel(job_id)``: end one job this fleet started, by id (never by name or user).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Provider(Protocol):
    name: str
    poll_min_s: float
    poll_max_s: float

    def submit(self, name: str, index: int) -> str:
        """Start one worker; its job id."""

    def poll(self, job_ids: Sequence[str]) -> dict[str, str] | None:
        """Every job's state (pending, running, ended), in one call; None if unknown."""

    def cancel(self, job_id: str) -> None:
        """End one job this fleet started (idempotent)."""


def worker_argv(python: str, state_dir: Path, name: str) -> list[str]:
    """The command line of worker ``name`` of the fleet in ``state_dir``."""
    return [python, "-m", "sandfleet.cli", "-v", "worker", "--state-dir", str(state_dir),
            "--name", name]
