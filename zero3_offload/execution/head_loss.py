"""Module mode's loss from ``labels=``: the tiled loss in place of the model's own head and loss.

[Note: the head's tiled loss]
When a module-mode forward gets ``labels=`` and the model is a transformers causal LM
whose head and loss this class reproduces exactly, the full logits are never made: for
that call the output embedding's ``forward`` (an instance attribute, so that the unit
hooks, which live in ``__call__``, still gather the head) is replaced by one that
computes :func:`~zero3_offload.execution.tiled_loss.tiled_causal_lm_loss` from the
hidden states it receives and the labels taken out of the call's keyword arguments
(with ``shift_labels`` and ``num_items_in_batch``). The model runs without labels, so
it computes no loss of its own; its output is returned with ``loss`` the tiled loss and
``logits`` None (no logits were kept).

Reproduced exactly: a transformers model whose ``loss_function`` is transformers'
``ForCausalLMLoss`` and whose forward, read from its source, does between
``self.lm_head(hidden_states)`` and the loss nothing, or one of the logit transforms
of the supported families: Gemma 2/3's ``final_logit_softcapping`` (``tanh(l / c) * c``),
Cohere's ``logit_scale`` (``l * s``), Granite's ``logits_scaling`` (``l / s``); and adds
nothing to the loss after it (a mixture of experts' auxiliary loss). The head may be
tied, frozen or a peft LoRA-wrapped ``lm_head`` (applied through its own ``forward``,
chunk by chunk). Anything else falls back to the model's own loss and logits, with one
``tiled_loss_fallback`` log line per reason and manager.

``return_logits=True`` (a keyword this class takes out of the call) asks for the model's
own logits and loss, as does ``loss_chunk_tokens = 0``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zero3_offload.errors import StateError
from zero3_offload.execution.tiled_loss import LogitTransform, tiled_causal_lm_loss
from zero3_offload.logging import get_logger

__all__ = ["HeadLoss"]

log = get_logger(__name__)

_HEAD_CALL = "logits=self.lm_head(hidden_states)"
_LOSS_CALL = re.compile(
    r"iflabelsisnotNone:loss=self\.loss_function\((logits=)?logits,(labels=)?labels,"
    r"(vocab_size=)?self\.(config\.)?vocab_size,\*\*kwargs,?\)return"
)
_SOFTCAP = (
    "ifself.config.final_logit_softcappingisnotNone:"
    "logits=logits/self.config.final_logit_softcapping"
    "logits=torch.tanh(logits)"
    "logits=logits*self.config.final_logit_softcapping"
)
_SCALE = "logits=logits*self.logit_scale"
_SCALING = "logits=logits/self.config.logits_scaling"


class HeadLoss:
    """Chooses, per module-mode forward, between the tiled loss and the model's own.

    See [Note: the head's tiled loss].

    Args:
        model: the whole model (a peft model is looked through to its base model).
        chunk_tokens: positions per chunk of the tiled loss; 0 keeps the model's own loss.
    """

    def __init__(self, *, model: nn.Module, chunk_tokens: int) -> None:
        self._chunk = chunk_tokens
        self._base = _base_model(model)
        self._head: nn.Module | None = None
        self._transform: Callable[[], LogitTransform | None] | None = None
        self._reason = _unsupported(self._base)
        if self._reason is None:
            self._head = self._base.lm_head
            self._transform = _transform_of(self._base)
        self._logged: set[str] = set()

    @property
    def reason(self) -> str | None:
        """Why the model's own loss is used for ``labels=`` (None: the tiled loss is)."""
        return self._reason

    def tiles(self, kwargs: dict[str, Any]) -> bool:
        """Whether a call with ``kwargs`` and ``labels`` gets the tiled loss (logs nothing)."""
        own = bool(kwargs.get("return_logits", False))
        return not own and bool(self._chunk) and (self._reason or _call_reason(kwargs)) is None

    def prepare(
        self,
        method: Callable[..., Any],
        kwargs: dict[str, Any],
        gathered: Callable[[tuple[nn.Module, ...]], contextlib.AbstractContextManager[Any]],
    ) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The callable that runs the forward and its keyword arguments.

        ``gathered`` holds modules' units gathered (the runner's): the tiled loss's
        backward recomputes the chunks' logits inside it.

        ``return_logits`` is taken out of ``kwargs``. Without it, with ``labels`` given,
        ``chunk_tokens`` on and a model reproduced exactly, the callable computes the
        tiled loss (``labels``, ``shift_labels`` and ``num_items_in_batch`` taken out of
        the arguments); else it is ``method`` itself.
        """
        kwargs = dict(kwargs)
        own = bool(kwargs.pop("return_logits", False))
        if own or not self._chunk or kwargs.get("labels") is None:
            return method, kwargs
        reason = self._reason or _call_reason(kwargs)
        if reason is not None:
            if reason not in self._logged:
                self._logged.add(reason)
                log.info("tiled_loss_fallback", reason=reason)
            return method, kwargs
        targets = {
            "labels": kwargs.pop("labels"),
            "shift_labels": kwargs.pop("shift_labels", None),
            "num_items_in_batch": kwargs.pop("num_items_in_batch", None),
        }
        return _TiledCall(self, method, targets, gathered), kwargs

    def loss(
        self,
        hidden: torch.Tensor,
        inner: Callable[[torch.Tensor], torch.Tensor],
        targets: Any,
        gather: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> torch.Tensor:
        """The tiled loss of ``hidden`` through the head (applied by ``inner``, inside
        ``gather()``)."""
        assert self._head is not None and self._transform is not None
        shift = targets["shift_labels"]
        return tiled_causal_lm_loss(
            hidden,
            self._head,
            None if shift is not None else targets["labels"],
            shift_labels=shift,
            chunk_tokens=self._chunk,
            num_items_in_batch=targets["num_items_in_batch"],
            logit_transform=self._transform(),
            head_forward=inner,
            gather=gather,
        )

    @property
    def head(self) -> nn.Module:
        """The output embedding whose ``forward`` is replaced for a tiled call."""
        assert self._head is not None
        return self._head


class _TiledCall:
    """``method(*args, **kwargs)`` with the head's ``forward`` computing the tiled loss."""

    def __init__(
        self,
        owner: HeadLoss,
        method: Callable[..., Any],
        targets: Any,
        gathered: Callable[[tuple[nn.Module, ...]], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self._owner = owner
        self._method = method
        self._targets = targets
        self._gathered = gathered

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        head = self._owner.head
        inner = head.forward  # the effective forward (maybe an instance attribute)
        previous = head.__dict__.get("forward")
        found: list[torch.Tensor] = []

        def forward(hidden: torch.Tensor, *rest: Any, **kw: Any) -> torch.Tensor:
            gather = functools.partial(self._gathered, (head,))
            loss = self._owner.loss(hidden, inner, self._targets, gather)
            found.append(loss)
            # No logits: an empty tensor in their place, on the loss's graph (a gradient
            # goes through the head), for the model's code after the head.
            return loss.reshape([1] * hidden.dim()).expand(*hidden.shape[:-1], 0)

        head.forward = forward
        try:
            out = self._method(*args, **kwargs)
        finally:
            if previous is None:
                del head.forward
            else:
                head.forward = previous
        if len(found) != 1:
            raise StateError(
                f"the model called its output embedding {len(found)} times with labels "
                "given; pass return_logits=True (or loss_chunk_tokens=0) for its own loss"
            )
        if not callable(getattr(out, "items", None)):
            raise StateError(
                f"the model returned a {type(out).__name__}, not a transformers ModelOutput, "
                "with labels given; pass return_logits=True (or loss_chunk_tokens=0)"
            )
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        return type(out)(loss=found[0], **fields)


def _base_model(model: nn.Module) -> nn.Module:
    """The model a peft wrapper wraps (the model itself otherwise)."""
    base = getattr(model, "get_base_model", None)
    inner = base() if callable(base) else model
    return inner if isinstance(inner, nn.Module) else model


def _unsupported(model: nn.Module) -> str | None:
    """Why the tiled loss cannot reproduce ``model``'s head and loss (None: it can)."""
    name = type(model).__name__
    if getattr(model, "config", None) is None:
        return f"{name} is not a transformers model"
    if getattr(model.config, "return_dict", True) is False:
        return f"{name}'s config has return_dict=False: the model returns a tuple"
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        return f"{name} has no lm_head module"
    loss_function = getattr(model, "loss_function", None)
    if getattr(loss_function, "__name__", None) != "ForCausalLMLoss":
        return f"{name}'s loss_function is not transformers' ForCausalLMLoss"
    code = _forward_code(model)
    if code is None:
        return f"{name}'s forward source is not available"
    at = code.find(_HEAD_CALL)
    if at < 0 or code.count("self.lm_head(") != 1:
        return f"{name}'s forward does not apply self.lm_head once to the hidden states"
    after = code[at + len(_HEAD_CALL) :]
    middle, sep, rest = after.partition("loss=None")
    if not sep or middle not in ("", _SOFTCAP, _SCALE, _SCALING):
        return f"{name}'s forward transforms the logits in a way the tiled loss does not"
    if not _LOSS_CALL.match(rest) or "loss+=" in rest:
        return f"{name}'s forward computes its loss otherwise than ForCausalLMLoss(logits, labels)"
    return None


def _forward_code(model: nn.Module) -> str | None:
    """The model class's ``forward`` source without comments and whitespace."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return None
    lines = [re.sub(r"#.*$", "", line) for line in source.splitlines()]
    return re.sub(r"\s+", "", "".join(lines))


def _transform_of(model: nn.Module) -> Callable[[], LogitTransform | None]:
    """The logit transform of ``model``'s forward, read at each call (None: none)."""
    code = _forward_code(model) or ""
    middle = code[code.find(_HEAD_CALL) + len(_HEAD_CALL) :].partition("loss=None")[0]
    config = model.config

    def softcap() -> LogitTransform | None:
        cap = config.final_logit_softcapping
        if cap is None:
            return None
        return lambda logits: torch.tanh(logits / cap) * cap

    def scale() -> LogitTransform:
        s = model.logit_scale
        return lambda logits: logits * s

    def scaling() -> LogitTransform:
        s = config.logits_scaling
        return lambda logits: logits / s

    chosen: dict[str, Callable[[], LogitTransform | None]] = {
        _SOFTCAP: softcap,
        _SCALE: scale,
        _SCALING: scaling,
    }
    return chosen.get(middle, lambda: None)


def _call_reason(kwargs: dict[str, Any]) -> str | None:
    """Why this call's arguments need the model's own loss (None: they do not)."""
    keep = kwargs.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        return "logits_to_keep is given: the model's own loss scores only the kept positions"
    if kwargs.get("return_dict") is False:
        return "return_dict=False: the model returns a tuple"
    return None
