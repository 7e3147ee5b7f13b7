"""This rank's parameter shards: fp32 masters, their compute copies, and frozen copies.

Mirrors the parameter store of the Rust module's ``parameter_management.rs``, with real
data: the master is what the optimizer updates, the compute copy (in the
compression format of ``parameter.codec``) is what a gather sends to the device.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from zero3_offload.errors import StateError
from zero3_offload.parameter.codec import CompressedShard, ShardCodec
from zero3_offload.parameter.disk_copies import DiskComputeCopies
from zero3_offload.stats.tensor_bytes import tensor_bytes

__all__ = ["ParameterStore"]


@attrs.define
class _StoredShard:
    master: torch.Tensor  # 1D fp32 [shard_numel], on the master device
    # [shard_numel] in the compression format; may alias master; None when on disk
    compute: CompressedShard | None
    aliased: bool  # compute.payload is master itself


class ParameterStore:
    """This rank's parameter shards: the fp32 master and the compute copy of each layer.

    The master shard is what the optimizer updates, exactly, in fp32; it lives
    on the CPU when optimizer states are offloaded, else on the device. The
    compute copy is what gathering sends to the device, in the compression
    format (see ``parameter.codec``), kept on the CPU (pinned for CUDA) when
    parameters are offloaded. When the format is fp32 and both live on the
    same device, the compute copy is the master itself, not a second tensor.

    Args:
        codec: the compression format of the compute copy.
        master_device: where master shards live.
        copy_device: where compute copies live.
        pin: allocate CPU compute copies in pinned memory.
        masters_on_disk: the masters go to the disk tier once written (see [Note: disk
            tier]), so the compute copy is always a tensor of its own.
        disk: where the compute copies live when they are on disk (see [Note: compute
            copies on disk]); None keeps them in memory.
        on_put: called as ``on_put(layer, master)`` after each initial master is stored
            (the disk tier writes it to its file at once); None: nothing.
        frozen_codec: the format of frozen parameters' shards (``frozen_compression``;
            see [Note: frozen parameters]): their only copy, kept where compute copies
            are kept (in memory, also when trainable compute copies are on disk);
            None: the compute copies' codec.
    """

    def __init__(
        self,
        *,
        codec: ShardCodec,
        master_device: torch.device,
        copy_device: torch.device,
        pin: bool = False,
        masters_on_disk: bool = False,
        disk: DiskComputeCopies | None = None,
        on_put: Callable[[str, torch.Tensor], None] | None = None,
        frozen_codec: ShardCodec | None = None,
    ) -> None:
        self.codec = codec
        self.frozen_codec = frozen_codec if frozen_codec is not None else codec
        self.disk = disk
        self.masters_on_disk = masters_on_disk
        # Called as on_put(layer, master) once a layer's initial master and compute copy
        # are stored (the disk tier writes the master there and drops it from memory).
        self._on_put = on_put
        self.master_device = master_device
        self.copy_device = copy_device
        self.pin = pin and copy_device.type == "cpu"
        self._shards: dict[str, _StoredShard] = {}
        self._frozen: dict[str, CompressedShard] = {}  # layer -> its frozen shard

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.codec.compute_dtype

    def put_master(self, layer: str, master: torch.Tensor) -> None:
        """Store ``master`` (fp32, 1D) as ``layer``'s initial shard and encode its compute copy
        (later values are written into the master in place)."""
        master = master.to(self.master_device, torch.float32)
        if self.disk is not None and master.numel():
            self._shards[layer] = _StoredShard(master, None, False)
            self.disk.write(layer, master)
        elif (
            self.codec.is_identity
            and self.copy_device == self.master_device
            and not self.masters_on_disk
        ):
            self._shards[layer] = _StoredShard(master, CompressedShard(master, None), True)
            return
        else:
            copy = self.codec.empty(master.numel(), device=self.copy_device, pin=self.pin)
            self._shards[layer] = _StoredShard(master, copy, False)
            self.refresh_compute_copy(layer)
        if self._on_put is not None and master.numel():
            self._on_put(layer, master)

    def put_frozen(self, layer: str, values: torch.Tensor) -> None:
        """Encode ``values`` (this rank's 1D shard of ``layer``'s frozen parameters, any
        float dtype) as its frozen copy (blocking CPU work for a block-wise format)."""
        copy = self._frozen.get(layer)
        if copy is None:  # later values (a checkpoint's) are encoded into the same copy
            copy = self.frozen_codec.empty(values.numel(), device=self.copy_device, pin=self.pin)
            self._frozen[layer] = copy
        self.frozen_codec.encode_(values.to(self.copy_device, torch.float32), copy)

    def frozen_copy(self, layer: str) -> CompressedShard | None:
        """``layer``'s frozen shard in ``frozen_codec``'s format (None: nothing frozen)."""
        return self._frozen.get(layer)

    def frozen_layers(self) -> list[str]:
        return list(self._frozen)

    def frozen_bytes(self) -> int:
        """Bytes of the frozen shards (payload and scales), counted from the tensors."""
        return sum(copy.nbytes() for copy in self._frozen.values())

    def master(self, layer: str) -> torch.Tensor:
        """The fp32 master shard of ``layer`` (updated in place by the optimizer)."""
        return self._shards[layer].master

    def compute_copy(self, layer: str) -> CompressedShard:
        """The shard that gathering sends to the device (in memory only: a copy on disk
        is staged through :attr:`disk`)."""
        compute = self._shards[layer].compute
        if compute is None:
            raise StateError(f"the compute copy of {layer!r} is on disk: stage it")
        return compute

    def refresh_compute_copy(self, layer: str) -> None:
        """Re-encode the compute copy from the master (after the master changed).

        Blocking CPU work: the step runner calls it in a worker thread.
        """
        shard = self._shards[layer]
        if shard.aliased:
            return
        if shard.compute is None:
            assert self.disk is not None
            self.disk.write(layer, shard.master)
            return
        if self.copy_device == self.master_device:
            self.codec.encode_(shard.master, shard.compute)
            return
        staged = self.codec.empty(shard.master.numel(), device=self.master_device)
        self.codec.encode_(shard.master, staged)
        shard.compute.wire().copy_(staged.wire())

    def layers(self) -> list[str]:
        return list(self._shards)

    def master_bytes(self) -> int:
        """Bytes of all master shards in memory, counted from the tensors (with the masters
        on disk, 0: a layer's master being updated is a view of the disk tier's buffers,
        counted there)."""
        if self.masters_on_disk:
            return 0
        return sum(tensor_bytes(s.master) for s in self._shards.values())

    def compute_copy_bytes(self) -> int:
        """Bytes of compute copies that are tensors of their own (aliases count 0)."""
        return sum(
            s.compute.nbytes()
            for s in self._shards.values()
            if s.compute is not None and not s.aliased
        )
