"""Where a run's step metrics go besides RUN/metrics.jsonl: TensorBoard and Weights & Biases
(``tracking:`` in the train config), and what the run records about itself (RUN/run.json).

- ``tensorboard: true``: scalars to RUN/tensorboard (``tensorboard --logdir RUN``);
- ``wandb: {enabled: true, project, mode}``: a W&B run whose id is derived from the run
  folder, so a resumed or requeued run continues the same W&B run; ``mode: offline``
  (the default) needs no network and no account: ``wandb sync RUN/wandb/offline-run-*``
  uploads it later from a login node.

Both import lazily; a tracker asked for whose package is missing is a ``TrackingError``
before the first step, naming the package. A tracker that fails mid-run is logged and
dropped: metrics.jsonl stays the record, a dashboard never ends a run.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class TrackingError(RuntimeError):
    """A tracker that cannot start (its package missing); names the package."""


class WandbSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=False, description="Log each step to Weights & Biases.")
    project: str = Field(default="tmax", description="W&B project.")
    entity: str | None = Field(default=None,
                               description="W&B entity (team or user); None: yours.")
    mode: Literal["offline", "online"] = Field(
        default="offline", description="offline: no network needed, `wandb sync` later.")


class TrackingSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensorboard: bool = Field(default=False, description="Scalars to RUN/tensorboard.")
    wandb: WandbSection = Field(default_factory=WandbSection)


class Tracker(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record (bools and non-numbers left out)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackingError("tracking.tensorboard needs the tensorboard package: pip "
                                f"install tensorboard (or tmax[track]) ({e})") from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_run_id(run_dir: Path) -> str:
    """A W&B run id fixed by the run folder: the same run resumes the same W&B run."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


class Wandb:
    def __init__(self, section: WandbSection, run_dir: Path, config: dict[str, Any]):
        try:
            import wandb
        except ImportError as e:
            raise TrackingError("tracking.wandb needs the wandb package: pip install wandb "
                                f"(or tmax[track]) ({e})") from None
        self.run = wandb.init(project=section.project, entity=section.entity,
                              mode=section.mode, dir=str(run_dir), id=wandb_run_id(run_dir),
                              name=run_dir.name, resume="allow", config=config,
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The configured trackers as one; a failing one is logged and dropped."""

    def __init__(self, trackers: list[tuple[str, Tracker]]):
        self.trackers = trackers

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for name, tracker in list(self.trackers):
            try:
                tracker.log(metrics, step)
            except Exception as e:  # a dashboard must not end a run
                log.warning("tracking: %s failed (%s); dropped, metrics.jsonl goes on",
                            name, e, exc_info=True)
                self.trackers.remove((name, tracker))

    def close(self) -> None:
        for name, tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:  # the run's own result stands
                log.warning("tracking: closing %s failed: %s", name, e, exc_info=True)
        self.trackers = []


def open_trackers(section: TrackingSection, run_dir: Path, config: dict[str, Any]
                  ) -> Trackers:
    trackers: list[tuple[str, Tracker]] = []
    if section.tensorboard:
        trackers.append(("tensorboard", TensorBoard(run_dir)))
    if section.wandb.enabled:
        trackers.append(("wandb", Wandb(section.wandb, run_dir, config)))
    return Trackers(trackers)


def git_state(repo: Path | None = None) -> dict[str, Any]:
    """The commit of the code that runs, and whether its tree had changes (None outside a
    git checkout, e.g. an installed wheel, even one in a virtualenv inside another
    repository: this file must be tracked there). ``repo``: another checkout's state."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                 text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    if repo is None:
        repo = Path(__file__).resolve().parent
        if git("ls-files", "--error-unmatch", Path(__file__).name) is None:
            return {"commit": None, "dirty": None}
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def write_run_info(run_dir: Path, launcher: str) -> Path:
    """RUN/run.json: the git commit and state, the versions, host, user and command line of
    the launch (one record per launch, appended to ``launches``; written then renamed)."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    path = run_dir / "run.json"
    try:
        launches = json.loads(path.read_text()).get("launches", [])
    except (OSError, ValueError):
        launches = []
    launches.append({
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "launcher": launcher,
        "git": git_state(), "tmax": ver("tmax"), "torch": ver("torch"),
        "python": platform.python_version(), "host": socket.gethostname(),
        "user": getpass.getuser(), "argv": sys.argv,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID")})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"launches": launches}, indent=2) + "\n")
    os.replace(tmp, path)
    return path


__all__ = ["TensorBoard", "Tracker", "Trackers", "TrackingError", "TrackingSection", "Wandb",
           "WandbSection", "git_state", "open_trackers", "scalars", "wandb_run_id",
           "write_run_info"]
