"""Compute copies in a file, read into reused buffers ahead of their gathers.

[Note: compute copies on disk]
With ``offload_param_device="nvme"`` the compute copies of this rank's shards
(what an all-gather sends, in the compression format of ``parameter.codec``)
live in one preallocated file, ``nvme_path/rank<N>/params.bin``: one record per
layer, 4096-byte aligned, written when a layer's master is set or updated (the
encoding goes through a page-aligned scratch buffer; there are as many as writes
ran at once).

A gather needs its layer's copy in memory. The copy is read into one of a few
reused, page-aligned buffers by I/O threads: the prefetch scheduler asks for
the layers after its gather window (:meth:`DiskComputeCopies.read_ahead`), and a
gather asks for its own layer when it is launched (:meth:`DiskComputeCopies.stage`).
The launch itself does not wait for the read: collectives start on the group's
launcher thread in program order (see ``comm.collectives``), and that thread
waits for the read right before the all-gather that sends it, so the order of
collectives is the same on every rank whatever the disk's timing. When the
collective has completed the buffer is free again (it stays cached for the
layer until another layer needs it, so a backward right after its forward can
reuse it without a read).

Every record carries a version, bumped by each write; a read remembers the
version it read, and a read that finished before the layer's last write
(a read-ahead across an optimizer step) is read again where it is used. Reads and
writes of one layer hold its lock, so a read never sees a half-written record.
The bytes sent are the bytes the in-memory copy would hold, so gathering from
disk is bitwise gathering from memory.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import mmap
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import attrs
import torch

from zero3_offload.errors import DiskTierError, StateError
from zero3_offload.parameter.codec import CompressedShard, ShardCodec
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline
from zero3_offload.storage.record_file import ALIGN, RecordFile, aligned, record_offsets

__all__ = ["DiskComputeCopies", "StagedCopy"]


@attrs.frozen
class _Record:
    offset: int  # bytes from the start of the file
    numel: int  # elements of the shard
    nbytes: int  # bytes read and written: the wire bytes, rounded up to ALIGN


@attrs.define
class _Entry:
    index: int  # the buffer
    read: concurrent.futures.Future[int]  # the record's version it holds, once read
    in_use: bool = False  # a gather sends it; the buffer cannot be reused
    used_at: int = 0  # when it was last staged or released (for eviction, oldest first)


@attrs.define
class StagedCopy:
    """A layer's compute copy being read for its gather; see :meth:`wait`."""

    layer: str
    _copies: DiskComputeCopies
    _entry: _Entry
    _version: int  # the record's version when the gather was launched
    _phase: Phase  # the phase of the gather (labels a read made again in wait())

    def wait(self) -> CompressedShard:
        """Block until the copy is in memory (read again if it was read before its last
        write) and return it, a view of the buffer. Runs on the launcher thread."""
        return self._copies._wait(self.layer, self._entry, self._version, self._phase)

    def release(self) -> None:
        """The gather is done with the buffer (on the event loop)."""
        self._copies._release(self._entry)


