"""The coordinator: orders gathers, compute, reduce-scatters and optimizer steps.

[Note: backward by recomputation]
Forward runs every layer under ``torch.no_grad()`` with its parameters gathered
just for that layer, and keeps only the layer's input (and the RNG state it ran
with). Backward gathers the layer again, reruns its forward from the saved input
with autograd on and the same RNG state (so dropout draws the same mask), and
backpropagates the incoming gradient through that one layer: this gives the
layer's input gradient and its parameter gradients with real autograd, while no
autograd graph ever refers to released parameter storage. The cost is one extra
forward per layer, the same trade as activation checkpointing per layer; the
saving is that only layer inputs are kept between the passes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from types import TracebackType

import attrs
import torch
import torch.distributed as dist
from torch import nn

from zero3_offload.comm import Collectives
from zero3_offload.config import Zero3CpuOffloadConfig, Zero3RankMapping
from zero3_offload.errors import (
    ConfigError,
    InputError,
    LayerExecutionError,
    LayerNotFoundError,
    StateError,
    Zero3Error,
)
from zero3_offload.gradient_management import (
    CpuGradientStore,
    GpuGradientBuffer,
    GradientPartitioner,
    PendingGradient,
)
from zero3_offload.logging import get_logger
from zero3_offload.memory_management import Zero3MemoryManager, Zero3MemoryStats
from zero3_offload.optimizer_state import OptimizerStateManager
from zero3_offload.parameter_management import (
    CpuParameterStore,
    GpuParameterCache,
    ParameterPartitioner,
)
from zero3_offload.stats import Zero3PerformanceStats

__all__ = ["Zero3CpuOffloadManager"]

log = get_logger(__name__)


@attrs.frozen
class _RngState:
    cpu: torch.Tensor
    cuda: torch.Tensor | None


@attrs.frozen
class _ForwardRecord:
    """What backward needs from the last forward. See [Note: backward by recomputation]."""

    layer_names: tuple[str, ...]
    inputs: tuple[torch.Tensor, ...]  # input of each step, detached, on the device
    rng: tuple[_RngState, ...]  # RNG state each step ran with
    output_shape: torch.Size


def _split_layers(model: nn.Module | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    if isinstance(model, nn.Module):
        layers = dict(model.named_children())
        direct = [name for name, _ in model.named_parameters(recurse=False)]
        if direct:
            raise Zero3Error(
                f"parameters {direct} belong to the model itself, not to a layer: every "
                "parameter must live in one of the model's children (the layers)"
            )
    elif isinstance(model, Mapping):
        layers = dict(model)
        bad = [k for k, v in layers.items() if not isinstance(v, nn.Module)]
        if bad:
            raise Zero3Error(f"layers {bad} are not nn.Module instances")
    else:
        raise Zero3Error(
            f"model must be an nn.Module or a Mapping[str, nn.Module], got {type(model).__name__}"
        )
    if not layers:
        raise Zero3Error("the model has no layers: give an nn.Module with children")
    return layers


class Zero3CpuOffloadManager:
    """Trains a model with ZeRO stage 3 across the ranks of a process group.

    Every rank builds the manager with the same model; rank 0's initial values
    are broadcast, then each rank keeps only its shard of every layer.

    Args:
        config: the configuration (validated again here).
        process_group: the group whose ranks share the model (e.g. from
            :func:`init_process_group`).
        model: an ``nn.Module`` whose named children are the layers, or a
            mapping of layer name to module.

    Raises:
        ConfigError: when the config cannot run here (e.g. CUDA asked but absent).
        Zero3Error: when the model cannot be partitioned.
        CommunicationError: when the initial broadcast fails.
    """

    def __init__(
        self,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        model: nn.Module | Mapping[str, nn.Module],
    ) -> None:
        config.validate()
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={config.device!r} is invalid: CUDA is not available here")
        if config.compute_dtype != torch.float32:
            raise ConfigError(
                f"compute_dtype={config.compute_dtype} is not supported yet: use torch.float32"
            )
        if config.cpu_compression.value != "none":
            raise ConfigError(
                f"cpu_compression={config.cpu_compression.value!r} is not supported yet: use 'none'"
            )
        self.config = config
        self.device = device
        self.process_group = process_group
        self.mapping = Zero3RankMapping(rank=process_group.rank(), world_size=process_group.size())
        self.rank = self.mapping.rank
        self._model = model if isinstance(model, nn.Module) else None
        self.layers = _split_layers(model)
        self._stats = Zero3PerformanceStats()
        self.comm = Collectives(process_group, device=device, timeout_s=config.collective_timeout_s)
        self.comm.observer = self._stats.record_communication
        self.partitioner = ParameterPartitioner(self.layers, self.mapping)
        self.layouts = self.partitioner.layouts
        cpu = torch.device("cpu")
        self.params = CpuParameterStore(
            master_device=cpu if config.offload_optimizer_states else device,
            compute_device=cpu if config.offload_params else device,
            compute_dtype=config.compute_dtype,
        )
        self.cache = GpuParameterCache(
            layers=self.layers,
            layouts=self.layouts,
            store=self.params,
            comm=self.comm,
            device=device,
        )
        self._shard_initial_values()
        largest = max((lay.padded_numel for lay in self.layouts.values()), default=0)
        self.grad_partitioner = GradientPartitioner(
            layouts=self.layouts,
            comm=self.comm,
            buffer=GpuGradientBuffer(numel=largest, device=device),
        )
        self.grads = CpuGradientStore(device=cpu if config.offload_grads else device)
        self.optimizer = OptimizerStateManager(
            config.optimizer,
            [(name, self.params.master(name)) for name in self.layers],
            device=self.params.master_device,
        )
        self.memory = Zero3MemoryManager(
            params=self.params,
            cache=self.cache,
            grads=self.grads,
            optimizer=self.optimizer,
            total_parameters=self.partitioner.total_numel(),
            owned_parameters=self.partitioner.owned_numel(),
        )
        self._record: _ForwardRecord | None = None
        self._calls_since_update = 0  # optimizer_step calls since the last update
        self.last_grad_norm: float | None = None  # global norm before clipping, last step
        self._closed = False
        log.info(
            "manager_ready",
            rank=self.rank,
            world_size=self.mapping.world_size,
            layers=len(self.layers),
            parameters=self.partitioner.total_numel(),
            owned_parameters=self.partitioner.owned_numel(),
        )

    def _shard_initial_values(self) -> None:
        # Rank 0's values win; each rank then keeps only its slice.
        for name, module in self.layers.items():
            layout = self.layouts[name]
            flat = layout.flatten(module, dtype=torch.float32).to(self.device)
            self.comm.broadcast_blocking(flat, src=0)
            self.params.put_master(name, flat[layout.shard_start : layout.shard_end].clone())
            for buf in module.buffers():
                staged = buf.detach().to(self.device)
                self.comm.broadcast_blocking(staged, src=0)
                buf.data = staged
        self.cache.release_all_views()
        for module in self.layers.values():
            module.to(self.device)

    # ----------------------------------------------------------------- checks

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the manager is closed; build a new one")

    def _resolve(self, layer_names: Sequence[str]) -> tuple[str, ...]:
        if isinstance(layer_names, str) or not isinstance(layer_names, Sequence):
            raise InputError(
                f"layer_names must be a sequence of layer names, got {type(layer_names).__name__}"
            )
        names = tuple(layer_names)
        if not names:
            raise InputError("layer_names is empty: give at least one layer")
        unknown = [n for n in names if n not in self.layers]
        if unknown:
            raise LayerNotFoundError(
                f"unknown layer(s) {unknown}; known layers are {list(self.layers)}"
            )
        return names

    # ----------------------------------------------------------------- passes

    def _rng_state(self) -> _RngState:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return _RngState(cpu=torch.get_rng_state(), cuda=cuda)

    async def forward_pass(self, x: torch.Tensor, layer_names: Sequence[str]) -> torch.Tensor:
        """Run ``layer_names`` in order on ``x``; keep what backward needs.

        Args:
            x: input of the first layer (moved to the configured device).
            layer_names: the layers to run, in order.

        Returns:
            The last layer's output (no autograd history; see backward_pass).

        Raises:
            LayerNotFoundError: for a name that is not a layer.
            LayerExecutionError: when a layer raises; the manager's state is unchanged.
            CommunicationError: when a gather fails.
        """
        self._check_open()
        names = self._resolve(layer_names)
        if not isinstance(x, torch.Tensor):
            raise InputError(f"x must be a torch.Tensor, got {type(x).__name__}")
        started = time.perf_counter()
        h = x.to(self.device)
        inputs: list[torch.Tensor] = []
        rng: list[_RngState] = []
        for name in names:
            inputs.append(h.detach())
            rng.append(self._rng_state())
            async with self.cache.use(name) as module:
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        h = module(h)
                except Exception as exc:
                    raise LayerExecutionError(f"layer {name!r} raised in forward: {exc}") from exc
                if not isinstance(h, torch.Tensor):
                    raise LayerExecutionError(
                        f"layer {name!r} returned {type(h).__name__}: layers must return a Tensor"
                    )
                self._stats.record_layer(name, "forward", time.perf_counter() - t0)
        self._record = _ForwardRecord(
            layer_names=names, inputs=tuple(inputs), rng=tuple(rng), output_shape=h.shape
        )
        self._stats.forward_passes += 1
        self._stats.forward_samples += x.shape[0] if x.dim() else 1
        self._stats.total_forward_time += time.perf_counter() - started
        return h

    def _layer_backward(
        self, name: str, module: nn.Module, inp: torch.Tensor, rng: _RngState, grad: torch.Tensor
    ) -> torch.Tensor | None:
        leaf = inp.detach().requires_grad_(inp.is_floating_point())
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(rng.cpu)
            if rng.cuda is not None:
                torch.cuda.set_rng_state(rng.cuda, self.device)
            with torch.enable_grad():
                out = module(leaf)
        if out.shape != grad.shape:
            raise LayerExecutionError(
                f"layer {name!r} recomputed an output of shape {tuple(out.shape)} but the "
                f"incoming gradient has shape {tuple(grad.shape)}"
            )
        torch.autograd.backward(out, grad)
        return leaf.grad if leaf.requires_grad else None

    async def backward_pass(
        self, grad_output: torch.Tensor, layer_names: Sequence[str]
    ) -> torch.Tensor | None:
        """Backpropagate ``grad_output`` through ``layer_names`` in reverse.

        Each layer's parameter gradient is reduce-scattered (mean over ranks) so
        this rank keeps the shard it owns; the reduce-scatter of one layer
        overlaps the compute of the next. Gradients are committed only when the
        whole pass succeeded.

        Args:
            grad_output: d(this rank's micro-batch mean loss)/d(forward output).
            layer_names: the same names as the forward pass.

        Returns:
            The gradient with respect to the forward input, or None when the
            input is not floating point (e.g. token ids).

        Raises:
            StateError: without a matching forward_pass.
            InputError: when ``grad_output``'s shape differs from the output's.
            LayerExecutionError: when a layer raises; gradients are unchanged.
            CommunicationError: when a collective fails.
        """
        self._check_open()
        names = self._resolve(layer_names)
        record = self._record
        if record is None:
            raise StateError(
                "backward_pass called without a forward_pass to go back through: call "
                "forward_pass(x, layer_names) first (each forward is used by one backward)"
            )
        if names != record.layer_names:
            raise StateError(
                f"backward_pass layer_names {list(names)} differ from the last forward_pass's "
                f"{list(record.layer_names)}: pass the same names"
            )
        if not isinstance(grad_output, torch.Tensor):
            raise InputError(
                f"grad_output must be a torch.Tensor, got {type(grad_output).__name__}"
            )
        if grad_output.shape != record.output_shape:
            raise InputError(
                f"grad_output has shape {tuple(grad_output.shape)} but the forward output had "
                f"shape {tuple(record.output_shape)}: they must be equal"
            )
        started = time.perf_counter()
        g: torch.Tensor | None = grad_output.to(self.device, self.config.compute_dtype)
        pending: list[PendingGradient] = []
        try:
            for step in reversed(range(len(names))):
                name = names[step]
                if g is None:
                    raise StateError(
                        f"layer {names[step + 1]!r} has a non-floating input, so no gradient "
                        f"reaches layer {name!r}: it must come first in layer_names"
                    )
                async with self.cache.use(name) as module:
                    t0 = time.perf_counter()
                    try:
                        g = self._layer_backward(
                            name, module, record.inputs[step], record.rng[step], g
                        )
                    except Zero3Error:
                        raise
                    except Exception as exc:
                        raise LayerExecutionError(
                            f"layer {name!r} raised in backward: {exc}"
                        ) from exc
                    self._stats.record_layer(name, "backward", time.perf_counter() - t0)
                    if self.layouts[name].padded_numel:
                        pending.append(
                            await self.grad_partitioner.start_reduce_scatter(name, module)
                        )
            shards = [(p.layer, await self.grad_partitioner.finish(p)) for p in pending]
        except BaseException:
            # After a failure nothing may stay in flight; the first error is the one raised.
            for p in pending:
                with contextlib.suppress(Zero3Error):
                    await p.collective.wait()
            raise
        self.grads.commit(shards)
        self._record = None
        self._stats.backward_passes += 1
        self._stats.total_backward_time += time.perf_counter() - started
        return g

    async def optimizer_step(self, learning_rate: float) -> bool:
        """Count a micro-step; at every ``gradient_accumulation_steps``-th, update.

        Each rank updates only its own shards, then refreshes their compute copies.

        Args:
            learning_rate: the step's learning rate (>= 0).

        Returns:
            True when the parameters were updated by this call.

        Raises:
            ConfigError: for a negative or non-finite learning rate.
            StateError: when no backward_pass ran since the last call.
        """
        self._check_open()
        if (
            isinstance(learning_rate, bool)
            or not isinstance(learning_rate, (int, float))
            or not 0 <= learning_rate < float("inf")
        ):
            raise ConfigError(
                f"learning_rate={learning_rate!r} is invalid: must be a finite number >= 0"
            )
        if self.grads.micro_steps <= self._calls_since_update:
            raise StateError(
                "optimizer_step called without a backward_pass since the last call: "
                "call forward_pass and backward_pass for each micro-batch first"
            )
        self._stats.micro_steps += 1
        self._calls_since_update += 1
        k = self.config.gradient_accumulation_steps
        if self._calls_since_update < k:
            return False
        started = time.perf_counter()
        if k > 1:
            self.grads.scale_(1.0 / k)  # mean over the micro-steps
        if self.config.gradient_clipping > 0:
            self.last_grad_norm = await self.grads.clip_(self.config.gradient_clipping, self.comm)
        for name in self.grads.layers():
            self.optimizer.step(name, self.grads.get(name), float(learning_rate))
            self.params.refresh_compute_copy(name)
        self.grads.clear()
        self._calls_since_update = 0
        self._stats.optimizer_steps += 1
        self._stats.total_optimizer_time += time.perf_counter() - started
        return True

    # ----------------------------------------------------------------- state

    async def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value, on every rank (a collective).

        Returns:
            ``{name as in model.named_parameters(): fp32 CPU tensor}``.
        """
        self._check_open()
        out: dict[str, torch.Tensor] = {}
        for name, layout in self.layouts.items():
            if not layout.padded_numel:
                continue
            full = torch.empty(layout.padded_numel, dtype=torch.float32, device=self.device)
            await self.comm.all_gather(full, self.params.master(name).to(self.device))
            for pname, view in layout.unflatten(full):
                out[f"{name}.{pname}"] = view.detach().to("cpu", copy=True)
        return out

    def get_performance_stats(self) -> Zero3PerformanceStats:
        """A snapshot of this rank's timings and counts."""
        return self._stats.copy()

    def get_memory_stats(self) -> Zero3MemoryStats:
        """Bytes this rank holds now, counted from the tensors."""
        return self.memory.stats()

    async def reset_state(self) -> None:
        """Drop optimizer state, gradients and the pending forward; keep parameters."""
        self._check_open()
        self.optimizer.reset()
        self.grads.clear()
        self._record = None
        self._calls_since_update = 0

    async def close(self) -> None:
        """Release gathered parameters and pending state. Idempotent."""
        if self._closed:
            return
        for name in list(self.layers):
            self.cache.release(name)
        self._record = None
        self._closed = True

    async def __aenter__(self) -> Zero3CpuOffloadManager:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
