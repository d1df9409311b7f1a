"""Where workers come from: a *provider* starts, polls and ends worker jobs (the protocol
in ``base``); the controller's *scaler* decides how many there should be.

Providers are chosen by name from the config: ``local`` (worker processes on this machine)
and ``slurm`` (worker jobs via sbatch, squeue, scancel).
"""

from __future__ import annotations

from pathlib import Path

from sandfleet.config import FleetConfig
from sandfleet.providers.base import Provider, worker_argv
from sandfleet.providers.local import LocalProvider
from sandfleet.providers.slurm import (
    SBATCH_OPTIONS,
    SBATCH_TEMPLATE,
    SQUEUE_STATES,
    SlurmProvider,
    render_template,
    sbatch_lines,
    staggered_minutes,
)

__all__ = ["SBATCH_OPTIONS", "SBATCH_TEMPLATE", "SQUEUE_STATES", "LocalProvider", "Provider",
           "SlurmProvider", "make_provider", "render_template", "sbatch_lines",
           "staggered_minutes", "worker_argv"]


def make_provider(config: FleetConfig, state_dir: Path) -> LocalProvider | SlurmProvider:
    """The provider ``config.provider`` names, for the fleet in ``state_dir``."""
    if config.provider == "local":
        return LocalProvider(state_dir)
    return SlurmProvider(state_dir, config)
