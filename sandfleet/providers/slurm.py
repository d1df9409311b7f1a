"""Worker jobs on a Slurm cluster.

``SlurmProvider`` renders ``slurm/sandfleet-worker.sbatch`` (``set -e``; ``sandfleet up
--dry-run`` prints the exact script), submits it with ``sbatch --parsable``, polls with one
``squeue --me -j <ids>``, and cancels with ``scancel <id>``; every call is an argv list with
a timeout. Every sbatch option is a keyword of one pure function (``sbatch_lines``), so an
unknown one fails with the list of valid ones.

Draining: a worker whose job ends within ``slurm.drain_before_s`` (its ``ends_at``,
reported at registration) is marked ``draining`` by the scaler (see
``sandfleet.controller.scaler``).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandfleet.config import FleetConfig, fleet_key
from sandfleet.providers.base import worker_argv

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
SBATCH_TEMPLATE = REPO / "slurm" / "sandfleet-worker.sbatch"

SBATCH_OPTIONS = ("job_name", "output", "nodes", "ntasks", "cpus_per_task", "mem", "time",
                  "partition", "account", "qos", "signal", "open_mode")
_JOB_ID = re.compile(r"^(\d+)(?:;\S+)?$")
SQUEUE_STATES = {"PENDING": "pending", "CONFIGURING": "pending", "REQUEUED": "pending",
                 "REQUEUE_HOLD": "pending", "RESV_DEL_HOLD": "pending",
                 "REQUEUE_FED": "pending", "SUSPENDED": "pending",
                 "RUNNING": "running", "COMPLETING": "running", "STAGE_OUT": "running",
                 "RESIZING": "running", "SIGNALING": "running"}


def sbatch_lines(extra: Sequence[str] = (), **options: Any) -> list[str]:
    """``#SBATCH`` lines for ``options`` (keywords of ``SBATCH_OPTIONS``; None skipped)
    and ``extra`` (``--key=value`` strings). Unknown keywords fail with the valid list."""
    unknown = set(options) - set(SBATCH_OPTIONS)
    if unknown:
        raise ValueError(f"unknown sbatch options {sorted(unknown)}; valid: "
                         f"{', '.join(SBATCH_OPTIONS)}")
    lines = []
    for key in SBATCH_OPTIONS:
        value = options.get(key)
        if value is None:
            continue
        text = str(value)
        if "\n" in text or not text.strip():
            raise ValueError(f"bad sbatch value for {key}: {text!r}")
        lines.append(f"#SBATCH --{key.replace('_', '-')}={text}")
    for item in extra:
        if not item.startswith("--") or "\n" in item:
            raise ValueError(f"extra sbatch option must look like --key=value: {item!r}")
        lines.append(f"#SBATCH {item}")
    return lines


def staggered_minutes(config: FleetConfig, index: int) -> int:
    """Walltime of worker ``index``: cycles down from ``time_min`` in stagger steps."""
    s = config.slurm
    step = index % s.stagger_steps
    return max(5, s.time_min - round(step * s.stagger_min / s.stagger_steps))


def render_template(template: str, values: dict[str, str]) -> str:
    """Fill ``{{key}}`` placeholders; a placeholder without a value is an error."""
    def sub(match: re.Match) -> str:
        key = match.group(1)
        if key not in values:
            raise ValueError(f"template placeholder {{{{{key}}}}} has no value")
        return values[key]

    return re.sub(r"\{\{(\w+)\}\}", sub, template)


class SlurmProvider:
    """Worker jobs on a Slurm cluster (see the module doc)."""

    name = "slurm"

    def __init__(self, state_dir: Path, config: FleetConfig, *,
                 template: Path = SBATCH_TEMPLATE, env: dict[str, str] | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.config = config
        self.template = Path(template)
        self.env = env
        self.poll_min_s = config.slurm.poll_min_s
        self.poll_max_s = config.slurm.poll_max_s
        self.fleet = fleet_key(self.state_dir)

    def script(self, name: str, index: int) -> str:
        """The exact batch script of worker ``name`` (what ``--dry-run`` prints)."""
        c, s = self.config, self.config.slurm
        lines = sbatch_lines(
            s.extra_options, job_name=f"sandfleet-{self.fleet}-{name}",
            output=str(self.state_dir / "logs" / f"slurm-{name}-%j.out"), nodes=1, ntasks=1,
            cpus_per_task=c.cpus_per_node, mem=f"{c.memory_mb_per_node}M",
            time=staggered_minutes(c, index), partition=s.partition, account=s.account,
            qos=s.qos, signal="B:TERM@120", open_mode="append")
        python = s.python or sys.executable
        return render_template(self.template.read_text(), {
            "sbatch_options": "\n".join(lines),
            "setup": "\n".join(s.setup) if s.setup else "# (no setup lines)",
            "worker": shlex.join(worker_argv(python, self.state_dir, name)),
            "state_dir": shlex.quote(str(self.state_dir)),
            "name": shlex.quote(name),
        })

    def _run(self, argv: list[str], *, stdin: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, **(self.env or {})}
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env,
                              timeout=self.config.slurm.command_timeout_s,
                              start_new_session=True, check=False)

    def submit(self, name: str, index: int) -> str:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        path = logs / f"worker-{name}.sbatch"
        path.write_text(self.script(name, index))
        out = self._run(["sbatch", "--parsable", str(path)])
        match = _JOB_ID.match(out.stdout.strip())
        if out.returncode != 0 or not match:
            raise RuntimeError(f"sbatch {path} failed ({out.returncode}): "
                               f"{out.stderr.strip()[-2000:] or out.stdout.strip()}")
        return match.group(1)

    def poll(self, job_ids: Sequence[str]) -> dict[str, str] | None:
        if not job_ids:
            return {}
        out = self._run(["squeue", "--me", "-h", "-j", ",".join(job_ids), "-o", "%i %T %N"])
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:
                return dict.fromkeys(job_ids, "ended")
            log.warning("squeue failed (%d): %s", out.returncode, out.stderr.strip()[-500:])
            return None
        seen = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2:
                seen[parts[0]] = SQUEUE_STATES.get(parts[1], "ended")
        return {job_id: seen.get(job_id, "ended") for job_id in job_ids}

    def own_jobs(self) -> list[str]:
        """This user's queued or running jobs named after this fleet (for ``gc``)."""
        out = self._run(["squeue", "--me", "-h", "-o", "%i %j"])
        prefix = f"sandfleet-{self.fleet}-"
        return [line.split()[0] for line in out.stdout.splitlines()
                if len(line.split()) == 2 and line.split()[1].startswith(prefix)] \
            if out.returncode == 0 else []

    def cancel(self, job_id: str) -> None:
        if not job_id.isdigit():
            raise ValueError(f"not a Slurm job id: {job_id!r}")
        out = self._run(["scancel", job_id])
        if out.returncode != 0 and "Invalid job id" not in out.stderr \
                and "already completing" not in out.stderr:
            log.warning("scancel %s failed (%d): %s", job_id, out.returncode,
                        out.stderr.strip()[-500:])
