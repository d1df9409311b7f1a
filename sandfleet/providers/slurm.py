"""Worker jobs on a Slurm cluster.

``SlurmProvider`` renders the ``sandfleet-worker.sbatch`` template (package data,
``sandfleet/templates/``; ``set -e``; ``sandfleet up --dry-run`` prints the exact script),
submits it, polls all its jobs with one ``squeue --me -j <ids>``, and cancels by job id,
all through ``sandfleet.slurm`` (the one Slurm client: ``sbatch_lines``,
``render_template``, ``SlurmClient``).

Draining: a worker whose job ends within ``slurm.drain_before_s`` (its ``ends_at``,
reported at registration) is marked ``draining`` by the scaler (see
``sandfleet.controller.scaler``).
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from sandfleet.config import FleetConfig, fleet_key
from sandfleet.providers.base import worker_argv
from sandfleet.slurm import (
    PENDING,
    RUNNING,
    SBATCH_OPTIONS,
    SlurmClient,
    SlurmError,
    render_template,
    sbatch_lines,
    template_text,
)

log = logging.getLogger(__name__)

SBATCH_TEMPLATE = "sandfleet-worker.sbatch"
"""The worker's template, in ``sandfleet/templates/``."""
SQUEUE_STATES = {**dict.fromkeys(PENDING, "pending"), **dict.fromkeys(RUNNING, "running")}
"""A squeue state -> the provider's phase; any other state is ``ended``."""

__all__ = ["SBATCH_OPTIONS", "SBATCH_TEMPLATE", "SQUEUE_STATES", "SlurmProvider",
           "render_template", "sbatch_lines", "staggered_minutes"]


def staggered_minutes(config: FleetConfig, index: int) -> int:
    """Walltime of worker ``index``: cycles down from ``time_min`` in stagger steps."""
    s = config.slurm
    step = index % s.stagger_steps
    return max(5, s.time_min - round(step * s.stagger_min / s.stagger_steps))


class SlurmProvider:
    """Worker jobs on a Slurm cluster (see the module doc)."""

    name = "slurm"

    def __init__(self, state_dir: Path, config: FleetConfig, *,
                 template: Path | None = None, env: dict[str, str] | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.config = config
        self.template = template
        self.slurm = SlurmClient(config.slurm.command_timeout_s, env)
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
        text = self.template.read_text() if self.template is not None else \
            template_text("sandfleet", SBATCH_TEMPLATE)
        return render_template(text, {
            "sbatch_options": "\n".join(lines),
            "setup": "\n".join(s.setup) if s.setup else "# (no setup lines)",
            "worker": shlex.join(worker_argv(python, self.state_dir, name)),
            "state_dir": shlex.quote(str(self.state_dir)),
            "name": shlex.quote(name),
        })

    def submit(self, name: str, index: int) -> str:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        path = logs / f"worker-{name}.sbatch"
        path.write_text(self.script(name, index))
        try:
            return self.slurm.submit(path)
        except SlurmError as e:
            raise RuntimeError(str(e)) from None

    def poll(self, job_ids: Sequence[str]) -> dict[str, str] | None:
        if not job_ids:
            return {}
        try:
            jobs = self.slurm.queue(job_ids)
        except SlurmError as e:
            log.warning("squeue failed (%s): %s", e.returncode, e.stderr.strip()[-500:]
                        or e.reason)
            return None
        return {j: SQUEUE_STATES.get(jobs[j].state, "ended") if j in jobs else "ended"
                for j in job_ids}

    def own_jobs(self) -> list[str]:
        """This user's queued or running jobs named after this fleet (for ``gc``)."""
        prefix = f"sandfleet-{self.fleet}-"
        try:
            jobs = self.slurm.queue()
        except SlurmError:
            return []
        return [j.job_id for j in jobs.values() if j.name.startswith(prefix)]

    def cancel(self, job_id: str) -> None:
        try:
            self.slurm.cancel(job_id)
        except SlurmError as e:
            log.warning("scancel %s failed (%s): %s", job_id, e.returncode,
                        e.stderr.strip()[-500:] or e.reason)
