"""A run folder's launch records, shared by the launchers (local and Slurm), ``tmax-train
status``/``stop`` and ``tmax gc``: ``RUN/jobs.json`` (every Slurm job a launcher
submitted: role, name, id, log, script), the rendered scripts in ``RUN/slurm/``, the job
logs in ``RUN/logs/``; and the launcher's own error. Written atomically (temp file, then
rename)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class TrainProcessError(Exception):
    """A process of the run failed in a way the launcher cannot repair; names its log."""


def read_jobs(run_dir: Path) -> list[dict[str, Any]]:
    """Every job a launcher submitted for this run: ``{role, name, job_id, log, script}``."""
    try:
        return list(json.loads((Path(run_dir) / "jobs.json").read_text())["jobs"])
    except (OSError, ValueError, KeyError):
        return []


def record_job(run_dir: Path, **job: Any) -> None:
    jobs = read_jobs(run_dir) + [{**job, "submitted": time.time()}]
    tmp = Path(run_dir) / ".jobs.json.tmp"
    tmp.write_text(json.dumps({"jobs": jobs}, indent=1) + "\n")
    os.replace(tmp, Path(run_dir) / "jobs.json")


def write_script(run_dir: Path, name: str, text: str) -> Path:
    """``RUN/slurm/<name>`` holding ``text`` (and ``RUN/logs/`` for its job's log)."""
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = folder / name
    tmp = path.with_name(f".{name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def job_log(run_dir: Path, role: str, job_id: str) -> Path:
    return Path(run_dir).absolute() / "logs" / f"slurm-{role}-{job_id}.out"


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""
