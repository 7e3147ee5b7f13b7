"""fp32 master shards and optimizer state in a file, streamed through reused buffers.

[Note: disk tier]
With ``offload_optimizer_device="nvme"`` each rank keeps, for every layer, its
fp32 master shard and the full-size optimizer state tensors (AdamW's
``exp_avg`` and ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad, SGD's
``momentum_buffer``) in one *record* of a file, ``nvme_path/rank<N>/state.bin``.
Records are laid out in layer order, each tensor 4096-byte aligned, and the
whole file is allocated when the manager is built (``posix_fallocate``): a disk
without room fails there, naming the path and the bytes, before anything is
trained, and a write during training never meets a full disk.

A layer is *resident* while it is updated (or checkpointed): its record is read
into one of a few reused, page-aligned buffers, and the master tensor and the
state tensors the optimizer holds are pointed at views of that buffer
(``Tensor.set_``), so torch's optimizer kernel updates the buffer in place;
afterwards the record is written back and the tensors are pointed at nothing
(an empty storage: a read of a layer that is not resident fails loudly, it
never sees stale values). Reads and writes run in I/O threads with
``os.preadv`` / ``os.pwritev``, with ``O_DIRECT`` where the filesystem takes it
(page cache bypassed) and buffered otherwise; a layer's read waits only for a
free buffer, so while one layer updates the next ones are read and the last
ones written. The scalar ``step`` counters stay in memory. The bytes a layer
holds are the same whichever tier holds it, so training on disk is bitwise
training in memory.

The file lives in the rank's directory, ``nvme_path/rank<N>``, next to the
compute copies' file when those are on disk too (see [Note: compute copies on
disk]). The directory is claimed for the run (``storage.rank_directory``: one
a live run holds is refused, one a crashed run left is refused or, with
``nvme_replace_stale``, replaced) and removed when the manager closes.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import attrs
import torch

from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.errors import StateError
from zero3_offload.stats.phase import Phase
from zero3_offload.storage.record_file import ALIGN, RecordFile, aligned, record_offsets

__all__ = ["NvmeShardTier", "record_bytes"]

_F32 = 4


def _stride(numel: int) -> int:
    """Bytes from one tensor of a record to the next: ``numel`` fp32, 4096-byte aligned."""
    return aligned(numel * _F32)


def record_bytes(numel: int, state_keys: tuple[str, ...]) -> int:
    """Bytes of one layer's record: its master and its ``state_keys`` tensors of ``numel``
    fp32 elements each, every one 4096-byte aligned."""
    return (1 + len(state_keys)) * _stride(numel)


@attrs.frozen
class _Record:
    offset: int  # bytes from the start of the file
    numel: int  # elements of each tensor of the record
    stride: int  # bytes from one tensor of the record to the next (aligned)
    nbytes: int  # stride * tensors


class NvmeShardTier:
    """One rank's masters and optimizer state on disk (see [Note: disk tier]).

    Args:
        directory: the rank's directory (``nvme_path/rank<N>``); the file ``state.bin``
            is created in it.
        layers: elements of each layer's master shard, in update order.
        state_keys: the full-size state tensors of the optimizer, in record order.
        buffers: reused buffers (one resident layer each).
        io: the threads reads and writes run in.
        give_back: called after a record's state was copied in from tensors the
            optimizer created in memory (its first step), to return their freed memory
            to the OS (the engine passes the heap trim), so the state does not stay
            resident after all.

    Raises:
        DiskTierError: the file cannot be created or allocated (a full disk: the
            message gives the bytes).
    """

    def __init__(
        self,
        directory: Path,
        *,
        layers: dict[str, int],
        state_keys: tuple[str, ...],
        buffers: int,
        io: WorkerThreads,
        give_back: Callable[[], object] | None = None,
    ) -> None:
        self.state_keys = state_keys
        self._io = io
        self._give_back = give_back
        sizes = {name: record_bytes(numel, state_keys) for name, numel in layers.items()}
        offsets, end = record_offsets(sizes)
        self._records = {
            name: _Record(offsets[name], numel, _stride(numel), sizes[name])
            for name, numel in layers.items()
        }
        self.file = RecordFile(
            directory / "state.bin", end, holds="masters and optimizer state of this rank"
        )
        largest = max((r.nbytes for r in self._records.values()), default=ALIGN)
        self._buffer_bytes = largest
        # Page-aligned anonymous mappings, as O_DIRECT needs; reused for every layer.
        self._maps = [mmap.mmap(-1, largest) for _ in range(max(1, buffers))]
        self._buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._free = list(range(len(self._buffers)))
        self._free_changed = anyio.Event()
        self._resident: dict[str, int] = {}  # layer -> buffer index
        self._written: set[str] = set()  # layers whose state tensors are in the file

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the reused buffers (memory this tier holds, whatever is resident)."""
        return self._buffer_bytes * len(self._buffers)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of one of the tier's buffers."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(ptr == b.untyped_storage().data_ptr() for b in self._buffers)

    def _views(self, layer: str, index: int) -> list[torch.Tensor]:
        record, buffer = self._records[layer], self._buffers[index]
        views = []
        for k in range(1 + len(self.state_keys)):
            view = torch.empty(0, dtype=torch.float32)
            view.set_(buffer.untyped_storage(), k * record.stride // _F32, (record.numel,), (1,))
            views.append(view)
        return views

    async def _take_buffer(self) -> int:
        while not self._free:
            await self._free_changed.wait()
        return self._free.pop(0)

    def _give_buffer(self, index: int) -> None:
        self._free.append(index)
        self._free_changed.set()
        self._free_changed = anyio.Event()

    @contextlib.asynccontextmanager
    async def resident(
        self,
        layer: str,
        master: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        write: bool,
    ) -> AsyncIterator[None]:
        """Make ``layer`` resident: ``master`` and the ``state`` dict's full-size tensors
        point at its record's values for the duration; with ``write`` the record is
        written back afterwards (also the state tensors the optimizer created or replaced
        meanwhile), and the tensors point at nothing again.

        Raises:
            DiskTierError: a read or write failed (the message names the file).
        """
        if layer in self._resident:
            raise StateError(f"layer {layer!r} is already resident in the disk tier")
        index = await self._take_buffer()
        self._resident[layer] = index
        try:
            record = self._records[layer]
            await self._transfer(layer, "read", index, record)
            views = self._views(layer, index)
            master.set_(views[0])
            if layer in self._written:
                for key, view in zip(self.state_keys, views[1:], strict=True):
                    state[key] = view
            yield
            if write:
                fresh = self._collect(layer, state, views[1:])
                await self._transfer(layer, "write", index, record)
                if fresh and self._give_back is not None:
                    self._give_back()
        finally:
            master.set_(torch.empty(0, dtype=master.dtype))
            for key in self.state_keys:
                state.pop(key, None)
            del self._resident[layer]
            self._give_buffer(index)

    def _collect(
        self, layer: str, state: dict[str, torch.Tensor], views: list[torch.Tensor]
    ) -> bool:
        """Copy the state tensors into the record where they are not its views already
        (the optimizer's first step creates them; a checkpoint load replaces them).
        Returns whether any was copied (a tensor of its own in memory, now dropped)."""
        present = [k for k in self.state_keys if k in state]
        if not present:  # no step yet, or a checkpoint without state: the part is unused
            self._written.discard(layer)
            return False
        if len(present) != len(self.state_keys):
            raise StateError(
                f"the optimizer state of {layer!r} has {sorted(state)}; the disk tier "
                f"expects {list(self.state_keys)}"
            )
        fresh = False
        for key, view in zip(self.state_keys, views, strict=True):
            tensor = state[key]
            if tensor.data_ptr() != view.data_ptr():
                view.copy_(tensor)
                # Drop the tensor of its own now, so that the heap's pages go back to the
                # OS (give_back, after the write) while the layer is still resident.
                state[key] = view
                fresh = True
        self._written.add(layer)
        return fresh

    def has_state(self, layer: str) -> bool:
        """Whether ``layer``'s record holds optimizer state (it has been stepped)."""
        return layer in self._written

    def forget_state(self) -> None:
        """No layer has optimizer state any more (a reset): the records' state parts are
        unused until the next step writes them."""
        self._written.clear()

    def _io_blocking(self, what: str, index: int, offset: int, nbytes: int) -> None:
        """Read or write ``nbytes`` of the file at ``offset`` from or into the start of
        buffer ``index``, on this thread."""
        view = memoryview(self._maps[index])[:nbytes]
        if what == "read":
            self.file.read(view, offset)
        else:
            self.file.write(view, offset)

    async def _transfer(self, layer: str, what: str, index: int, record: _Record) -> None:
        await self._io.run(
            f"nvme-{what}",
            layer,
            Phase.STEP,
            lambda: self._io_blocking(what, index, record.offset, record.nbytes),
        )

    def write_initial(self, layer: str, master: torch.Tensor) -> None:
        """Write ``layer``'s initial master values on this thread, then point ``master`` at
        nothing: the file holds it from now on. Only the master's part of the record is
        written: the state part is unused until the layer's first step writes it."""
        index = self._free[0]
        record = self._records[layer]
        self._views(layer, index)[0].copy_(master)
        self._io_blocking("write", index, record.offset, record.stride)
        master.set_(torch.empty(0, dtype=master.dtype))

    def close(self) -> None:
        """Close the file and delete it."""
        self.file.close()
