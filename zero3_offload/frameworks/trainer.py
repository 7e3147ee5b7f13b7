"""``Zero3Trainer``: a ``transformers.Trainer`` that trains with ZeRO-3 and offload (see
[Note: the Trainer under ZeRO-3] in ``frameworks.trainer_mixin``). Importing this
module imports transformers."""

from __future__ import annotations

from zero3_offload.frameworks.trainer_mixin import Zero3TrainerMixin
from zero3_offload.integrations.require import require_transformers

__all__ = ["Zero3Trainer"]

_transformers = require_transformers()


class Zero3Trainer(Zero3TrainerMixin, _transformers.Trainer):  # type: ignore[misc,name-defined]
    """``transformers.Trainer`` under ZeRO-3 with offload: the same arguments, plus
    ``zero3_config`` (see :class:`Zero3TrainerMixin`).

    Example::

        trainer = Zero3Trainer(
            model=model, args=TrainingArguments(...), train_dataset=data,
            zero3_config=Zero3CpuOffloadConfig(cpu_memory_budget=8 * 2**30),
        )
        trainer.train()
    """
