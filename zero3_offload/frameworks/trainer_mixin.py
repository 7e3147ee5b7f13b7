"""ZeRO-3 with offload under a transformers ``Trainer`` (or any subclass: TRL's
``SFTTrainer``), by changing one line: ``class MyTrainer(Zero3TrainerMixin, SFTTrainer)``.

[Note: the Trainer under ZeRO-3]
Trainer's own loop runs unchanged (its data loaders, accumulation, logging, callbacks,
evaluation, checkpoint rotation); the mixin replaces what touches the parameters:

* the model is handed to a module-mode manager at construction (every rank keeps only
  its shards; nothing is wrapped in DDP or moved to the device). Trainer's loop calls
  ``_wrap_model``'s :class:`~zero3_offload.frameworks.managed_model.ManagedModel`,
  whose forward is the manager's (see [Note: the framework's model]);
* ``compute_loss`` (Trainer's, TRL's or the user's) runs as it is;
  ``accelerator.backward(loss)`` becomes the manager's backward of ``A * loss`` (``A``:
  ``gradient_accumulation_steps``): DDP sums the micro-steps' gradients and averages the
  ranks, the manager averages both, so the update is the same. Inside the window each
  micro-step is counted with the manager's ``optimizer_step``;
* the optimizer is a :class:`~zero3_offload.frameworks.manager_optimizer.ManagerOptimizer`
  over Trainer's weight-decay split (the manager's parameter groups are the same split):
  Trainer's LR scheduler sets its rate, and its ``step`` is the manager's update, with
  ``max_grad_norm`` as the manager's clipping; the norm Trainer logs is the manager's;
* a checkpoint (``save_steps``) holds the manager's checkpoint in ``zero3/`` (loadable at
  any world size), the scheduler, RNG and trainer state as Trainer writes them, and the
  model in transformers format (or a peft adapter) as ``save_model`` writes it; a resume
  (``resume_from_checkpoint``) loads ``zero3/`` and the scheduler;
* ``save_model`` writes the transformers directory (a peft model: its adapter
  directory) streamed unit by unit from the shards (``save_pretrained``), then the
  tokenizer and the arguments as Trainer does.

What cannot be honoured is refused at construction, each line naming the argument
(``trainer_settings.refusals``).
"""

from __future__ import annotations

import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch

from zero3_offload.errors import CheckpointError, ConfigError
from zero3_offload.frameworks.managed_model import ManagedModel
from zero3_offload.frameworks.manager_group import manager_group
from zero3_offload.frameworks.manager_optimizer import ManagerOptimizer
from zero3_offload.frameworks.trainer_settings import refusals, trainer_config
from zero3_offload.integrations.require import require_transformers
from zero3_offload.logging import get_logger
from zero3_offload.sync.sync_manager import SyncManager

__all__ = ["CHECKPOINT_SUBDIR", "Zero3TrainerMixin"]

log = get_logger(__name__)

CHECKPOINT_SUBDIR = "zero3"  # the manager's checkpoint inside Trainer's checkpoint-N
_SCHEDULER_NAME = "scheduler.pt"  # Trainer's name for the scheduler's state
_STAGING = ".zero3_save"  # save_model writes here, then moves the files into place


