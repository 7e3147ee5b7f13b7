"""The module a training framework calls in place of the model: each call is the manager's
forward, synchronously.

[Note: the framework's model]
A transformers ``Trainer`` or a Lightning ``Strategy`` calls ``model(**inputs)`` and
``model.train()``/``model.eval()``. Under the integrations that model is a
:class:`ManagedModel`: its ``forward`` is :meth:`SyncManager.forward` (the model's own
forward under ZeRO-3, under the caller's grad mode), and ``train``/``eval`` set the mode
of the real model. It registers neither the model nor its parameters (they are sharded;
``parameters()`` is empty), so nothing the framework does to it (a ``zero_grad``, a
device move, a DDP wrap it would refuse) touches them. ``own_logits`` asks for the
model's own logits when a loss is computed from labels (evaluation that keeps the
logits; TRL's fused head), where the tiled loss would keep none (see [Note: the head's
tiled loss] in ``execution.head_loss``). A call with ``fused_lm_head=True`` (TRL's fused
LM head, which reads ``lm_head.weight`` without calling the module) runs with the output
embedding's unit held gathered (``manager.gathered``), and its gradient reaches that
unit in the backward.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from zero3_offload.errors import StateError
from zero3_offload.sync.sync_manager import SyncManager

__all__ = ["ManagedModel"]

# Keywords with which the model computes a loss of its own from the logits (TRL's fused
# LM head): the model's own forward must see the labels.
_OWN_HEAD_KEYWORDS = ("fused_lm_head",)


class ManagedModel(nn.Module):
    """Calls the manager's model through :class:`SyncManager` (see [Note: the framework's
    model]).

    Args:
        sync: the synchronous face of a module-mode manager.
    """

    def __init__(self, sync: SyncManager) -> None:
        super().__init__()
        if sync.model is None:
            raise StateError("a framework's model needs a module-mode manager (a whole model)")
        object.__setattr__(self, "_sync", sync)  # not a submodule: nothing registered
        _hold_head_for_fused_calls(sync)
        self.own_logits = False
        self.training = sync.model.training

    @property
    def sync(self) -> SyncManager:
        """The manager's synchronous face."""
        return self._sync

    @property
    def module(self) -> nn.Module:
        """The real model (its parameters are sharded: hold no reference to their values)."""
        model = self._sync.model
        assert model is not None  # checked at construction
        return model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)`` under ZeRO-3 (a training forward, or an evaluation
        under ``torch.no_grad()``)."""
        if self.own_logits or any(kwargs.get(k) for k in _OWN_HEAD_KEYWORDS):
            kwargs.setdefault("return_logits", True)
        return self._sync.forward(*args, **kwargs)

    def train(self, mode: bool = True) -> ManagedModel:
        """Set the real model's training mode (dropout) and this module's."""
        self.module.train(mode)
        self.training = mode
        return self

    def _get_name(self) -> str:  # transformers picks its label smoother by the model's name
        return self.module._get_name()


def _hold_head_for_fused_calls(sync: SyncManager) -> None:
    """Wrap the model's forward: a call with one of ``_OWN_HEAD_KEYWORDS`` runs with the
    output embedding gathered (it runs on the manager's model thread)."""
    model = sync.model
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if model is None or head is None:
        return
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not any(kwargs.get(k) for k in _OWN_HEAD_KEYWORDS):
            return inner(*args, **kwargs)
        with sync.gathered(head):
            return inner(*args, **kwargs)

    model.forward = forward