class DiskComputeCopies:
    """This rank's compute copies on disk (see [Note: compute copies on disk]).

    Args:
        directory: the rank's directory; ``params.bin`` is created in it.
        codec: the format of the copies.
        layers: elements of each layer's shard.
        buffers: reused buffers to start with (more are made when every one is held
            by a gather in flight).
        timeline: where each read is recorded.
        threads: I/O threads for reads.
        pin: register the read buffers with CUDA as page-locked memory (for a CUDA
            device: the copy to the device then runs by DMA from the buffer).

    Raises:
        DiskTierError: the file cannot be created or allocated.
    """

    def __init__(
        self,
        directory: Path,
        *,
        codec: ShardCodec,
        layers: dict[str, int],
        buffers: int,
        timeline: Timeline,
        threads: int = 2,
        pin: bool = False,
    ) -> None:
        self.codec = codec
        self._pin = pin
        self._timeline = timeline
        sizes = {name: aligned(codec.wire_nbytes(numel)) for name, numel in layers.items()}
        offsets, end = record_offsets(sizes)
        self._records = {
            name: _Record(offsets[name], numel, sizes[name]) for name, numel in layers.items()
        }
        self.file = RecordFile(directory / "params.bin", end, holds="compute copies of this rank")
        self._record_bytes = max((r.nbytes for r in self._records.values()), default=ALIGN)
        self._maps: list[mmap.mmap] = []
        self._buffers: list[torch.Tensor] = []
        self._free: list[int] = []
        for _ in range(max(1, buffers)):
            self._free.append(self._new_buffer())
        self._entries: dict[str, _Entry] = {}  # layer -> its cached or in-use buffer
        self._clock = itertools.count(1)
        self._versions = dict.fromkeys(self._records, 0)
        self._locks = {name: threading.Lock() for name in self._records}
        # Page-aligned encoding buffers of writes: as many as writes ran at once.
        self._spare: list[mmap.mmap] = []
        self._scratch_count = 0
        self._scratch_lock = threading.Lock()
        self._io = concurrent.futures.ThreadPoolExecutor(threads, "zero3-param-read")

    def _new_buffer(self) -> int:
        # Page-aligned anonymous mappings, as O_DIRECT needs.
        self._maps.append(mmap.mmap(-1, self._record_bytes))
        buffer = torch.frombuffer(self._maps[-1], dtype=torch.uint8)
        if self._pin:
            code = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
            if int(code) != 0:
                raise DiskTierError(f"cannot pin a read buffer of {buffer.numel()} bytes: {code}")
        self._buffers.append(buffer)
        return len(self._buffers) - 1

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the read buffers and of the writes' encoding buffers."""
        return self._record_bytes * (len(self._buffers) + self._scratch_count)

    def _shard(self, layer: str, buffer: torch.Tensor) -> CompressedShard:
        """The compressed shard of ``layer`` laid out at the start of ``buffer``."""
        return self.codec.view(buffer, self._records[layer].numel)

    # ------------------------------------------------------------ writes

    def write(self, layer: str, master: torch.Tensor) -> None:
        """Encode ``master`` (fp32, 1D) into ``layer``'s record, on this thread.

        Raises:
            DiskTierError: the write failed.
        """
        record = self._records[layer]
        with self._scratch_lock:  # a spare scratch buffer, or a new one per writer at once
            scratch = self._spare.pop() if self._spare else None
            if scratch is None:
                self._scratch_count += 1
        if scratch is None:
            scratch = mmap.mmap(-1, self._record_bytes)
        try:
            buffer = torch.frombuffer(scratch, dtype=torch.uint8)
            self.codec.encode_(master, self._shard(layer, buffer))
            with self._locks[layer]:
                self.file.write(memoryview(scratch)[: record.nbytes], record.offset)
                self._versions[layer] += 1
        finally:
            with self._scratch_lock:
                self._spare.append(scratch)

    # ------------------------------------------------------------ reads

    def _read(self, layer: str, index: int, phase: Phase) -> int:
        """Read ``layer``'s record into buffer ``index`` on this thread; its version."""
        record = self._records[layer]
        start = time.perf_counter()
        with self._locks[layer]:
            self.file.read(memoryview(self._maps[index])[: record.nbytes], record.offset)
            version = self._versions[layer]
        worker = f"io-{threading.get_native_id()}"
        self._timeline.add("nvme-read", layer, phase, start, time.perf_counter(), worker)
        return version

    def _take(self, *, grow: bool, keep: set[str]) -> int | None:
        """A buffer for a new read: a free one, else the oldest cached one not in use
        (nor in ``keep``), else with ``grow`` a new one (None without)."""
        if self._free:
            return self._free.pop()
        idle = [
            (entry.used_at, name)
            for name, entry in self._entries.items()
            if not entry.in_use and entry.read.done() and name not in keep
        ]
        if idle:
            return self._entries.pop(min(idle)[1]).index
        return self._new_buffer() if grow else None

    def _start_read(self, layer: str, index: int, phase: Phase) -> _Entry:
        read = self._io.submit(self._read, layer, index, phase)
        entry = _Entry(index, read, used_at=next(self._clock))
        self._entries[layer] = entry
        return entry

    def read_ahead(self, layers: Iterable[str], phase: Phase) -> None:
        """Start reading ``layers`` (in that order) while buffers are free or hold other
        layers no gather uses; a layer read or being read already is skipped. ``phase``
        labels the reads in the timeline."""
        wanted = [name for name in layers if name in self._records]
        for name in wanted:
            entry = self._entries.get(name)
            if entry is not None:
                if not entry.in_use and self._stale(name, entry):
                    entry.read = self._io.submit(self._read, name, entry.index, phase)
                continue
            index = self._take(grow=False, keep=set(wanted))
            if index is None:
                return
            self._start_read(name, index, phase)

    def _stale(self, layer: str, entry: _Entry) -> bool:
        """Whether ``entry`` finished reading ``layer`` before the layer's last write."""
        read = entry.read
        return read.done() and read.exception() is None and read.result() != self._versions[layer]

    def stage(self, layer: str, phase: Phase) -> StagedCopy:
        """``layer``'s copy for a gather launched now (in ``phase``): its read, started here
        unless a read-ahead started it. Release it once the gather's collective completed."""
        entry = self._entries.get(layer)
        if entry is None:
            index = self._take(grow=True, keep=set())
            assert index is not None
            entry = self._start_read(layer, index, phase)
        if entry.in_use:
            raise StateError(f"the compute copy of {layer!r} is already being gathered")
        if self._stale(layer, entry):
            entry.read = self._io.submit(self._read, layer, entry.index, phase)
        entry.in_use = True
        entry.used_at = next(self._clock)
        return StagedCopy(layer, self, entry, self._versions[layer], phase)

    def _wait(self, layer: str, entry: _Entry, version: int, phase: Phase) -> CompressedShard:
        if entry.read.result() != version:  # read before the layer's last write
            entry.read = concurrent.futures.Future()
            entry.read.set_result(self._read(layer, entry.index, phase))
        return self._shard(layer, self._buffers[entry.index])

    def _release(self, entry: _Entry) -> None:
        entry.in_use = False
        entry.used_at = next(self._clock)

    def close(self) -> None:
        """Stop the I/O threads, close the file and delete it."""
        self._io.shutdown(wait=True, cancel_futures=True)
        if self._pin:
            for buffer in self._buffers:
                torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
            self._pin = False
        self.file.close()
