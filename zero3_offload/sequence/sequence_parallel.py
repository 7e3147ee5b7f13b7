"""The sequence-parallel side of module mode: the model's attention swapped for Ulysses
attention, each forward's batch cut into this rank's slice and its loss made whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from zero3_offload.errors import ConfigError, InputError
from zero3_offload.logging import get_logger
from zero3_offload.sequence.input_split import split_sequence
from zero3_offload.sequence.loss import sequence_loss, whole_sequence_loss
from zero3_offload.sequence.sequence_group import SequenceGroup
from zero3_offload.sequence.ulysses_attention import ULYSSES, register_ulysses

__all__ = ["SequenceParallel"]

log = get_logger(__name__)

_WRAPPED = ("eager", "sdpa")  # implementations that take the whole sequence's mask


class SequenceParallel:
    """Splits each forward's sequences over a group of ranks (see [Note: sequence parallelism]).

    Built with the manager: the transformers model's attention implementation (eager or
    sdpa) is replaced by :data:`ULYSSES`, which runs it over the whole sequence; closing
    puts it back and frees the group.

    Args:
        model: the whole model (a transformers model, or a peft model over one).
        size: S, ranks per sequence.
        group: this rank's sequence group and the rules of its collectives.
        rank: this rank's place in the group (which slice it runs).

    Raises:
        ConfigError: for a model without a transformers config, an implementation other
            than eager or sdpa, or heads that S does not divide.
    """

    def __init__(self, *, model: nn.Module, size: int, group: SequenceGroup, rank: int) -> None:
        self.size = size
        self.group = group
        self._rank = rank
        self._model = _transformers_model(model, size)
        config = self._model.config
        self._original: str = config._attn_implementation
        if self._original not in _WRAPPED:
            raise ConfigError(
                f"sequence_parallel_size={size} wraps eager or sdpa attention, and the model "
                f"uses {self._original!r}: call model.set_attn_implementation('sdpa') first"
            )
        _check_heads(config, size)
        register_ulysses()
        self._model.set_attn_implementation(ULYSSES)
        log.info("sequence_parallel", size=size, rank_in_group=rank, wrapped=self._original)

    def split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, tiled: bool = False
    ) -> tuple[dict[str, Any], Callable[[Any], Any]]:
        """This rank's keyword arguments for the model (see :func:`split_sequence`) and
        what turns the model's output into the call's: with ``labels``, its ``loss`` set
        to the whole sequence's (:func:`sequence_loss`, computed on the model thread: it
        all-reduces over the group).

        With ``tiled`` (the caller computes the loss from ``labels=`` without full logits)
        the slice's shifted labels go to the model as ``labels`` and ``shift_labels``
        with ``num_items_in_batch=1``, so the loss it returns is the slice's sum, which
        :func:`whole_sequence_loss` makes whole.

        Raises:
            InputError: for positional arguments, or inputs that cannot be cut.
        """
        if args:
            raise InputError(
                "with sequence_parallel_size > 1 pass the model's inputs as keyword "
                "arguments (input_ids=..., labels=...): the manager cuts them"
            )
        local, labels = split_sequence(
            kwargs,
            rank=self._rank,
            size=self.size,
            group=self.group,
            implementation=self._original,
        )
        group = self.group
        if tiled and labels is not None:
            local.update(labels=labels, shift_labels=labels, num_items_in_batch=1)

        def finish(out: Any) -> Any:
            if labels is None:
                return out
            if tiled:
                out["loss"] = whole_sequence_loss(out["loss"], labels, group)
                return out
            logits = getattr(out, "logits", None)
            if logits is None:
                raise InputError(
                    "sequence_parallel_size > 1 computes the loss from the output's logits, "
                    f"and the model returned {type(out).__name__} without them"
                )
            out["loss"] = sequence_loss(logits, labels, group)
            return out

        return local, finish

    def close(self) -> None:
        """Put the model's own attention implementation back and free the group."""
        self._model.set_attn_implementation(self._original)
        if dist.is_initialized():  # else destroying the default group destroyed it too
            dist.destroy_process_group(self.group.group)


def _transformers_model(model: nn.Module, size: int) -> Any:
    """The transformers model in ``model`` (itself, or the base of a peft model)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise ConfigError(
        f"sequence_parallel_size={size} needs a transformers model (its attention runs "
        f"through transformers' attention interface); got {type(model).__name__}"
    )


def _check_heads(config: Any, size: int) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise ConfigError(
            f"sequence_parallel_size={size} needs the model config's num_attention_heads "
            f"(got {heads!r}) to split attention heads over the ranks"
        )
    if heads % size:
        raise ConfigError(
            f"sequence_parallel_size={size} must divide the model's {heads} attention heads: "
            "each rank of a sequence attends with heads/S of them over the whole sequence; "
            "pick a divisor of the head count"
        )
    if kv_heads % size and size % kv_heads:
        raise ConfigError(
            f"sequence_parallel_size={size} must divide the model's {kv_heads} key/value "
            "heads (each rank attends with key/value heads/S of them) or be a multiple of "
            "them (each key/value head replicated over S/key-value-heads ranks); pick a "
            f"divisor or a multiple of {kv_heads}"
        )
