"""``make_trainer``: the backend a training config names (``trainer.backend``): ``torch``
(``tmax.train.trainer.Trainer``, one process) or ``deepspeed``
(``tmax.train.backends.deepspeed.DeepSpeedTrainer``, imported only when chosen: it needs
the ``deepspeed`` extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tmax.train.backends.base import TrainerBackend

if TYPE_CHECKING:
    from tmax.train.config import TrainConfig


def make_trainer(config: TrainConfig, model: Any, *, pad_id: int,
                 max_len: int) -> TrainerBackend:
    """The backend ``config.trainer.backend`` over ``model``, with the run's algorithm,
    optimizer and schedule."""
    common: dict[str, Any] = {
        "algo": config.algo, "optim": config.optim, "total_steps": config.steps,
        "temperature": config.rollout.temperature, "fp32_head": config.model.fp32_lm_head,
        "pad_id": pad_id, "max_len": max_len, "head_chunk": config.trainer.head_chunk,
        "activation_checkpointing": config.trainer.activation_checkpointing}
    if config.trainer.backend == "deepspeed":
        from tmax.train.backends.deepspeed import DeepSpeedTrainer

        return DeepSpeedTrainer(model, trainer=config.trainer, **common)
    from tmax.train.trainer import Trainer

    return Trainer(model, **common)
