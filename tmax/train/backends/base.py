"""The trainer-backend seam: what the training loop asks of whatever runs the optimizer.

A backend owns the training model, its optimizer and LR schedule, and its ranks. The loop
hands it the step's samples (``step``), takes the new weights for the inference engine
(``export_weights`` in process, ``export_to_path`` as a versioned folder on shared
scratch) and checkpoints it (``save`` / ``load``, with RNG state, for resume).

Weights folders (the format ``tmax.inference`` reads): ``<root>/v<version:08d>/`` holds the
model's config and safetensors, and ``tmax-weights.json`` (``{"version": N}``), written
last after an fsync. The folder is written under a temporary name and renamed into place,
so a reader never sees a partial one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from tmax.inference.base import weights_dir, write_weights

__all__ = ["TrainerBackend", "weights_dir", "write_weights_folder"]


@runtime_checkable
class TrainerBackend(Protocol):
    """One optimizer step per ``step``; every rank of a multi-rank backend calls every
    method (they run collectives), rank 0 alone returns the weights."""

    rank: int
    world_size: int
    step_count: int
    max_len: int

    def step(self, samples: list[Any]) -> dict[str, float]:
        """One optimizer step on this rank's ``samples`` (``tmax.train.trainer.Sample``;
        an empty list is allowed on a rank when others have some). The loss is token-level
        over the response tokens of ALL ranks' samples; returns the step's metrics (the
        same on every rank)."""
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The full state dict (rank 0; other ranks get ``{}``), for in-process sync."""
        ...

    def export_to_path(self, root: Path, version: int) -> Path:
        """Write weights ``version`` as ``<root>/v<version:08d>/`` (atomic, rank 0)."""
        ...

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> Path:
        """Checkpoint (model, optimizer, schedule, step, RNG) to ``directory``, atomically."""
        ...

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore a ``save``d checkpoint; returns its ``extra``."""
        ...


def write_weights_folder(model: Any, state_dict: dict[str, torch.Tensor] | None, root: Path,
                         version: int) -> Path:
    """``tmax.inference.base.write_weights``: the one writer of the format engines read."""
    return write_weights(model, root, version, state_dict=state_dict)
