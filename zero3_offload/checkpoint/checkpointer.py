"""Saving and loading one rank's training state (see [Note: checkpoint format]).

:class:`ShardCheckpointer` gathers what a checkpoint holds from the stores
(master shards, optimizer state, accumulated gradients) and the run's counters,
and puts a loaded checkpoint back into them. The manager decides when (never
with updates of a step half done) and what happens around it (releasing
gathered copies, resetting its step state).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from zero3_offload.checkpoint import atomic_save
from zero3_offload.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    checkpoint_name,
    frozen_metadata,
    layout_metadata,
    resolve_checkpoint,
)
from zero3_offload.checkpoint.reshard_load import LoadedShards, read_shards
from zero3_offload.checkpoint.streamed_shard import ShardEntry
from zero3_offload.comm.collectives import Collectives
from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.errors import CheckpointError
from zero3_offload.gradient.store import GradientStore
from zero3_offload.logging import get_logger
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.optimizer_state.step_runner import StepRunner
from zero3_offload.parameter.flat_layout import LayerLayout
from zero3_offload.parameter.store import ParameterStore
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.step_counter import StepCounter
from zero3_offload.version import __version__

__all__ = ["ShardCheckpointer"]

log = get_logger(__name__)

# The streamed write's group of the frozen shards (no layer is named so: names are
# module paths or ROOT_UNIT).
_FROZEN_GROUP = "<frozen>"


@attrs.frozen(kw_only=True, eq=False)
class ShardCheckpointer:
    """Reads and writes this rank's part of a sharded checkpoint.

    Every method is a collective: all ranks call it together.
    """

    config: Zero3CpuOffloadConfig
    layouts: dict[str, LayerLayout]
    params: ParameterStore
    grads: GradientStore
    optimizer: ShardOptimizers
    steps: StepRunner  # the loss scaler lives there
    comm: Collectives
    workers: WorkerThreads
    counter: StepCounter  # the run's step counts: saved and restored
    model_config: dict[str, Any] | None = None  # a transformers model's config, for export
    peft: dict[str, Any] | None = None  # a peft model's adapter config and modules, for export

    def _layer_tensors(self, layer: str) -> dict[str, torch.Tensor]:
        """``layer``'s tensors of a checkpoint, by name (with the disk tier, the master and
        full-size state only while the layer is resident)."""
        tensors = {f"{layer}.master": self.params.master(layer)}
        for key, value in self.optimizer.layer_state(layer).items():
            tensors[f"{layer}.optim.{key}"] = value
        for key, value in self.optimizer.owned_state(layer).items():
            tensors[f"{layer}.owned.{key}"] = value  # whole parameters: this rank's only
        grad = self.grads.get(layer)
        if grad is not None:
            tensors[f"{layer}.grad"] = grad
        return tensors

    def _scalar_state(self) -> list[str]:
        """The optimizer state keys that are scalars (in memory with either tier)."""
        keys = {
            key
            for layer in self.optimizer.layers()
            for key, value in self.optimizer.layer_state(layer).items()
            if value.dim() == 0
        }
        return sorted(keys)

    def _tensors(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for layer in self.optimizer.layers():
            tensors.update(self._layer_tensors(layer))
        return tensors

    def _frozen_tensors(self) -> dict[str, torch.Tensor]:
        """``{layer}.frozen``: each frozen shard's values as gathers decode them, in the
        storage dtype (a plain dtype) or the compute dtype (a block-wise format)."""
        codec = self.params.frozen_codec
        out = {}
        for layer in self.params.frozen_layers():
            copy = self.params.frozen_copy(layer)
            assert copy is not None
            out[f"{layer}.frozen"] = copy.payload if copy.scales is None else codec.decode(copy)
        return out

    def _entries(self) -> list[ShardEntry]:
        """:meth:`_tensors`' names, dtypes and shapes, without reading the disk tier."""
        tier = self.optimizer.tier
        assert tier is not None
        entries: list[ShardEntry] = []
        for layer in self.optimizer.layers():
            shape = (self.layouts[layer].shard_numel,)
            names = [f"{layer}.master"]
            if tier.has_state(layer):
                names += [f"{layer}.optim.{key}" for key in tier.state_keys]
            entries += [ShardEntry(name, torch.float32, shape, layer) for name in names]
            # In memory: the scalar state and the gradient.
            for name, value in self._layer_tensors(layer).items():
                if name != f"{layer}.master":
                    entries.append(ShardEntry(name, value.dtype, tuple(value.shape), layer))
        return entries

    @contextlib.asynccontextmanager
    async def _resident_layer(self, layer: str) -> AsyncIterator[dict[str, torch.Tensor]]:
        """``layer``'s tensors of the checkpoint, read from the disk tier for the moment
        (the frozen shards, in memory, as one group)."""
        if layer == _FROZEN_GROUP:
            yield self._frozen_tensors()
            return
        async with self.optimizer.resident(layer, write=False):
            yield self._layer_tensors(layer)

    def _metadata(
        self,
        scalar_state: list[str],
        window_tokens: int | None,
        *,
        frozen_saved: bool,
        training_state: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        scaler = self.steps.loss_scaler
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "library_version": __version__,
            "world_size": self.comm.world_size,
            "layers": layout_metadata(self.layouts),
            "frozen_layers": frozen_metadata(self.layouts),
            "frozen_saved": frozen_saved,
            "optimizer": self.config.optimizer.to_dict(),
            "param_optimizers": self.optimizer.param_optimizers(),
            "scalar_state": scalar_state,
            **self.counter.state_dict(),  # optimizer_steps, timeline_step, calls_since_update
            "backward_passes": self.grads.micro_steps,
            # A token-weighted open window: its valid tokens so far, summed over ranks.
            "window_tokens": window_tokens,
            "loss_scaler": None if scaler is None else scaler.state_dict(),
            "config": self.config.to_dict(),
            "model_config": self.model_config,
            "peft": self.peft,
            "training_state": None if training_state is None else dict(training_state),
        }

    async def save(
        self,
        root: str | os.PathLike[str],
        *,
        include_frozen: bool = True,
        training_state: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write this rank's shards and the run's counters; commit when every rank wrote.

        Args:
            root: the checkpoint root directory (created if missing).
            include_frozen: also write the frozen parameters' shards (see [Note: frozen
                parameters]); without them a load keeps the frozen values it has.
            training_state: the caller's JSON object, stored as ``training_state`` in
                ``metadata.json``.

        Returns:
            The committed checkpoint directory.

        Raises:
            CheckpointError: when writing (e.g. a full disk) or committing failed
                on any rank, naming the file; the previous checkpoint stays
                loadable, temporary files are removed and training can go on.
        """
        root = Path(root)
        name = checkpoint_name(self.counter.updates, self.counter.window_calls)
        streamed = self.optimizer.tier is not None  # read from the disk tier layer by layer
        frozen = self._frozen_tensors() if include_frozen else {}
        if streamed:
            entries = self._entries()
            entries += [
                ShardEntry(key, t.dtype, tuple(t.shape), _FROZEN_GROUP) for key, t in frozen.items()
            ]
            count = len(entries)
        else:
            tensors = {**self._tensors(), **frozen}
            count = len(tensors)
        # The accumulated gradients of a token-weighted window are sums over every rank's
        # tokens, whatever the world size (see [Note: token-weighted gradients]): the
        # window's total goes with them, so a load at any world size goes on exactly.
        grads = self.grads
        window_tokens = await grads.token_total(self.comm) if grads.weighted else None
        meta = self._metadata(
            self._scalar_state(),
            window_tokens,
            frozen_saved=include_frozen,
            training_state=training_state,
        )
        # Through the module: tests and benchmarks wrap its steps (atomic_save.SAVE_STEPS).
        tmp = await atomic_save.prepare_save(root, name, self.comm)
        rank, world = self.comm.rank, self.comm.world_size
        error: Exception | None = None
        try:
            if streamed:

                async def write(fn: Callable[[], None]) -> None:
                    await self.workers.run("checkpoint-write", "", Phase.STEP, fn)

                await atomic_save.write_shard_streamed(
                    tmp, entries, self._resident_layer, write, rank, world
                )
            else:
                await self.workers.run(
                    "checkpoint-write",
                    "",
                    Phase.STEP,
                    lambda: atomic_save.write_shard(tmp, tensors, rank, world),
                )
        except Exception as exc:  # reported to every rank by commit_save, which raises
            error = exc
        final = await atomic_save.commit_save(root, tmp, name, meta, self.comm, error)
        log.info("checkpoint_saved", rank=rank, path=str(final), tensors=count)
        return final

    async def read(self, path: str | os.PathLike[str]) -> tuple[Path, LoadedShards]:
        """Read and check this rank's slices; succeeds only when every rank's read did.

        Nothing is changed: :meth:`restore` applies what this returns.

        Returns:
            The checkpoint directory and this rank's slices of it.

        Raises:
            CheckpointError: for a missing, truncated or corrupt file, a checkpoint
                of another model or optimizer, unexpected files (e.g. a pickle) in
                the directory, or a failure on another rank.
        """
        error: CheckpointError | None = None
        loaded: LoadedShards | None = None
        directory = Path(path)
        try:
            directory = resolve_checkpoint(path)
            kind = self.config.optimizer.kind
            # With the disk tier, layer by layer in restore: the state may not fit memory.
            streamed = self.optimizer.tier is not None
            owned = {name: self.optimizer.owned_names(name) for name in self.optimizer.layers()}
            loaded = await self.workers.run(
                "checkpoint-read",
                "",
                Phase.STEP,
                lambda: read_shards(
                    directory,
                    self.layouts,
                    optimizer_kind=kind,
                    streamed=streamed,
                    param_optimizers=self.optimizer.param_optimizers(),
                    owned={name: names for name, names in owned.items() if names},
                    uneven=self.optimizer.uneven_state(),
                ),
            )
            k = self.config.gradient_accumulation_steps
            done = loaded.meta["calls_since_update"]
            if done >= k:
                raise CheckpointError(
                    f"{directory}: saved after {done} micro-steps of a window, more than "
                    f"gradient_accumulation_steps={k} allows"
                )
            tokens = loaded.meta.get("window_tokens")
            if tokens is not None and (
                isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0
            ):
                raise CheckpointError(
                    f"{directory}: window_tokens={tokens!r} in its metadata is not a count "
                    "of tokens (an int >= 0)"
                )
        except CheckpointError as exc:
            error = exc
        if not await self.comm.agree(error is None, what="every rank's checkpoint read"):
            if error is not None:
                raise error
            raise CheckpointError(f"loading {directory} failed on another rank; nothing changed")
        assert loaded is not None
        return directory, loaded

    async def restore(self, loaded: LoadedShards) -> None:
        """Put ``loaded`` into the stores and the step counter, layer by layer.

        A streamed ``loaded`` (the disk tier) reads each layer here; its files were
        checked by :meth:`read`, so only an I/O error can fail a read now, and then the
        layers before it are loaded already: the error says to load again.

        Gathered copies of the parameters are stale afterwards: the caller
        releases them first.
        """
        for layer in loaded.names:
            # Streamed (with the disk tier): this layer's slices read from the checkpoint now.
            try:
                master, state = await self.workers.run(
                    "checkpoint-read", layer, Phase.STEP, lambda layer=layer: loaded.layer(layer)
                )
            except CheckpointError as exc:
                raise CheckpointError(
                    f"{exc}; the layers before {layer!r} are loaded already: load the "
                    "checkpoint again"
                ) from exc
            # With the disk tier: read, replaced, written back.
            async with self.optimizer.resident(layer, write=True):
                self.params.master(layer).copy_(master)
                self.params.refresh_compute_copy(layer)
                self.optimizer.load_layer_state(layer, state)
            self.optimizer.load_owned_state(layer, loaded.owned.get(layer, {}))
            del master, state  # not alive while the next layer is read
        for layer, values in loaded.frozen.items():
            await self.workers.run(
                "compress",
                layer,
                Phase.STEP,
                lambda layer=layer, values=values: self.params.put_frozen(layer, values),
            )
        meta = loaded.meta
        window_tokens = meta.get("window_tokens")
        if window_tokens is not None:
            # Rank 0 holds the saved window's count, so the sum over ranks is the total.
            window_tokens = window_tokens if self.comm.rank == 0 else 0
        self.grads.load(loaded.grads, meta["backward_passes"], window_tokens)
        self.counter.load_state_dict(meta)
        if self.steps.loss_scaler is not None and meta["loss_scaler"] is not None:
            self.steps.loss_scaler.load_state_dict(meta["loss_scaler"])
