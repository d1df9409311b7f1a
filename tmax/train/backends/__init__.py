"""Trainer backends behind one seam (``TrainerBackend``), chosen by ``trainer.backend``:
``torch`` (``tmax.train.trainer.Trainer``, one process) and ``deepspeed``
(``tmax.train.backends.deepspeed.DeepSpeedTrainer``, ZeRO over torch.distributed ranks;
imported only when chosen); ``tmax.train.backends.choose.make_trainer`` picks one."""

from __future__ import annotations

from tmax.train.backends.base import TrainerBackend, weights_dir, write_weights_folder

__all__ = ["TrainerBackend", "weights_dir", "write_weights_folder"]
