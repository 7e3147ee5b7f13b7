"""A causal LM's cross-entropy computed in chunks of tokens: no full logits tensor is ever held.

[Note: tiled loss]
At long sequences a causal LM's logits (tokens x vocabulary, in fp32 for the loss) are
the largest tensors of a step, and the loss holds about three of them (the logits, their
log-softmax, their gradient). :func:`tiled_causal_lm_loss` computes the same loss as
transformers' ``ForCausalLMLoss`` over the head's output, chunk by chunk: each chunk of
``chunk_tokens`` positions goes through the head, the logit transform (if any), the fp32
upcast and a summed cross-entropy, and only the running sum is kept. Its autograd
function saves the hidden states, the targets and the head's tensors, never a chunk's
logits; its backward recomputes each chunk's logits with autograd on and takes the
gradient of that chunk's loss with respect to the chunk's hidden states and the head's
trainable parameters. The parameters are inputs of the function, so autograd accumulates
each parameter's gradient once, summed over the chunks (a ZeRO-3 unit's gradient hook
sees one gradient). Saving the head's tensors also makes module mode gather a sharded
head again before the backward recomputes with it (see ``_pack``/``_unpack`` in
``execution.module_runner``).

The gradient in the forward: when no tensor of the head needs a gradient (a frozen head:
LoRA, frozen layers), the forward takes each chunk's gradient with respect to its hidden
states right away, for an upstream gradient of 1, from the logits it has just computed,
and saves the hidden states' gradient (their size) instead of recomputing the logits in
the backward: the head's product runs twice per step, not three times. The backward
hands it over when the loss's upstream gradient is 1, and multiplied by it when it is
another power of two (a loss scale), which scales every step of the gradient's
computation without rounding; any other upstream gradient recomputes the chunks as
above, from the module's parameters or the weight given. The values are those of the
recomputation either way.

A head given as a module is applied through its ``forward`` method, not its ``__call__``:
its hooks do not run (under ``manager.forward`` a sharded head is read inside
``manager.gathered(head)``). Random ops in a module head (a LoRA dropout) see the same
random numbers in the backward's recomputation as in the forward (the generator's state
is saved and restored).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zero3_offload.errors import InputError

__all__ = ["tiled_causal_lm_loss"]

LogitTransform = Callable[[torch.Tensor], torch.Tensor]


def tiled_causal_lm_loss(
    hidden_states: torch.Tensor,
    head: torch.Tensor | nn.Module,
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    chunk_tokens: int = 1024,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    reduction: str = "mean",
    logit_transform: LogitTransform | None = None,
    head_forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    gather: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> torch.Tensor:
    """The causal-LM cross-entropy of ``head(hidden_states)``, without full logits.

    Equal (to fp32 reassociation) to transformers' ``ForCausalLMLoss`` applied to
    ``logit_transform(head(hidden_states))``; see [Note: tiled loss].

    Args:
        hidden_states: ``(..., tokens, hidden)`` inputs of the head (the last hidden states).
        head: the output embedding's weight ``(vocab, hidden)`` (logits are
            ``hidden_states @ weight.T``), or a position-wise module (an ``nn.Linear``, a
            peft LoRA-wrapped head), applied through its ``forward``.
        labels: ``(..., tokens)`` token ids, not shifted: position ``i`` is scored against
            ``labels[..., i + 1]`` and the last position against nothing.
        shift_labels: instead of ``labels``, targets already aligned with the hidden
            positions (``shift_labels[..., i]`` scores position ``i``).
        chunk_tokens: positions per chunk (> 0); the last chunk may be shorter.
        ignore_index: targets with this value count neither in the sum nor in the mean.
        num_items_in_batch: when given, the loss is the sum of the per-token losses
            divided by it (transformers' ``num_items_in_batch``); else their mean over the
            targets other than ``ignore_index`` (NaN when there is none).
        reduction: ``"mean"`` (above) or ``"sum"``: the summed per-token losses (without
            ``num_items_in_batch``).
        logit_transform: applied to each chunk's logits before the fp32 cross-entropy
            (e.g. Gemma 2's soft-capping); it must work position by position.
        head_forward: applies the head to a chunk in place of ``head.forward`` (a module
            ``head`` only; its parameters are still the ones differentiated).
        gather: makes the context the chunks run in, in the forward and again in the
            backward's recomputation, e.g. ``lambda: manager.gathered(head)`` for a head
            sharded by ZeRO-3 (the backward runs outside the caller's own block).

    Returns:
        The scalar fp32 loss, with autograd history to ``hidden_states`` and the head's
        trainable parameters.

    Raises:
        InputError: for targets whose shape does not match ``hidden_states``, both or
            neither of ``labels`` and ``shift_labels``, or ``chunk_tokens`` < 1.
    """
    targets = _targets(hidden_states, labels, shift_labels, ignore_index)
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InputError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if reduction not in ("mean", "sum") or (reduction == "sum" and num_items_in_batch is not None):
        raise InputError(
            f"reduction must be 'mean' or 'sum' (sum without num_items_in_batch), got {reduction!r}"
        )
    if isinstance(head, nn.Module):
        tensors = tuple(head.parameters())
        apply = head_forward if head_forward is not None else head.forward
        project = _ModuleHead(apply, tensors, hidden_states.device)
    elif isinstance(head, torch.Tensor):
        if head_forward is not None:
            raise InputError("head_forward applies to a module head, not to a weight tensor")
        if head.dim() != 2 or head.shape[-1] != hidden_states.shape[-1]:
            raise InputError(
                f"the head weight must be (vocab, {hidden_states.shape[-1]}), "
                f"got shape {tuple(head.shape)}"
            )
        tensors = (head,)
        project = _WeightHead()
    else:
        raise InputError(f"head must be a weight tensor or an nn.Module, got {type(head).__name__}")
    spec = _Spec(
        project=project,
        transform=logit_transform,
        chunk=chunk_tokens,
        ignore_index=ignore_index,
        num_items=num_items_in_batch,
        summed=reduction == "sum",
        gather=gather or contextlib.nullcontext,
    )
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    loss: torch.Tensor = _TiledLoss.apply(flat, targets.reshape(-1), spec, *tensors)
    return loss


def _targets(
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    ignore_index: int,
) -> torch.Tensor:
    """The target of every hidden position (``ignore_index`` where there is none)."""
    if (labels is None) == (shift_labels is None):
        raise InputError("give either labels (not shifted) or shift_labels (aligned), not both")
    given = labels if labels is not None else shift_labels
    assert given is not None
    if tuple(given.shape) != tuple(hidden.shape[:-1]):
        raise InputError(
            f"labels of shape {tuple(given.shape)} do not match hidden states of shape "
            f"{tuple(hidden.shape)} (expected {tuple(hidden.shape[:-1])})"
        )
    if shift_labels is not None:
        return shift_labels.to(hidden.device)
    padded = F.pad(given, (0, 1), value=ignore_index)
    return padded[..., 1:].to(hidden.device)


class _WeightHead:
    """Logits as ``hidden @ weight.T``; the weight is the function's one tensor."""

    def logits(self, h: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return F.linear(h, tensors[0])

    def fork(self) -> contextlib.AbstractContextManager[Any]:
        """The random state of the recomputation: nothing to restore."""
        return contextlib.nullcontext()

    def wrt(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The leaves the recomputation differentiates (a detached weight)."""
        return [tensors[0].detach().requires_grad_(tensors[0].requires_grad)]

    def recompute(self, h: torch.Tensor, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
        return F.linear(h, leaves[0])


class _ModuleHead:
    """Logits from a module's ``forward``; its parameters are the function's tensors."""

    def __init__(
        self,
        apply: Callable[[torch.Tensor], torch.Tensor],
        params: Sequence[torch.Tensor],
        device: torch.device,
    ) -> None:
        self._apply = apply
        self._params = list(params)
        self._rng = _RngState.now(device)

    def logits(self, h: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._apply(h)

    def fork(self) -> contextlib.AbstractContextManager[Any]:
        """The random state of the recomputation: the forward's (restored, then put back)."""
        return self._rng.restored()

    def wrt(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The module's own parameters, which its ``forward`` reads (``tensors``, unpacked,
        are their values; ``torch.autograd.grad`` leaves their ``.grad`` alone)."""
        return self._params

    def recompute(self, h: torch.Tensor, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._apply(h)


class _RngState:
    """The random generators' state when the forward started, restored for the backward."""

    def __init__(self, device: torch.device, cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
        self._device = device
        self._cpu = cpu
        self._cuda = cuda

    @classmethod
    def now(cls, device: torch.device) -> _RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(device, torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the block with this state; the generators' own state is back after it."""
        devices = [self._device] if self._cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self._cpu)
            if self._cuda is not None:
                torch.cuda.set_rng_state(self._cuda, self._device)
            yield


class _Spec:
    """What the autograd function needs besides its tensors."""

    def __init__(
        self,
        *,
        project: _WeightHead | _ModuleHead,
        transform: LogitTransform | None,
        chunk: int,
        ignore_index: int,
        num_items: int | torch.Tensor | None,
        summed: bool,
        gather: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self.summed = summed
        self.gather = gather
        self.project = project
        self.transform = transform
        self.chunk = chunk
        self.ignore_index = ignore_index
        self.num_items = num_items

    def chunk_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of one chunk's logits (transformed, then fp32)."""
        if self.transform is not None:
            logits = self.transform(logits)
        return F.cross_entropy(
            logits.float(), targets, ignore_index=self.ignore_index, reduction="sum"
        )

    def divide(self, total: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The sum over the mean's count, or over ``num_items_in_batch`` (or the sum)."""
        if self.summed:
            return total
        if self.num_items is None:
            return total / (targets != self.ignore_index).sum()
        num = self.num_items
        if isinstance(num, torch.Tensor):
            num = num.to(total.device)
        return total / num


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        spec: _Spec,
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        ctx.spec = spec
        ctx.head = tensors
        ctx.eager = False
        # A frozen head: the hidden states' gradient is taken here, for an upstream
        # gradient of 1 (see [Note: tiled loss], the gradient in the forward).
        if ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[3:]):
            loss, grad_hidden = _loss_and_gradient(hidden, targets, spec, tensors)
            ctx.save_for_backward(hidden, targets, grad_hidden)
            ctx.eager = True
            return loss
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with spec.gather():
            for start in range(0, hidden.shape[0], spec.chunk):
                logits = spec.project.logits(hidden[start : start + spec.chunk], tensors)
                total = total + spec.chunk_sum(logits, targets[start : start + spec.chunk])
                del logits  # one chunk's logits at a time
        ctx.save_for_backward(hidden, targets, *tensors)
        return spec.divide(total, targets)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        spec: _Spec = ctx.spec
        # Unpacking the head's tensors gathers a sharded head again (module mode).
        hidden, targets, *tensors = ctx.saved_tensors
        if ctx.eager:  # the hidden states' gradient, taken in forward
            scaled = _scaled(tensors[0], grad)
            if scaled is not None:
                return (scaled, None, None, *(None for _ in ctx.head))
            tensors = list(ctx.head)  # recomputed below with this upstream gradient
        needs_hidden = ctx.needs_input_grad[0]
        needs = list(ctx.needs_input_grad[3:])
        # d loss / d chunk sum: the gradient over the divisor (the mean's count or
        # num_items_in_batch), as the forward divided.
        scale = spec.divide(grad.float(), targets)
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        sums: list[torch.Tensor | None] = [None] * len(tensors)
        with torch.enable_grad(), spec.project.fork(), spec.gather():
            leaves = spec.project.wrt(tensors)
            for start in range(0, hidden.shape[0], spec.chunk):
                h = hidden[start : start + spec.chunk].detach().requires_grad_(needs_hidden)
                part = spec.chunk_sum(
                    spec.project.recompute(h, leaves), targets[start : start + spec.chunk]
                )
                inputs = [h] if needs_hidden else []
                inputs += [leaf for leaf, need in zip(leaves, needs, strict=True) if need]
                if not inputs:
                    continue
                found = torch.autograd.grad(part, inputs, grad_outputs=scale)
                at = 0
                if needs_hidden:
                    assert grad_hidden is not None
                    grad_hidden[start : start + spec.chunk] = found[0]
                    at = 1
                for i, need in enumerate(needs):
                    if need:
                        g = found[at].float()
                        sums[i] = g if sums[i] is None else sums[i] + g
                        at += 1
        out = [s.to(t.dtype) if s is not None else None for s, t in zip(sums, tensors, strict=True)]
        return (grad_hidden, None, None, *out)


def _loss_and_gradient(
    hidden: torch.Tensor, targets: torch.Tensor, spec: _Spec, tensors: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and its gradient with respect to ``hidden`` for an upstream gradient of 1,
    chunk by chunk: each chunk's logits are computed once, for both."""
    one = torch.ones((), dtype=torch.float32, device=hidden.device)
    scale = spec.divide(one, targets)  # what backward's scale is for a gradient of 1
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden)
    # The chunk's graph lives and dies here: its saved tensors skip the caller's hooks.
    with spec.gather(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
        for start in range(0, hidden.shape[0], spec.chunk):
            end = start + spec.chunk
            h = hidden[start:end].detach().requires_grad_()
            logits = spec.project.logits(h, tensors)
            if spec.transform is None:
                logits = logits.float()
                part, grad = _cross_entropy_into(logits, targets[start:end], spec, scale)
                (grad_hidden[start:end],) = torch.autograd.grad(logits, [h], grad_outputs=grad)
                del grad
            else:
                part = spec.chunk_sum(logits, targets[start:end])
                (grad_hidden[start:end],) = torch.autograd.grad(part, [h], grad_outputs=scale)
            total = total + part.detach()
            del logits
    return spec.divide(total, targets), grad_hidden


def _cross_entropy_into(
    logits: torch.Tensor, targets: torch.Tensor, spec: _Spec, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's summed cross-entropy and its gradient with respect to ``logits`` (fp32,
    ``[tokens, vocabulary]``) times ``scale``, the gradient written over the logits: the
    operations autograd runs for ``F.cross_entropy`` (log-softmax, then the negative
    log-likelihood, and their backward), so bitwise its values, with two chunks' worth of
    memory, not three. Nothing saved the logits (the head's product saves its inputs)."""
    with torch.no_grad():
        out = logits.detach()
        log_probs = torch.log_softmax(out, -1)
        part = F.nll_loss(log_probs, targets, ignore_index=spec.ignore_index, reduction="sum")
        unused = torch.zeros((), dtype=torch.float32, device=out.device)  # the mean's weight
        torch.ops.aten.nll_loss_backward.grad_input(
            scale, log_probs, targets, None, _SUM, spec.ignore_index, unused, grad_input=out
        )
        torch.ops.aten._log_softmax_backward_data.out(out, log_probs, -1, torch.float32, out=out)
    return part, out


_SUM = 2  # torch's reduction enum: none, mean, sum


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _scaled(grad_hidden: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """``grad_hidden`` (taken for an upstream gradient of 1) for the upstream gradient
    ``grad``, when that is exact: ``grad`` a power of two (1, a loss scale), by which every
    step of the gradient's computation scales without rounding; else None."""
    mantissa, _ = torch.frexp(grad.float())
    if not bool(torch.isfinite(grad)) or float(mantissa.abs()) != 0.5:
        return None
    return grad_hidden if float(grad) == 1.0 else grad_hidden * grad.to(grad_hidden.dtype)
