"""One training pass's offloaded activations in a file: written as the forward goes,
read back ahead of the backward (see [Note: activation offload])."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import attrs
import torch

from zero3_offload.errors import StateError
from zero3_offload.storage.record_file import ALIGN, RecordFile, aligned

__all__ = ["ActivationSpool", "aligned_buffer"]


def aligned_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A uint8 CPU tensor of ``aligned(nbytes)`` bytes starting at a multiple of
    :data:`ALIGN` (direct I/O's rule), page-locked with ``pin``."""
    length = aligned(nbytes)
    raw = torch.empty(length + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + length]


@attrs.define
class _Record:
    offset: int  # in the file (a multiple of ALIGN)
    nbytes: int  # the tensor's bytes
    written: Future[None] | None = None
    read: Future[torch.Tensor] | None = None
    taken: bool = False


class ActivationSpool:
    """A file ``name`` under ``directory`` that holds one pass's records, appended in order.

    :meth:`put` queues a record's write on a writer thread and returns at once;
    :meth:`start_reads` reads records on a reader thread into buffers of their own,
    the nearest ones below a position first, one at least and more while the bytes read
    and not taken stay within ``read_ahead_bytes``; :meth:`take` waits for a record's
    read (starting it if it was not) and hands its bytes over. Every write and read
    reports ``(what, seconds, bytes)`` through ``on_transfer`` ("write" / "read"; the
    bytes of the tensor, not the padding). :meth:`close` waits for the threads and
    deletes the file.

    Args:
        directory: the rank's directory of the disk tiers.
        name: the file's name (it must not exist).
        read_ahead_bytes: most bytes read ahead and not taken yet (one record is always
            read ahead, whatever its size).
        pin: page-locked read buffers (a CUDA device copies them to the device).
        on_transfer: called on the I/O threads with each transfer's figures.

    Raises:
        DiskTierError: the file cannot be created (a missing directory, say).
    """

    def __init__(
        self,
        directory: Path,
        *,
        name: str,
        read_ahead_bytes: int,
        pin: bool,
        on_transfer: Callable[[str, float, int], None],
    ) -> None:
        self._file = RecordFile(directory / name, 0, holds="checkpointed activations")
        self._read_ahead_bytes = read_ahead_bytes
        self._pin = pin
        self._on_transfer = on_transfer
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="zero3-act-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="zero3-act-read")
        self._records: list[_Record] = []
        self._end = 0  # where the next record starts
        self._ahead = 0  # bytes read or being read, not taken yet
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        """The file."""
        return self._file.path

    def put(
        self,
        data: torch.Tensor,
        *,
        nbytes: int | None = None,
        ready: Callable[[], None] | None = None,
    ) -> int:
        """Queue the write of the first ``nbytes`` (default: all) of ``data`` (uint8,
        contiguous, on the CPU) as the next record; its index. ``data`` from
        :func:`aligned_buffer` is written as it is, anything else through a staging
        buffer when the file takes direct I/O. ``ready`` is called on the writer thread
        before the write (it waits for a device-to-host copy that fills ``data``)."""
        nbytes = data.numel() if nbytes is None else nbytes
        record = _Record(offset=self._end, nbytes=nbytes)
        self._end += aligned(record.nbytes)
        record.written = self._writer.submit(self._write, record, data, ready)
        self._records.append(record)
        return len(self._records) - 1

    def _write(self, record: _Record, data: torch.Tensor, ready: Callable[[], None] | None) -> None:
        if ready is not None:
            ready()
        if record.nbytes == 0:
            return
        length = aligned(record.nbytes) if self._file.direct else record.nbytes
        if data.numel() < length or data.data_ptr() % ALIGN:
            staged = aligned_buffer(record.nbytes, pin=False)
            staged[: record.nbytes].copy_(data[: record.nbytes])
            data = staged
        data = data[:length]
        start = time.perf_counter()
        self._file.write(memoryview(data.numpy()), record.offset)
        self._on_transfer("write", time.perf_counter() - start, record.nbytes)

    def finish_writes(self) -> None:
        """Wait for every queued write.

        Raises:
            DiskTierError: a write failed (the first failure).
        """
        for record in self._records:
            assert record.written is not None
            record.written.result()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def ahead_bytes(self) -> int:
        """Bytes of the records read or being read and not taken yet."""
        with self._lock:
            return self._ahead

    def start_reads(self, below: int) -> None:
        """Start reading the records before ``below``, nearest first: the nearest one not
        taken, and more while the bytes read ahead stay within the budget."""
        started = 0
        with self._lock:
            for record in reversed(self._records[:below]):
                if record.taken or record.read is not None:
                    if not record.taken:
                        started += 1
                    continue
                if started and self._ahead + record.nbytes > self._read_ahead_bytes:
                    break
                self._ahead += record.nbytes
                record.read = self._reader.submit(self._read, record)
                started += 1

    def _read(self, record: _Record) -> torch.Tensor:
        assert record.written is not None
        record.written.result()
        buffer = aligned_buffer(record.nbytes, pin=self._pin)
        if record.nbytes:
            length = buffer.numel() if self._file.direct else record.nbytes
            start = time.perf_counter()
            self._file.read(memoryview(buffer[:length].numpy()), record.offset)
            self._on_transfer("read", time.perf_counter() - start, record.nbytes)
        return buffer[: record.nbytes]

    def take(self, index: int) -> tuple[torch.Tensor, float]:
        """Record ``index``'s bytes (a uint8 CPU tensor of its own) and the seconds spent
        waiting for them.

        Raises:
            DiskTierError: its write or read failed.
            StateError: it was taken already.
        """
        record = self._records[index]
        with self._lock:
            if record.taken:
                raise StateError(
                    "an offloaded activation was read back twice: a backward through the same "
                    "graph twice (retain_graph) is not supported with offload_activations"
                )
            record.taken = True
            if record.read is None:
                self._ahead += record.nbytes
                record.read = self._reader.submit(self._read, record)
        start = time.perf_counter()
        try:
            data = record.read.result()
        finally:
            with self._lock:
                self._ahead -= record.nbytes
            record.read = None
        return data, time.perf_counter() - start

    def close(self) -> None:
        """Wait for the I/O threads (queued work is dropped) and delete the file."""
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._records.clear()
        self._file.close()
