"""The manager's checkpoint methods (see [Note: checkpoint format] in ``checkpoint``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import zero3_offload
from zero3_offload.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    LoadedShards,
    agree,
    checkpoint_name,
    commit_save,
    layout_metadata,
    prepare_save,
    read_shards,
    resolve_checkpoint,
    write_shard,
)
from zero3_offload.errors import CheckpointError, StateError
from zero3_offload.logging import get_logger

if TYPE_CHECKING:
    from zero3_offload.manager import Zero3CpuOffloadManager

__all__ = ["CheckpointMixin"]

log = get_logger(__name__)


class CheckpointMixin:
    """``save_checkpoint`` / ``load_checkpoint`` for :class:`Zero3CpuOffloadManager`."""

    def _checkpoint_tensors(
        self: Zero3CpuOffloadManager,
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        tensors: dict[str, torch.Tensor] = {}
        scalar_state: set[str] = set()
        for layer in self.optimizer.layers():
            tensors[f"{layer}.master"] = self.params.master(layer)
            for key, value in self.optimizer.layer_state(layer).items():
                tensors[f"{layer}.optim.{key}"] = value
                if value.dim() == 0:
                    scalar_state.add(key)
            grad = self.grads.get(layer)
            if grad is not None:
                tensors[f"{layer}.grad"] = grad
        return tensors, sorted(scalar_state)

    def _checkpoint_metadata(
        self: Zero3CpuOffloadManager, scalar_state: list[str]
    ) -> dict[str, Any]:
        scaler = self.updater.loss_scaler
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "library_version": zero3_offload.__version__,
            "world_size": self.mapping.world_size,
            "layers": layout_metadata(self.layouts),
            "optimizer": self.config.optimizer.to_dict(),
            "scalar_state": scalar_state,
            "optimizer_steps": self._stats.optimizer_steps,
            "timeline_step": self.timeline.step,
            "calls_since_update": self._calls_since_update,
            "backward_passes": self.grads.micro_steps,
            "loss_scaler": None if scaler is None else scaler.state_dict(),
            "config": self.config.to_dict(),
        }

    async def save_checkpoint(self: Zero3CpuOffloadManager, path: str | os.PathLike[str]) -> Path:
        """Save this rank's shards and the run's counters under ``path`` (a collective).

        Every rank writes its own file; the checkpoint is committed (renamed into
        place, ``latest`` updated) only when all ranks succeeded. A pending
        forward (activations kept for backward) is not saved.

        Args:
            path: the checkpoint root directory (created if missing).

        Returns:
            The committed checkpoint directory.

        Raises:
            StateError: between a backward whose updates started early and its
                ``optimizer_step``.
            CheckpointError: when writing or committing failed on any rank; the
                previous checkpoint stays loadable.
        """
        self._check_open()
        if self._early_lr is not None:
            raise StateError("updates of this step already started: call optimizer_step first")
        root = Path(path)
        name = checkpoint_name(self._stats.optimizer_steps, self._calls_since_update)
        tensors, scalar_state = self._checkpoint_tensors()
        meta = self._checkpoint_metadata(scalar_state)
        tmp = await prepare_save(root, name, self.comm)
        rank, world = self.mapping.rank, self.mapping.world_size
        error: Exception | None = None
        try:
            await self.workers.run(
                "checkpoint-write", "", "step", lambda: write_shard(tmp, tensors, rank, world)
            )
        except Exception as exc:  # reported to every rank below, then re-raised
            error = exc
        try:
            final = await commit_save(root, tmp, name, meta, self.comm, error is None)
        except CheckpointError as exc:
            if error is not None:
                raise CheckpointError(f"{exc}; this rank's write failed: {error}") from error
            raise
        log.info("checkpoint_saved", rank=rank, path=str(final), tensors=len(tensors))
        return final

    async def load_checkpoint(self: Zero3CpuOffloadManager, path: str | os.PathLike[str]) -> Path:
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
        error: CheckpointError | None = None
        loaded: LoadedShards | None = None
        directory = Path(path)
        try:
            directory = resolve_checkpoint(path)
            kind = self.config.optimizer.kind
            loaded = await self.workers.run(
                "checkpoint-read",
                "",
                "step",
                lambda: read_shards(directory, self.layouts, optimizer_kind=kind),
            )
            k = self.config.gradient_accumulation_steps
            done = loaded.meta["calls_since_update"]
            if done >= k:
                raise CheckpointError(
                    f"{directory}: saved after {done} micro-steps of a window, more than "
                    f"gradient_accumulation_steps={k} allows"
                )
        except CheckpointError as exc:
            error = exc
        if not await agree(self.comm, error is None):
            if error is not None:
                raise error
            raise CheckpointError(f"loading {directory} failed on another rank; nothing changed")
        assert loaded is not None
        await self._apply_checkpoint(loaded)
        log.info("checkpoint_loaded", rank=self.rank, path=str(directory))
        return directory

    async def _apply_checkpoint(self: Zero3CpuOffloadManager, loaded: LoadedShards) -> None:
        await self.prefetch.release_all(keep_persistent=False)  # gathered copies are stale
        for layer, master in loaded.masters.items():
            self.params.master(layer).copy_(master)
            self.params.refresh_compute_copy(layer)
            self.optimizer.load_layer_state(layer, loaded.optim.get(layer, {}))
        meta = loaded.meta
        self.grads.load(loaded.grads, meta["backward_passes"])
        self._calls_since_update = meta["calls_since_update"]
        self._stats.optimizer_steps = meta["optimizer_steps"]
        self.timeline.step = meta["timeline_step"]
        self._record = None
        self._early_lr = None
        self._window_started = None
        if self.updater.loss_scaler is not None and meta["loss_scaler"] is not None:
            self.updater.loss_scaler.load_state_dict(meta["loss_scaler"])
