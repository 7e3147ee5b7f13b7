"""The conductor (the Rust module's ``mod.rs``): orders gathers, compute, reduce-scatters and
updates.

:class:`Zero3CpuOffloadManager` holds an :class:`~zero3_offload.engine.engine.Engine`
(every component, wired once by ``build_engine``) and a
:class:`~zero3_offload.engine.step_state.StepState` (the pending forward and the
early updates). Each public method checks that the manager is open, then orders
components; the algorithms live in them: the passes in ``execution``
(``ChainRunner``, ``ModuleRunner``), layouts and shards in ``parameter``,
gradients in ``gradient``, the step math in ``optimizer_state``, look-ahead in
``prefetch``, bytes and the pressure policy in ``memory``, figures, logs and the
step counts in ``stats``, checkpoints and full values in ``checkpoint``. See
[Note: saved activations] in ``execution.layer_runner`` and [Note: optimizer
update during backward] in ``optimizer_state.step_runner``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from zero3_offload.comm.failure_report import first_line
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.engine.call_recovery import CallRecovery
from zero3_offload.engine.engine import Engine, build_engine
from zero3_offload.engine.model_units import UnitSpec
from zero3_offload.engine.step_state import StepState
from zero3_offload.errors import ConfigError, StateError, StepAbandonedError, Zero3Error
from zero3_offload.execution.arguments import check_lr, check_step_call, check_tokens
from zero3_offload.execution.chain_runner import ChainRunner, forward_phase
from zero3_offload.execution.module_runner import ModuleRunner
from zero3_offload.logging import get_logger
from zero3_offload.memory.budget_chooser import BudgetChooser
from zero3_offload.memory.memory_stats import Zero3MemoryStats
from zero3_offload.optimizer_state.optimizer_plan import ParamGroup
from zero3_offload.parameter.flat_layout import owned_numel, total_numel
from zero3_offload.parameter.meta_init import InitFn, ShardSource, reset_parameters_in_order
from zero3_offload.prefetch.status import PrefetchQueueStatus
from zero3_offload.stats.disk_io import disk_transfers
from zero3_offload.stats.layer_seconds import layer_seconds
from zero3_offload.stats.performance import Zero3PerformanceStats

__all__ = ["Zero3CpuOffloadManager"]

log = get_logger(__name__)

_Method = TypeVar("_Method", bound=Callable[..., Awaitable[Any]])


def _flushed(method: _Method) -> _Method:
    """Return from ``method`` only once every collective it queued has been launched.

    The caller may call torch.distributed on the group itself next; see the
    launcher in ``comm.collectives``. While ``method`` runs, the group's
    collectives carry a description of the call, which the ranks compare
    before each collective (see [Note: divergence check]). When it fails, on
    this rank or another, every rank abandons it before the error is raised
    (see [Note: abandoned calls] in ``engine.call_recovery``).
    """

    @functools.wraps(method)
    async def wrapper(manager: Zero3CpuOffloadManager, *args: Any, **kwargs: Any) -> Any:
        comm, recovery = manager.engine.comm, manager._recovery
        call = manager._describe_call(method.__name__, args, kwargs)
        with comm.call_context(call):
            start = recovery.note(method.__name__)
            try:
                recovery.start()
                return await method(manager, *args, **kwargs)
            except Exception as exc:
                if recovery.refused is None:
                    await recovery.after_failure(exc, call, start)
                raise
            finally:
                await comm.flush()

    return wrapper  # type: ignore[return-value]


class Zero3CpuOffloadManager:
    """Trains a model with ZeRO stage 3 across the ranks of a process group.

    Every rank builds the manager with the same model; rank 0's initial values
    are broadcast, then each rank keeps only its shard of every layer.

    Args:
        config: the configuration (validated again here).
        process_group: the group whose ranks share the model (e.g. from
            :func:`init_process_group`).
        model: an ``nn.Module`` whose named children are the layers, or a
            mapping of layer name to module. It may be built on the meta
            device: layers are then materialised one at a time (see
            [Note: meta initialisation] in ``parameter.meta_init``).
        init_fn: ``init_fn(layer_name, module)`` initialises a materialised
            meta layer in place; the default calls ``reset_parameters()`` of
            its submodules in registration order (module mode: of each module
            owning parameters, called with its path).
        units: module mode (see [Note: module mode] in
            ``execution.module_runner``): submodule names or ``nn.Module``
            classes whose instances are sharded and gathered as units; every
            other parameter forms the root unit. Without it a transformers
            model takes the classes in its ``_no_split_modules``, and any
            other model is a chain of its children (``forward_pass``).
        shard_source: ``source(layer, layout)`` returns this rank's fp32
            shard of each layer (e.g. read from pretrained weight files, as
            :meth:`from_pretrained` does) instead of broadcasting rank 0's values.
        param_groups: torch's parameter groups, ``[{"params": [...], option: value,
            ...}]``: parameters or their ``named_parameters()`` names, options over
            the config's optimizer's, ``"lr_scale"`` (the group's learning rate is
            ``learning_rate * lr_scale``) and ``"optimizer"`` (the group's own, e.g.
            ``"torch.optim.Muon"``). Parameters in no group keep the config's. See
            [Note: parameter groups] in ``optimizer_state.optimizer_plan``.

    Raises:
        ConfigError: when the config cannot run here (e.g. CUDA asked but absent),
            or a parameter group is invalid or names an optimizer that cannot run
            on shards (the message says why).
        InputError: when the model cannot be partitioned, or a parameter group names
            something that is not a parameter of the model, or a parameter twice.
        MemoryBudgetError: when the shards or a layer do not fit their budget.
        CommunicationError: when the initial broadcast fails.
    """

    def __init__(
        self,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        model: nn.Module | Mapping[str, nn.Module],
        *,
        init_fn: InitFn = reset_parameters_in_order,
        units: Sequence[UnitSpec] | None = None,
        shard_source: ShardSource | None = None,
        param_groups: Sequence[ParamGroup] | None = None,
    ) -> None:
        self._engine = build_engine(
            config,
            process_group,
            model,
            init_fn=init_fn,
            units=units,
            shard_source=shard_source,
            param_groups=param_groups,
        )
        self._state = StepState()
        self._closed = False
        engine = self._engine
        self._recovery = CallRecovery.of(engine, self._state)
        log.info(
            "manager_ready",
            rank=engine.mapping.rank,
            world_size=engine.mapping.world_size,
            pid=os.getpid(),
            layers=len(engine.layers),
            parameters=total_numel(engine.layouts),
            trainable_parameters=total_numel(engine.layouts, frozen=False),
            owned_parameters=owned_numel(engine.layouts),
        )

    @classmethod
    def from_meta(
        cls,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        model: nn.Module | Mapping[str, nn.Module],
        *,
        seed: int | None = None,
        init_fn: InitFn = reset_parameters_in_order,
        param_groups: Sequence[ParamGroup] | None = None,
    ) -> Zero3CpuOffloadManager:
        """Build the manager from a model constructed on the meta device.

        No rank ever holds the full model: each layer is materialised,
        initialised, sharded and freed before the next. With ``seed`` (the seed
        the model would have been built with eagerly) and the default
        ``init_fn``, the values equal eager construction's.

        Example::

            with torch.device("meta"):
                model = GPT(config)
            manager = Zero3CpuOffloadManager.from_meta(cfg, pg, model, seed=0)
        """
        if seed is not None:
            torch.manual_seed(seed)
        return cls(config, process_group, model, init_fn=init_fn, param_groups=param_groups)

    @classmethod
    def from_pretrained(
        cls,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        path: str | os.PathLike[str],
        *,
        units: Sequence[UnitSpec] | None = None,
        param_groups: Sequence[ParamGroup] | None = None,
        peft_config: Any = None,
        seed: int = 0,
        memory_per_rank: BudgetChooser | None = None,
    ) -> Zero3CpuOffloadManager:
        """Build a module-mode manager from a local transformers model directory.

        The model is built from ``config.json`` with its parameters on the meta
        device; each rank then reads from the safetensors files
        (``model.safetensors`` or a sharded index) only the slices of its own
        shards, so no rank holds a full copy of the weights. Needs
        transformers (``pip install 'zero3_offload[hf]'``).

        Args:
            config: the configuration.
            process_group: the group whose ranks share the model.
            path: the model directory.
            units: as for the constructor (default: the model's ``_no_split_modules``).
            param_groups: as for the constructor; give parameter names (the model is
                built here).
            peft_config: a peft config (e.g. ``LoraConfig``): the model is that peft model
                over the loaded base, whose frozen weights each rank reads by slices
                (see [Note: peft from pretrained]).
            seed: the seed the adapters are initialised from (with ``peft_config``;
                ``zero3_offload.integrations.peft_pretrained.reset_adapters`` gives
                the same values to a plain peft model).
            memory_per_rank: ``zero3_offload.plan.MemoryBudget(size, batch_shape)``: the
                memory options of ``config`` are replaced by the planner's fastest choice
                whose peak leaves 5% of ``size`` per rank free for that micro-batch, as
                ``zero3-offload train --memory-per-rank`` does (a collective: rank 0
                plans, every rank trains its choice, logged as ``memory_per_rank_chosen``).

        Returns:
            The manager; ``manager.model`` is the transformers (or peft) model.

        Raises:
            ConfigError: when transformers is missing or cannot build the config; with
                ``memory_per_rank``, when no configuration fits (the message names the
                smallest peak and what holds it).
            CheckpointError: for a missing or hostile directory, or weights that do
                not match the config.
        """
        from zero3_offload.integrations.peft_pretrained import PeftPretrainedShards
        from zero3_offload.integrations.pretrained_load import PretrainedShards

        if memory_per_rank is not None:
            if not isinstance(memory_per_rank, BudgetChooser):
                raise ConfigError(
                    f"memory_per_rank={memory_per_rank!r}: give "
                    "zero3_offload.plan.MemoryBudget(size, batch_shape=(sequences, tokens)), "
                    "the budget and the micro-batch the plan is for"
                )
            config = memory_per_rank.choose(config, process_group, path, peft_config)
        opened = (
            PretrainedShards(path)
            if peft_config is None
            else PeftPretrainedShards(path, peft_config, seed=seed)
        )
        with opened as pretrained:
            manager = cls(
                config,
                process_group,
                pretrained.model,
                units=units,
                shard_source=pretrained.shard,
                param_groups=param_groups,
            )
        read = pretrained.bytes_read
        log.info("pretrained_loaded", rank=manager.rank, path=str(path), bytes_read=read)
        return manager

    # -------------------------------------------------------------- accessors

    @property
    def config(self) -> Zero3CpuOffloadConfig:
        """The configuration the manager runs with."""
        return self._engine.config

    @property
    def engine(self) -> Engine:
        """The wired components, for inspection (tests, benchmarks, debugging).

        Calling their methods directly bypasses the manager's ordering and checks.
        """
        return self._engine

    @property
    def model(self) -> nn.Module | None:
        """The whole model in module mode (its parameters hold storage only while
        gathered); None for a chain of layers."""
        runner = self._engine.model_runner
        return None if runner is None else runner.model

    @property
    def device(self) -> torch.device:
        """The compute device."""
        return self._engine.device

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._engine.mapping.rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._engine.mapping.world_size

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The model's layers, in order."""
        return tuple(self._engine.layers)

    @property
    def steps_completed(self) -> int:
        """Optimizer steps completed (steps skipped for inf/nan included); restored by
        :meth:`load_checkpoint`."""
        return self._engine.counter.steps

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None unless ``compute_dtype`` is float16)."""
        scaler = self._engine.steps.loss_scaler
        return None if scaler is None else scaler.scale

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm before clipping at the last closed step (clipping on only;
        inf or nan when ``skip_nonfinite_steps`` skipped that step)."""
        return self._engine.steps.last_grad_norm

    def _describe_call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """``name`` and the arguments that must agree on every rank (tensors' values and
        shapes need not: each rank has its own batch), with the step and micro-step."""

        def show(value: Any) -> str:
            if isinstance(value, torch.Tensor):
                return "tensor"
            if isinstance(value, (list, tuple)):
                return "[" + ", ".join(show(v) for v in value) + "]"
            if isinstance(value, os.PathLike):
                return repr(os.fspath(value))
            if value is None or isinstance(value, (str, int, float, bool, torch.dtype)):
                return repr(value)
            return type(value).__name__

        def show_keyword(key: str, value: Any) -> str:
            # A backward's tokens= are each rank's own count: only whether it is given must
            # agree. A forward's integers describe each rank's own batch (a packed batch's
            # max_length_q, say): only their presence must agree; flags must agree.
            if key == "tokens" or (
                name == "forward" and isinstance(value, int) and not isinstance(value, bool)
            ):
                return f"{key}=given"
            return f"{key}={show(value)}"

        shown = [show(a) for a in args] + [
            show_keyword(k, v) for k, v in kwargs.items() if not (k == "tokens" and v is None)
        ]
        grad = "" if torch.is_grad_enabled() else " under no_grad"
        return (
            f"{name}({', '.join(shown)}){grad} at step {self._engine.counter.steps}, "
            f"micro-step {self._engine.counter.window_calls}"
        )

    def _check_tokens(self, tokens: object) -> int | None:
        """A backward's ``tokens`` as an int, checked against the open window's backwards."""
        grads = self._engine.grads
        return check_tokens(tokens, micro_steps=grads.micro_steps, weighted=grads.weighted)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the manager is closed; build a new one")

    # ----------------------------------------------------------------- passes

    def _chain_runner(self, call: str) -> ChainRunner:
        self._check_open()
        runner = self._engine.chain_runner
        if runner is None:
            raise StateError(
                f"{call} runs a chain of layers, but this manager runs the model's own code "
                "(module mode): use `await manager.forward(...)` and `await manager.backward(loss)`"
            )
        return runner

    def _module_runner(self, call: str) -> ModuleRunner:
        self._check_open()
        runner = self._engine.model_runner
        if runner is None:
            raise StateError(
                f"{call}() runs a whole model's own forward and needs module mode: build the "
                "manager with units=[...] (transformers models choose theirs); this manager "
                "trains a chain of layers with forward_pass/backward_pass"
            )
        return runner

    @_flushed
    async def forward_pass(self, x: torch.Tensor, layer_names: Sequence[str]) -> torch.Tensor:
        """Run ``layer_names`` in order on ``x``; save what backward needs.

        Under ``torch.no_grad()`` (evaluation) nothing is saved: no graph, no
        inputs, and no backward may follow; the accumulation window's timer does
        not start either, so the next ``step`` event's seconds leave it out.

        Args:
            x: input of the first layer (moved to the device; floating inputs
                are cast to the compute dtype).
            layer_names: the layers to run, in order.

        Returns:
            The last layer's output (no autograd history; see backward_pass).

        Raises:
            LayerNotFoundError: for a name that is not a layer.
            InputError: when ``x`` is not a tensor, or on the meta device (nothing
                changed).
            LayerExecutionError: when a layer raises; nothing stays gathered or in
                flight, and the pending forward is the one before.
            CommunicationError: when a gather fails.
        """
        runner = self._chain_runner("forward_pass")
        names = runner.check_forward(x, layer_names)
        out, result = await runner.forward(x, names)
        self._state.pend(result if result.phase.trains else None)
        return out

    @_flushed
    async def backward_pass(
        self,
        grad_output: torch.Tensor,
        layer_names: Sequence[str],
        *,
        learning_rate: float | None = None,
        tokens: int | torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Backpropagate ``grad_output`` through ``layer_names`` in reverse.

        Each layer's parameter gradient is reduce-scattered (mean over ranks) so
        this rank keeps the shard it owns; the reduce-scatter of one layer
        overlaps the compute of the next. Gradients are committed only when the
        whole pass succeeded, unless updates started early (below). The forward
        is used up whatever happens: after a failure, run a new forward.

        Args:
            grad_output: d(this rank's micro-batch mean loss)/d(forward output).
            layer_names: the same names as the forward pass.
            learning_rate: the learning rate of the optimizer step this backward
                completes. With ``overlap_computation`` it lets each layer's
                update start while earlier layers still run backward (see
                [Note: optimizer update during backward]); ``optimizer_step``
                must then be called with the same value.
            tokens: the number of valid tokens (an int >= 0, or a one-element
                integer tensor) whose mean is this rank's loss. The update then
                follows the global token mean, ``sum of per-token losses / valid
                tokens of all ranks and micro-steps of the window``, instead of
                the mean of the ranks' and micro-steps' means (see [Note:
                token-weighted gradients] in ``gradient.store``). Every backward
                of a window passes it, on every rank, or none does.

        Returns:
            The gradient with respect to the forward input, or None when the
            input is not floating point (e.g. token ids).

        Raises:
            StateError: without a matching forward_pass, or when the last
                backward_pass already started this step's updates (call
                optimizer_step first).
            InputError: when ``grad_output``'s shape differs from the output's, or
                it is complex or on the meta device; for an invalid ``tokens``, or
                one given (or not) unlike the window's earlier backwards.
            LayerExecutionError: when a layer raises.
            CommunicationError: when a collective fails.
        """
        runner, state, engine = self._chain_runner("backward_pass"), self._state, self._engine
        if state.early_lr is not None:
            raise StateError(
                "the last backward_pass already updated the layers of this step (its "
                f"learning_rate={state.early_lr!r}): call optimizer_step({state.early_lr!r}) "
                "before the next backward_pass"
            )
        forward = runner.check_backward(state.forward, layer_names, grad_output)
        count = self._check_tokens(tokens)
        lr = None if learning_rate is None else check_lr(learning_rate)
        names, calls = tuple(forward.layers), engine.counter.window_calls
        early_lr = await engine.steps.early_rate(lr, names, calls, tokens=count)
        state.forward = None  # one backward per forward, whatever happens
        grad_input, _ = await runner.backward(grad_output, forward, early_lr=early_lr, tokens=count)
        state.early_lr = early_lr
        engine.steps.note_loss(grad_output, count)  # the loss's gradient: for the guard's report
        return grad_input

    @_flushed
    async def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's own forward, ``model(*args, **kwargs)``, under ZeRO-3 (module mode).

        The model's code runs on the manager's model thread while the event
        loop stays free: each unit is gathered when the model reaches it (the
        next ones prefetched in the recorded order) and released after it. A
        training forward (autograd on) saves what :meth:`backward` needs;
        under ``torch.no_grad()`` nothing is saved and the accumulation window's
        timer does not start. See [Note: module mode]. With ``sequence_parallel_size``
        S > 1 every rank of a group of S passes the same whole sequences as keyword
        arguments; each runs its 1/S of the tokens and gets the whole sequence's
        ``loss`` (see [Note: sequence parallelism] in ``zero3_offload.sequence``).

        Args:
            args: positional arguments of the model (tensors are moved to the device).
            kwargs: keyword arguments of the model, e.g. ``input_ids=x, labels=y``.
            return_logits: (a keyword the manager takes) True: the model's own logits and
                loss even where ``labels=`` would get the tiled loss.

        Returns:
            What the model returns (e.g. a transformers ``ModelOutput``), with
            its autograd history: compute the loss from it, or take ``out.loss``. Given
            ``labels=`` (with ``loss_chunk_tokens`` on, a transformers causal LM whose head
            the tiled loss reproduces, no ``return_logits``), ``out.loss`` is computed in
            chunks and no logits were kept: ``out.logits`` is None (see [Note: the
            head's tiled loss] in ``execution.head_loss``).

        Raises:
            StateError: when the manager is not in module mode.
            LayerExecutionError: when the model's code raised (cause chained);
                nothing is saved and nothing stays gathered.
            CommunicationError: when a gather fails.
        """
        runner = self._module_runner("forward")
        out, result = await runner.forward(forward_phase(), args, kwargs)
        self._state.pend(result if result.phase.trains else None)
        return out

    def gathered(
        self, *modules_or_parameters: nn.Module | torch.Tensor
    ) -> contextlib.AbstractContextManager[None]:
        """Hold these modules' (or parameters') units gathered for a block of the model's
        code (module mode; on the model thread, under :meth:`forward`).

        For code that reads parameters without calling their module: a fused loss reading
        ``lm_head.weight``, weights tied by hand, a custom kernel. Inside the block the
        parameters hold their full values; the gradients that flow into them are
        reduce-scattered as their unit's, in the backward. A block that runs again in the
        backward (non-reentrant activation checkpointing recomputes it) gathers them again.
        Reading a sharded parameter outside such a block raises :class:`StateError` naming
        it (see [Note: released reads] in ``execution.released_reads``).

        Example (in the model's ``forward``)::

            with manager.gathered(self.lm_head):
                loss = fused_cross_entropy(hidden, self.lm_head.weight, labels)

        Raises:
            StateError: when the manager is not in module mode, or (on entering) outside a
                pass of the manager's model thread.
            InputError: for something that is not a module or parameter of the model.
        """
        return self._module_runner("gathered").gathered(modules_or_parameters)

    @_flushed
    async def backward(
        self, loss: torch.Tensor, *, tokens: int | torch.Tensor | None = None
    ) -> None:
        """Backpropagate this rank's ``loss`` through the last :meth:`forward` (module mode).

        Each unit's gradient is reduce-scattered (mean over ranks) as soon as
        autograd completed it, overlapping the backward of the units before
        it; this rank keeps the shard it owns, accumulated over the micro-steps
        of the window. Gradients are committed only when the whole backward
        succeeded.

        Args:
            loss: a scalar computed from the last training forward's output
                (d(this rank's loss); the manager averages over ranks and
                accumulation steps).
            tokens: the number of valid tokens (an int >= 0, or a one-element
                integer tensor) whose mean ``loss`` is, e.g. the labels other than
                -100 that a causal LM predicts. The update then follows the global
                token mean over all ranks and micro-steps of the window, as
                single-process training of the whole batch does (transformers'
                ``num_items_in_batch``; see [Note: token-weighted gradients] in
                ``gradient.store``). Every backward of a window passes it, on
                every rank, or none does. With sequence parallelism: the whole
                sequence's count, the same on every rank of its group.

        Raises:
            StateError: without a training forward since the last backward.
            InputError: when ``loss`` is not a scalar tensor with autograd history;
                for an invalid ``tokens``, or one given (or not) unlike the window's
                earlier backwards.
            LayerExecutionError: when the model's backward raised.
            CommunicationError: when a collective fails.
        """
        runner = self._module_runner("backward")
        forward = runner.check_backward(self._state.forward, loss)
        count = self._check_tokens(tokens)
        self._state.forward = None  # one backward per forward, whatever happens
        await runner.backward(loss, forward, tokens=count)
        self._engine.steps.note_loss(loss, count)  # for the non-finite guard's report

    @_flushed
    async def abandon_step(self, error: BaseException) -> NoReturn:
        """Abandon the step on every rank: this rank's own code failed between the manager's
        calls (the loss, a data loader, a hook of its own).

        Every other rank's pending or next call raises :class:`StepAbandonedError` naming
        this rank and ``error``'s first line, within a second while it waits for a
        collective; every rank drops the pending forward and what a half-done call
        left, and the next call runs as if the step had never been started (see
        [Note: abandoned calls]).

        Args:
            error: what this rank's code raised.

        Raises:
            StepAbandonedError: always, here too, chained to ``error``.
        """
        self._check_open()
        raise StepAbandonedError(
            f"this rank's own code failed: {type(error).__name__}: {first_line(error)}"
        ) from error

    @_flushed
    async def generate(
        self, input_ids: torch.Tensor, *, keep_gathered: bool = True, **kwargs: Any
    ) -> Any:
        """Run the model's own ``generate`` under ZeRO-3, without autograd (module mode).

        Every rank must call it (each decoding step gathers the units). With
        more than one rank ``synced_gpus=True`` is passed unless given, so ranks
        whose sequences end at different steps keep running forwards together.

        Args:
            input_ids: the prompt tokens (moved to the device).
            keep_gathered: keep units gathered between decoding steps while
                ``gpu_param_memory_budget`` allows (least recently used ones
                are released when a unit does not fit); False gathers and
                releases every unit at every step, as training forwards do.
            kwargs: passed to ``model.generate`` (e.g. ``max_new_tokens``,
                ``do_sample``).

        Returns:
            What ``model.generate`` returns (the token ids, prompt included).

        Raises:
            StateError: when the manager is not in module mode.
            InputError: when ``input_ids`` is not a tensor.
            LayerExecutionError: when the model's code raised.
        """
        runner = self._module_runner("generate")
        return await runner.generate(input_ids, kwargs, keep_gathered=keep_gathered)

    @_flushed
    async def optimizer_step(self, learning_rate: float) -> bool:
        """Count a micro-step; at every ``gradient_accumulation_steps``-th, update.

        Each rank updates only its own shards (one worker-thread task per layer,
        running in parallel), then refreshes their compute copies. The
        updating call closes the step (its ``step`` event), also when fp16 loss
        scaling skipped it.

        Args:
            learning_rate: the step's learning rate (>= 0).

        Returns:
            True when the parameters were updated by this call; False inside an
            accumulation window, or when fp16 loss scaling or ``skip_nonfinite_steps``
            found inf/nan and skipped the step on every rank (see [Note: non-finite
            guard] in ``optimizer_state.nonfinite_guard``).

        Raises:
            ConfigError: for a negative or non-finite learning rate, or one that
                differs from the learning rate given to the early update.
            StateError: when no backward_pass ran since the last call.
            NonFiniteError: when this step was the ``max_consecutive_nonfinite``-th
                skipped in a row (raised on every rank once the step is closed).
        """
        self._check_open()
        engine, state = self._engine, self._state
        calls = engine.counter.window_calls
        lr = check_step_call(learning_rate, engine.grads.micro_steps, calls, state.early_lr)
        if engine.counter.count_call() < engine.config.gradient_accumulation_steps:
            await engine.prefetch.after_update(())  # parameters unchanged: prefetch the forward
            return False
        started = time.perf_counter()
        await engine.prefetch.drain()  # no gather may read a shard while it is updated
        # The next forward's first layers update first; their gathers start while
        # the other layers update.
        fresh: list[str] = []
        updated = await engine.steps.apply(
            lr,
            first=engine.prefetch.forward_window(),
            ready=lambda names: fresh.extend(engine.prefetch.launch_updated(names)),
        )
        engine.grads.clear()
        state.early_lr = None
        pressure = await engine.pressure.check()
        await engine.prefetch.after_update(updated or (), fresh=fresh)
        self._close_step(started, stepped=updated is not None, pressure=pressure.pressure)
        engine.steps.check_nonfinite()  # once the step is closed: too many skips in a row
        return updated is not None

    def _close_step(self, started: float, *, stepped: bool, pressure: float) -> None:
        """Close the step that began updating at ``started``: its event and counts."""
        engine = self._engine
        engine.step_log.close_step(
            updating=started,
            stepped=stepped,
            memory=self.get_memory_stats().step_figures(),
            disk_files=engine.disk_files(),
            prefetch_hit_rate=engine.prefetch.metrics.hit_rate(),
            memory_pressure=pressure,
            loss_scale=self.loss_scale,
            tokens=engine.steps.last_tokens,
            **engine.activation_step_figures(),
        )
        engine.steps.close_step(updated=stepped)

    # ----------------------------------------------------------- state, stats

    @_flushed
    async def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value, on every rank (a collective).

        Returns:
            ``{name as in model.named_parameters(): fp32 CPU tensor}``.
        """
        self._check_open()
        return await self._engine.full_state.state_dict()

    @_flushed
    async def save_pretrained(
        self,
        directory: str | os.PathLike[str],
        *,
        max_shard_bytes: int = 5 * 2**30,
        dtype: torch.dtype = torch.float32,
        merged: bool = False,
    ) -> Path:
        """Write the trained model as a transformers directory (a collective; module mode).

        For a peft model the directory is its adapter (``adapter_config.json`` and
        ``adapter_model.safetensors``, as ``PeftModel.from_pretrained`` loads it; see
        [Note: adapter saves]); with ``merged`` it is the base model with the LoRA
        adapters merged into its weights, streamed unit by unit (see [Note: merged
        saves]).

        ``AutoModelForCausalLM.from_pretrained(directory)`` loads the result
        as is: ``config.json``, ``model.safetensors`` (or numbered shards of at
        most ``max_shard_bytes`` and their index), tied weights stored once as
        transformers stores them. Streamed: units are gathered one at a time
        and rank 0 writes them, holding at most one file's tensors; the
        directory appears complete or not at all.

        Args:
            directory: the target (created; must not exist or be empty).
            max_shard_bytes: largest weight file.
            dtype: dtype of the stored weights (the fp32 masters are converted).

        Returns:
            The directory written.

        Raises:
            StateError: when the model has no transformers ``config``.
            InputError: ``merged`` for a model without adapters, or an adapter that
                cannot be merged (DoRA, LoRA biases, embedding adapters).
            CheckpointError: when writing failed on rank 0 (every rank raises).
        """
        self._check_open()
        model = self.model
        if model is None or getattr(model, "config", None) is None:
            raise StateError(
                "save_pretrained needs a transformers model (module mode, with model.config); "
                "use save_checkpoint or full_state_dict for other models"
            )
        from zero3_offload.integrations.model_save import save_model

        return await save_model(
            directory,
            model=model,
            full_state=self._engine.full_state,
            comm=self._engine.comm,
            max_shard_bytes=max_shard_bytes,
            dtype=dtype,
            merged=merged,
        )

    def get_performance_stats(self) -> Zero3PerformanceStats:
        """A snapshot of this rank's timings, counts, prefetch metrics and recent timeline."""
        engine = self._engine
        return engine.stats.snapshot(
            engine.timeline,
            counter=engine.counter,
            prefetch=engine.prefetch.metrics.as_dict(),
            prefetch_hit_rate=engine.prefetch.metrics.hit_rate(),
            gathered_high_water_bytes=engine.gatherer.high_water_bytes,
            speculative_rollbacks=engine.steps.rollbacks,
            nonfinite_skips=0 if engine.steps.guard is None else engine.steps.guard.skips,
            disk={**disk_transfers(engine.disk_files()), **engine.activation_transfers()},
        )

    def get_memory_stats(self) -> Zero3MemoryStats:
        """Bytes this rank holds now, counted from the tensors."""
        forward, pressure = self._state.forward, self._engine.pressure
        return self._engine.accounting.stats(
            activation_bytes=forward.saved_bytes() if forward is not None else 0,
            pressure=pressure.last_pressure,
            pressure_checks=pressure.checks,
            **self._engine.offloaded_activations(),
        )

    def get_prefetch_status(self) -> PrefetchQueueStatus:
        """What the prefetcher holds now: gathers in flight, queued look-ahead, bytes."""
        return self._engine.prefetch.status()

    @_flushed
    async def force_memory_optimization(self) -> int:
        """Free every gathered layer not in use now (persistent ones too) and collect garbage.

        Call it between passes, not concurrently with one.

        Returns:
            Bytes of gathered parameters released.
        """
        self._check_open()
        gatherer = self._engine.gatherer
        before = gatherer.reserved_bytes()
        await self._engine.pressure.free_gathered()
        freed = before - gatherer.reserved_bytes()
        log.info("memory_optimized", rank=self.rank, freed_bytes=freed)
        return freed

    @_flushed
    async def adapt_performance(self) -> int:
        """Adapt the prefetch depth to measured gather and compute times (a collective).

        See :meth:`PrefetchScheduler.adapt_prefetch_strategy` for the rule; the times are the
        maxima over ranks, so every rank picks the same depth.

        Returns:
            The new prefetch depth.
        """
        self._check_open()
        engine = self._engine
        gather_s, compute_s = layer_seconds(engine.timeline.events())
        agreed = torch.tensor([gather_s, compute_s], dtype=torch.float64, device=engine.device)
        await engine.comm.all_reduce_max(agreed, what="the layer timings")
        depth = engine.prefetch.adapt_prefetch_strategy(float(agreed[0]), float(agreed[1]))
        log.info(
            "prefetch_adapted",
            rank=self.rank,
            gather_s=float(agreed[0]),
            compute_s=float(agreed[1]),
            depth=depth,
        )
        return depth

    @_flushed
    async def reset_state(self) -> None:
        """Drop optimizer state, gradients, loss scale, the pending forward and the open
        accumulation window; keep parameters and the step counts."""
        self._check_open()
        engine = self._engine
        await engine.prefetch.release_all()
        engine.optimizer.reset()
        engine.grads.clear()
        engine.steps.reset()
        self._forget_window()

    def _forget_window(self) -> None:
        """Forget the pending forward, early updates and the open window's progress."""
        self._state.reset()
        self._engine.counter.reset_window()
        self._engine.clock.reset()

    # ------------------------------------------------------------ checkpoints

    @_flushed
    async def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        include_frozen: bool = True,
        training_state: Mapping[str, Any] | None = None,
    ) -> Path:
        """Save this rank's shards and the run's counters under ``path`` (a collective).

        Every rank writes its own file; the checkpoint is committed (renamed into
        place, ``latest`` updated) only when all ranks succeeded. A pending
        forward (activations saved for backward) is not part of it. See
        [Note: checkpoint format] in ``checkpoint.format``.

        Args:
            path: the checkpoint root directory (created if missing).
            include_frozen: also save the frozen parameters' shards (``requires_grad=False``
                at construction); without them (a fine-tune of a base model kept
                elsewhere) a load keeps the frozen values the manager has.
            training_state: the caller's own state, a JSON object (e.g. the training
                loop's data position), stored as ``training_state`` in the checkpoint's
                ``metadata.json`` (rank 0's); ``checkpoint.format.read_metadata`` reads it.

        Returns:
            The committed checkpoint directory.

        Raises:
            StateError: between a backward whose updates started early and its
                ``optimizer_step``.
            CheckpointError: when writing or committing failed on any rank; the
                previous checkpoint stays loadable.
        """
        self._check_open()
        if self._state.early_lr is not None:
            raise StateError("updates of this step already started: call optimizer_step first")
        return await self._engine.checkpointer.save(
            path, include_frozen=include_frozen, training_state=training_state
        )

    @_flushed
    async def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Load a checkpoint saved at any world size (a collective).

        Every rank reads and checks its slices first; only when all ranks
        succeeded is any state replaced, so a failed load changes nothing.

        Args:
            path: a checkpoint directory, or a root whose ``latest`` names one.

        Returns:
            The checkpoint directory loaded.

        Raises:
            CheckpointError: for a missing, truncated or corrupt file, a
                checkpoint of another model or optimizer, unexpected files (e.g.
                a pickle) in the directory, or a failure on another rank.
        """
        self._check_open()
        engine = self._engine
        directory, loaded = await engine.checkpointer.read(path)
        await engine.prefetch.release_all(keep_persistent=False)  # gathered copies are stale
        self._forget_window()
        engine.steps.reset()  # layers updated early in the open window: the load replaces them
        await engine.checkpointer.restore(loaded)  # the step counts too
        log.info("checkpoint_loaded", rank=self.rank, path=str(directory))
        return directory

    # -------------------------------------------------------------- lifecycle

    async def close(self) -> None:
        """Release gathered parameters and pending state, and the files and threads the
        manager holds. Idempotent. After a failure of the group's collectives, the gathers
        still in flight are dropped (their failure was raised already); everything is
        released either way.

        Raises:
            Zero3Error: a gather in flight failed now (everything is released all the same).
        """
        if self._closed:
            return
        engine = self._engine
        try:
            await engine.prefetch.release_all(keep_persistent=False)
        except Zero3Error:
            if engine.comm.broken is None:
                raise
            log.info("close_after_failure", rank=self.rank, failure=str(engine.comm.broken))
        finally:
            self._state.reset()
            self._closed = True
            engine.close()

    async def __aenter__(self) -> Zero3CpuOffloadManager:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
