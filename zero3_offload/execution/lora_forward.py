"""A peft LoRA ``Linear``'s forward that runs the adapter's branch before the frozen base.

[Note: adapter branch first]
peft's LoRA ``Linear`` computes ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``,
the frozen base's product first. Module mode replaces that ``forward`` on each such
instance (whose base weight is frozen) with :class:`LoraLinearForward`, which computes
the same sum with the adapter's branch first and the base's product last. The outputs
are bitwise peft's: the same operations on the same operands (the base product draws no
random numbers, so dropout's masks do not move), and an IEEE sum does not depend on the
order of its two terms. Gradients equal peft's up to fp32 reassociation: autograd adds
the contributions to an input that several layers read (a decoder layer's normed hidden
states feed q, k and v) in the order their nodes run, and the base's node now runs
before its branch's. Two things change:

* **Recomputation stops before the last base product.** A checkpointed unit's
  recomputation (torch's non-reentrant checkpoint) stops as soon as it has rebuilt the
  last tensor the unit saved for backward. In a transformers decoder layer with
  adapters on every projection that last tensor is the MLP down-projection adapter's
  input to ``lora_B``; the down-projection's base product, whose output only feeds the
  residual sum, now comes after it and is never recomputed. With a 1024-wide, 20-layer
  Llama at 256 tokens per rank, that is 17.5 ms of a 72 ms layer recomputation (the
  down-projection contracts the 2816-wide MLP).
* **Two fewer new tensors.** The branch's output is scaled and summed in place
  (``mul_``, ``add_``), where peft allocates one tensor for the scaled branch and one for
  the sum. Tensors of 1 MiB or more are new memory, faulted in, under ``train``'s
  allocator setting: 2.8 ms of a 22.7 ms 2816-wide projection of 256 tokens here.
  Nothing else holds the branch's output: ``lora_B``'s backward saves its input, not its
  output, and selective checkpointing does not cache a low-rank product (see
  [Note: saved products] in ``execution.product_saving``). Where one of those does not
  hold (a rank so high that the product is cached, another dtype, a view), the sum is
  computed as peft computes it.

Anything but one plain adapter (adapters disabled or merged, several active, a variant
such as DoRA, ``adapter_names``, extra arguments) runs peft's own ``forward``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zero3_offload.execution.product_saving import LOW_RANK

__all__ = ["LoraLinearForward"]

_PEFT_LORA = "peft.tuners.lora"  # the package of peft's LoRA layers


class LoraLinearForward:
    """``module.forward`` of a peft LoRA ``Linear``: the adapter's branch, then the base
    (see [Note: adapter branch first]).

    Args:
        module: the LoRA layer (``base_layer``, ``lora_A``, ``lora_B``, ``scaling``, ...).
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._peft = module.forward  # peft's own, for everything but one plain adapter

    @classmethod
    def install(cls, model: nn.Module) -> int:
        """Replace the ``forward`` of every peft LoRA ``Linear`` in ``model`` whose base
        weight is frozen; returns how many."""
        count = 0
        for module in model.modules():
            kind = type(module)
            if kind.__name__ != "Linear" or not kind.__module__.startswith(_PEFT_LORA):
                continue
            weight = getattr(getattr(module, "base_layer", None), "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.requires_grad:
                continue
            if isinstance(module.__dict__.get("forward"), cls):
                continue  # installed already
            module.forward = cls(module)
            count += 1
        return count

    def _adapter(self) -> str | None:
        """The one plain adapter this layer runs, or None where peft's forward must run."""
        m = self._module
        if m.disable_adapters or m.merged:
            return None
        active = [a for a in m.active_adapters if a in m.lora_A]
        if len(active) != 1:
            return None
        (adapter,) = active
        if adapter in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(adapter):
            return None
        return adapter

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = None if args or kwargs else self._adapter()
        if adapter is None:
            return self._peft(x, *args, **kwargs)
        m = self._module
        m._check_forward_args(x)
        lora_a, lora_b = m.lora_A[adapter], m.lora_B[adapter]
        scaling = m.scaling[adapter]
        dropped = m.lora_dropout[adapter](m._cast_input_dtype(x, lora_a.weight.dtype))
        branch = lora_b(lora_a(dropped))
        result = m.base_layer(x)
        rank, features = lora_b.weight.shape[1], lora_b.weight.shape[0]
        if (
            branch.dtype == result.dtype
            and branch.shape == result.shape
            and not branch._is_view()
            and rank * LOW_RANK < features  # not cached by selective checkpointing
        ):
            return branch.mul_(scaling).add_(result)
        return (result + branch * scaling).to(result.dtype)
