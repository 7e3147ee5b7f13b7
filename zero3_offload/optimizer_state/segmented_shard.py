"""One layer's shard stepped as segments, one torch param group per parameter group.

[Note: segmented shards]
When a layer's parameters are not all in one element-wise group (see [Note:
parameter groups] in ``optimizer_state.optimizer_plan``), this rank's shard is cut
into segments, one per run of parameters of one group inside the rank's slice. Each
group of the layer gets one torch optimizer whose param group holds that group's
segments (1-D tensors pointed at the master's storage with ``Tensor.set_`` for the
step: the update is in place in the master shard), with the group's options and
``lr = learning_rate * lr_scale``. Element-wise updates of the segments are the
updates of the whole parameters (the probe of [Note: optimizer kinds] checks it).
Elements of the shard in no segment (padding; the elements of whole-parameter
updates) are not stepped here.

The layer's optimizer state is kept per layer, as for an unsegmented shard, so the
checkpoints, the disk tier and the speculative backup see one dict: each per-element
key (``exp_avg``, ``momentum_buffer``, ...) is one tensor of the shard's length,
holding each segment's state at the segment's place (zero elsewhere), and each scalar
key (``step``, NAdam's ``mu_product``) is one 0-dim tensor. Every key any group of
the layer keeps is allocated on every rank (a shared fact), so the ranks' checkpoint
files hold the same tensors and load at any world size. For the step the segments'
torch state is bound to views of these tensors (the scalars to copies, which torch
advances once per segment), and unbound afterwards; a tensor torch replaced rather
than updated in place is copied back. The groups of one layer must agree on the
scalars (``plan_optimizer`` checks it with a probe of their options).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero3_offload.errors import StateError
from zero3_offload.optimizer_state.optimizer_plan import ResolvedGroup, Segment
from zero3_offload.stats.tensor_bytes import tensor_bytes

__all__ = ["SegmentedShard"]


class SegmentedShard:
    """The element-wise segments of one layer's master shard and their state.

    Args:
        master: the layer's fp32 master shard (its storage may be replaced between steps,
            by the disk tier: the segments are pointed at it at each step).
        segments: this rank's segments of the layer.
        groups: every parameter group, by index.
        full_keys: the per-element state keys of the layer (every group's of the layer).
    """

    def __init__(
        self,
        master: torch.Tensor,
        segments: Sequence[Segment],
        groups: Sequence[ResolvedGroup],
        full_keys: tuple[str, ...],
    ) -> None:
        self._master = master
        self._segments = tuple(segments)
        self._groups = groups
        self.full_keys = full_keys
        self.state: dict[str, torch.Tensor] = {}  # the layer's state (see the note)
        self._parts: list[tuple[ResolvedGroup, Any, list[tuple[torch.Tensor, Segment]]]] = []
        self._build()

    def _build(self) -> None:
        """One torch optimizer per group of the segments, over persistent 1-D tensors."""
        by_group: dict[int, list[Segment]] = {}
        for seg in self._segments:
            by_group.setdefault(seg.group, []).append(seg)
        self._parts = []
        for index, segs in by_group.items():
            group = self._groups[index]
            tensors = [
                (self._master.new_empty(seg.end - seg.start), seg) for seg in segs
            ]  # allocated for the constructor's checks, then pointed at nothing
            opt = group.kind.make([{"params": [t for t, _ in tensors], **group.overrides}])
            for t, _ in tensors:
                t.set_(self._master.new_empty(0))
            self._parts.append((group, opt, tensors))

    def step(self, grad: torch.Tensor, lr: float) -> None:
        """Update the segments of the master in place with ``grad`` (the shard's gradient)."""
        master = self._master
        try:
            for group, opt, tensors in self._parts:
                for t, seg in tensors:
                    t.set_(master[seg.start : seg.end])
                    t.grad = grad[seg.start : seg.end]
                    self._bind(group, opt.state[t], seg)
                opt.param_groups[0]["lr"] = lr * group.lr_scale
                opt.step()
            self._collect()
        finally:
            for _, opt, tensors in self._parts:
                for t, _ in tensors:
                    t.grad = None
                    t.set_(master.new_empty(0))
                    state = opt.state[t]
                    for key in (*self.full_keys, *self._scalar_keys()):
                        state.pop(key, None)

    def _scalar_keys(self) -> list[str]:
        return [k for g, _, _ in self._parts for k in g.kind.scalar_keys]

    def _bind(self, group: ResolvedGroup, state: dict[str, Any], seg: Segment) -> None:
        for key in group.kind.full_keys:
            if key in self.state:
                state[key] = self.state[key][seg.start : seg.end]
        for key in group.kind.scalar_keys:
            if key in self.state:
                state[key] = self.state[key].clone()

    def _collect(self) -> None:
        """The segments' state into the layer's tensors (see the note)."""
        shard = self._master.numel()
        scalars: dict[str, torch.Tensor] = {}
        for group, opt, tensors in self._parts:
            for t, seg in tensors:
                state = opt.state[t]
                for key in group.kind.full_keys:
                    value = state.get(key)
                    if value is None:
                        continue
                    full = self.state.get(key)
                    if full is None:
                        full = self.state[key] = value.new_zeros(shard)
                    view = full[seg.start : seg.end]
                    if value.data_ptr() != view.data_ptr():
                        view.copy_(value.view(-1))
                for key in group.kind.scalar_keys:
                    value = state.get(key)
                    if value is None:
                        continue
                    if key in scalars and not torch.equal(scalars[key], value):
                        raise StateError(
                            f"the scalar state {key!r} differs between the parameter groups "
                            f"of one layer ({group.kind.label}): give them the same options"
                        )
                    scalars.setdefault(key, value)
        for key, value in scalars.items():
            held = self.state.get(key)
            if held is None:
                self.state[key] = value.clone()
            else:
                held.copy_(value)
        for key in self.full_keys:  # every rank keeps every key of the layer
            if key not in self.state:
                self.state[key] = self._master.new_zeros(shard)

    def nbytes(self, counted: Any) -> int:
        """Bytes of the state tensors ``counted(tensor)`` accepts: the layer's and what
        the segments hold between steps (an optimizer's state made at construction)."""
        total = sum(tensor_bytes(v) for v in self.state.values() if counted(v))
        for _, opt, _ in self._parts:
            for state in opt.state.values():
                total += sum(tensor_bytes(v) for v in state.values() if torch.is_tensor(v))
        return total

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the layer's state with ``state`` (copies on the master's device, of the
        keys this rank's segments keep), in place; an empty ``state`` is a fresh start
        (the optimizers are made again, with what their constructors put in the state)."""
        self.state.clear()
        device = self._master.device
        # The keys this rank's segments keep (a checkpoint's scalars come from any rank).
        kept = {*self.full_keys, *self._scalar_keys()}
        self.state.update({k: v.to(device).clone() for k, v in state.items() if k in kept})
        if not state:
            self._build()