class Zero3TrainerMixin:
    """Put before a ``transformers.Trainer`` subclass: trains its model with ZeRO-3 and
    offload (see [Note: the Trainer under ZeRO-3]).

    ``model=`` may be a local transformers directory (``config.json`` and safetensors
    weights): the manager then reads each rank's slices of the weights, so no rank holds
    the whole model at any time (a model object is whole on every rank until the manager
    takes it at construction).

    Args:
        zero3_config: a :class:`~zero3_offload.config.Zero3CpuOffloadConfig`, a dict of
            its fields, or the path of a DeepSpeed JSON config (mapped as
            ``zero3-offload train --deepspeed-config`` maps it). The
            ``TrainingArguments`` decide accumulation, clipping, optimizer and dtype.
        args, kwargs: the Trainer's own.

    Raises:
        ConfigError: for an argument that cannot be honoured (all of them listed, each
            naming the argument), or a ``zero3_config`` field the arguments decide
            otherwise.
    """

    def __init__(self, *args: Any, zero3_config: Any = None, **kwargs: Any) -> None:
        loaded = self._from_directory(args, kwargs, zero3_config)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        trainer: Any = self
        refused = refusals(trainer)
        if refused:
            if loaded is not None:
                loaded.close()
            raise ConfigError(f"{type(self).__name__}: " + "; ".join(refused))
        if loaded is not None:
            self._zero3 = loaded
        else:
            config = trainer_config(trainer.args, zero3_config)
            model = trainer.model
            no_decay = self._no_decay_names(model)
            groups = [{"params": no_decay, "weight_decay": 0.0}] if no_decay else None
            self._zero3 = SyncManager(
                config, manager_group(config.device), model, param_groups=groups
            )
        self._zero3_model = ManagedModel(self._zero3)
        self._zero3_optimizer: ManagerOptimizer | None = None
        trainer.model_wrapped = self._zero3_model
        weakref.finalize(self, self._zero3.close)
        log.info(
            "trainer_ready",
            rank=self._zero3.rank,
            world_size=self._zero3.world_size,
            trainer=type(self).__name__,
        )

    def _from_directory(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], zero3_config: Any
    ) -> SyncManager | None:
        """For ``model=`` a local transformers directory: the manager built from it by
        slices (no rank reads the whole model; ``from_pretrained``), its model put in
        ``kwargs`` for the Trainer. None for a model object."""
        model = kwargs.get("model", args[0] if args else None)
        if not isinstance(model, (str, os.PathLike)):
            return None
        if args:
            raise ConfigError(f"{type(self).__name__}: give model= and args= as keywords")
        if kwargs.get("peft_config") is not None:
            raise ConfigError(
                f"{type(self).__name__}(model=DIR, peft_config=...) is not honoured: build the "
                "peft model (peft.get_peft_model) and pass it as model="
            )
        training = kwargs.get("args")
        if training is None:
            raise ConfigError(f"{type(self).__name__}(model=DIR) needs args=TrainingArguments")
        transformers = require_transformers()
        config = trainer_config(training, zero3_config)  # args.device: torchrun's group first
        with torch.device("meta"):  # only the parameter names, for the decay split
            meta = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(model)
            )
        decay = set(transformers.Trainer.get_decay_parameter_names(self, meta))
        no_decay = [n for n, _ in meta.named_parameters() if n not in decay]
        groups = [{"params": no_decay, "weight_decay": 0.0}] if no_decay else None
        sync = SyncManager.from_pretrained(
            config, manager_group(config.device), model, param_groups=groups
        )
        kwargs["model"] = sync.model
        return sync

    @property
    def zero3(self) -> SyncManager:
        """The manager's synchronous face (its stats, its full state dict, ...)."""
        return self._zero3

    def close(self) -> None:
        """Release the manager and stop its loop (also done at the process's exit)."""
        self._zero3.close()

    def _no_decay_names(self, model: torch.nn.Module) -> list[str]:
        """Trainer's split: trainable parameters outside ``get_decay_parameter_names``."""
        decay = set(self.get_decay_parameter_names(model))  # type: ignore[attr-defined]
        return [n for n, p in model.named_parameters() if p.requires_grad and n not in decay]

    # ----------------------------------------------------------- model, optimizer

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """Nothing: the manager moves each unit to the device while it is gathered."""

    def _wrap_model(
        self, model: torch.nn.Module, training: bool = True, dataloader: Any = None
    ) -> torch.nn.Module:
        """The :class:`ManagedModel` (no DDP: the manager reduces the gradients)."""
        if not hasattr(self, "_zero3_model"):  # Trainer's __init__, before the manager
            return model
        return self._zero3_model

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """A :class:`ManagerOptimizer` over Trainer's decay split (the manager's groups)."""
        trainer: Any = self
        if self._zero3_optimizer is None:
            real = self._zero3_model.module
            no_decay = set(self._no_decay_names(real))
            named = [(n, p) for n, p in real.named_parameters() if p.requires_grad]
            args = trainer.args
            self._zero3_optimizer = ManagerOptimizer(
                self._zero3,
                [
                    {
                        "params": [p for n, p in named if n not in no_decay],
                        "weight_decay": args.weight_decay,
                    },
                    {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
                ],
                lr=args.learning_rate,
            )
            trainer.optimizer = self._zero3_optimizer
        return trainer.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, whose ``backward`` is the manager's (see [Note: the
        Trainer under ZeRO-3])."""
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        self.accelerator.backward = self._zero3_backward  # type: ignore[attr-defined]

    def _zero3_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        trainer: Any = self
        if kwargs:
            raise ConfigError(
                f"accelerator.backward({', '.join(sorted(kwargs))}=...) is not honoured by "
                "zero3_offload's backward"
            )
        self._zero3.backward(loss * trainer.args.gradient_accumulation_steps)
        if not trainer.accelerator.sync_gradients:
            assert self._zero3_optimizer is not None  # created before training
            self._zero3_optimizer.count_micro_step()

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """The manager clips in its update: the norm (filled by the update) for the log."""
        assert self._zero3_optimizer is not None
        return self._zero3_optimizer.grad_norm

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm  # the manager computes the norm only with clipping on

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> Any:
        """Trainer's (or the subclass's) ``prediction_step``, with the model's own logits
        when they are kept."""
        self._zero3_model.own_logits = not prediction_loss_only
        try:
            return super().prediction_step(  # type: ignore[misc]
                model, inputs, prediction_loss_only, ignore_keys=ignore_keys
            )
        finally:
            self._zero3_model.own_logits = False

    # ----------------------------------------------------------- saves, resumes

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model in transformers format (a peft model: its adapter directory)
        to ``output_dir`` (a collective: every rank calls it), then the tokenizer and the
        arguments as Trainer does."""
        trainer: Any = self
        args = trainer.args
        target = Path(output_dir if output_dir is not None else args.output_dir)
        staging = target / _STAGING
        if args.should_save and staging.exists():
            shutil.rmtree(staging)  # a save that failed midway
        self._zero3.save_pretrained(staging)
        if args.should_save:
            for item in sorted(staging.iterdir()):
                os.replace(item, target / item.name)
            staging.rmdir()
            if trainer.processing_class is not None:
                trainer.processing_class.save_pretrained(target)
            torch.save(args, target / "training_args.bin")
        if args.push_to_hub and not _internal_call:
            trainer.push_to_hub(commit_message="Model save", revision=args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The manager's checkpoint in ``output_dir/zero3`` (every rank writes its shards)
        and the scheduler's state, as Trainer writes it."""
        trainer: Any = self
        self._zero3.save_checkpoint(
            Path(output_dir) / CHECKPOINT_SUBDIR,
            training_state={"global_step": trainer.state.global_step},
        )
        if trainer.args.should_save and trainer.lr_scheduler is not None:
            torch.save(trainer.lr_scheduler.state_dict(), Path(output_dir) / _SCHEDULER_NAME)

    def _checkpoint_dir(self, checkpoint: str) -> Path:
        path = Path(checkpoint) / CHECKPOINT_SUBDIR
        if not path.is_dir():
            raise CheckpointError(
                f"{checkpoint}: no {CHECKPOINT_SUBDIR}/ directory: not saved by a Zero3Trainer "
                "(a plain Trainer's checkpoint holds the whole model: load it with "
                "from_pretrained and start a new run)"
            )
        return path

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Check that the checkpoint holds the manager's (it is loaded with the scheduler)."""
        self._checkpoint_dir(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Load the manager's checkpoint (any world size) and the scheduler's state."""
        if checkpoint is None:
            return
        trainer: Any = self
        self._zero3.load_checkpoint(self._checkpoint_dir(checkpoint))
        scheduler = Path(checkpoint) / _SCHEDULER_NAME
        if trainer.lr_scheduler is not None and scheduler.is_file():
            trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            # A plain optimizer's state restores the groups' rates; the scheduler's state
            # holds the same values.
            for group, lr in zip(
                trainer.optimizer.param_groups, trainer.lr_scheduler.get_last_lr(), strict=True
            ):
                group["lr"] = lr
