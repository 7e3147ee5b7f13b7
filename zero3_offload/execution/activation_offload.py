"""Checkpointed layers' saved inputs in host memory or in a file (``offload_activations``).

[Note: activation offload]
Under activation checkpointing (module mode's non-reentrant ``torch.utils.checkpoint``,
see ``_checkpointed`` in ``execution.module_runner``) what a checkpointed unit keeps
from its forward until its recomputation is its inputs: the positional tensor
arguments are saved through autograd's saved-tensor hooks (a transformers decoder
layer's hidden states; keyword arguments, such as the position embeddings and the mask
every layer shares, stay in the checkpoint's closure). At long sequence lengths these
hidden states, one per layer, are what a training forward accumulates. With
``offload_activations`` each unit's checkpoint runs inside :meth:`ActivationOffload.saving`,
whose hooks move those saved inputs away when the forward saves them and bring them
back when the unit's recomputation asks for them (its first unpack, as its backward
starts). Chain mode's recomputation (see [Note: backward by recomputation] in
``execution.layer_runner``) keeps each layer's input: it goes through
:meth:`ActivationOffload.offload` after the layer's forward and
:meth:`ActivationOffload.restore` before its recomputation, the same way:

- ``"cpu"``: to host memory. On a CUDA device into a page-locked buffer, copied on a
  side stream that first waits for the compute stream (the device tensor is marked used
  by that stream, so its memory is reused only after the copy); brought back with a copy
  on the compute stream after the side stream's event. On the CPU device the device is
  host memory: the input is copied once into a tensor of its own (the original is freed;
  nothing is saved, a memcpy is spent) and handed back as it is.
- ``"nvme"``: appended to one file per training forward, ``activations-<0|1>.bin`` in
  the rank's disk-tier directory, by a writer thread while the forward goes on (on a
  CUDA device after a copy into a page-locked buffer on the side stream); the end of the forward
  waits for the writes (a failure raises there), then a reader thread reads the last
  units back into buffers of their own, and each unit's unpack starts the reads of the
  units before it: one unit ahead at least, more while the bytes read and not yet used
  stay within the read-ahead budget (``activation_read_ahead_bytes``), so a read
  overlaps the backward of the unit after it. The file is deleted at the end of the
  backward (or its failure), when the forward fails, when a later training forward
  completes (it becomes the pending forward: the earlier one can no longer be
  backpropagated through the manager; one that fails leaves the pending forward's
  file, hence two names), and at ``close()``.

The bytes come back as they left (the same values in a tensor of the same shape and
dtype, contiguous), so the results are bitwise those of keeping them. Counted per
direction, from each tensor's ``numel() * element_size()`` (a file's 4 KiB padding is
not counted): copies or writes out, copies or reads back, with their seconds (CUDA
copies: their events' elapsed time) and the seconds the backward waited for reads.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import attrs
import torch

from zero3_offload.config import OffloadActivations
from zero3_offload.errors import ConfigError, StateError
from zero3_offload.stats.performance import OperationStats
from zero3_offload.storage.activation_spool import ActivationSpool, aligned_buffer

__all__ = ["ActivationOffload"]

_OUT, _IN = "activation_offload", "activation_restore"


@attrs.define
class _Pass:
    """What one training forward offloaded."""

    spool: ActivationSpool | None = None  # "nvme": its file
    pending: int = 0  # bytes offloaded and not brought back yet


@attrs.frozen
class _Offloaded:
    """What autograd holds in place of one saved input."""

    forward: int  # the training forward that saved it
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    host: torch.Tensor | None = None  # "cpu": the copy
    ready: Any = None  # "cpu" on CUDA: the event after the copy to the host
    index: int = -1  # "nvme": the record in the pass's file


class ActivationOffload:
    """Moves checkpointed units' saved inputs to host memory or a file and back (see
    [Note: activation offload]).

    Args:
        place: ``OffloadActivations.CPU`` or ``OffloadActivations.NVME``.
        device: the compute device.
        directory: the rank's disk-tier directory (``"nvme"``).
        read_ahead_bytes: most bytes read back ahead of the backward and not used yet
            (``"nvme"``; one unit is always read ahead).

    Raises:
        ConfigError: ``place`` is ``NONE``, or ``"nvme"`` without ``directory``.
    """

    def __init__(
        self,
        *,
        place: OffloadActivations,
        device: torch.device,
        directory: Path | None = None,
        read_ahead_bytes: int,
    ) -> None:
        if place is OffloadActivations.NONE:
            raise ConfigError("ActivationOffload needs offload_activations 'cpu' or 'nvme'")
        if place is OffloadActivations.NVME and directory is None:
            raise ConfigError("offload_activations='nvme' needs the disk tier's directory")
        self.place = place
        self._device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._directory = directory
        self._read_ahead_bytes = read_ahead_bytes
        self._passes: dict[int, _Pass] = {}  # training forward -> what it offloaded
        self._forwards = 0  # training forwards begun
        self._current: int | None = None  # the training forward running
        self._lock = threading.Lock()
        # direction -> [operations, seconds, bytes]; the backward's wait for reads
        self._totals: dict[str, list[float]] = {_OUT: [0, 0.0, 0], _IN: [0, 0.0, 0]}
        self._wait_seconds = 0.0
        self._seen: dict[str, float] = self._figures()
        self._timings: list[tuple[str, Any, Any]] = []  # CUDA copies: (direction, start, end)

    # --------------------------------------------------------------- the pass

    def saving(self) -> AbstractContextManager[None]:
        """The saved-tensor hooks a checkpointed unit's checkpoint call runs in: what it
        saves (its positional inputs) is offloaded during a training forward."""
        return torch.autograd.graph.saved_tensors_hooks(self.offload, self.restore)

    def begin_forward(self) -> None:
        """A training forward starts (what it saves is offloaded until it ends)."""
        self._forwards += 1
        with self._lock:
            self._passes[self._forwards] = _Pass()
        self._current = self._forwards

    def end_forward(self) -> None:
        """The training forward ended and is now the pending one: its writes are waited
        for, the earlier forward's offloaded inputs dropped, the last units' reads start.

        Raises:
            DiskTierError: a write failed (this forward's file is deleted; the earlier
                forward stays).
        """
        current, self._current = self._current, None
        assert current is not None
        spool = self._passes[current].spool
        if spool is not None:
            try:
                spool.finish_writes()
            except BaseException:
                self._drop(current)
                raise
        for earlier in [n for n in self._passes if n != current]:
            self._drop(earlier)
        if spool is not None:
            spool.start_reads(len(spool))

    def abandon_forward(self) -> None:
        """The training forward failed: what it offloaded is dropped (the pending forward
        before it stays)."""
        current, self._current = self._current, None
        if current is not None:
            self._drop(current)

    def end_backward(self) -> None:
        """The backward ended (or failed): every offloaded input is dropped, files deleted."""
        self._current = None
        for number in list(self._passes):
            self._drop(number)
        self._resolve_timings()

    def close(self) -> None:
        """Delete what is left (the file of a forward without its backward)."""
        self.end_backward()

    def offloaded_bytes(self) -> int:
        """Bytes of checkpointed inputs offloaded now (in host memory with ``"cpu"``, in
        the file with ``"nvme"``), not yet brought back."""
        with self._lock:
            return sum(p.pending for p in self._passes.values())

    def _drop(self, number: int) -> None:
        with self._lock:
            done = self._passes.pop(number, None)
        if done is not None and done.spool is not None:
            done.spool.close()

    # ------------------------------------------------------------------ hooks

    def offload(self, t: torch.Tensor) -> object:
        """Move ``t`` (a checkpointed input, saved during a training forward) to its
        place; what stands for it until :meth:`restore`. Outside a training forward
        ``t`` itself.

        Raises:
            DiskTierError: the pass's file cannot be created.
        """
        current = self._current
        if current is None:
            return t  # not a training forward's save (nothing to offload)
        data = t.detach()
        nbytes = data.numel() * data.element_size()
        handle = _Offloaded(forward=current, shape=data.shape, dtype=data.dtype, nbytes=nbytes)
        record = self._passes[current]
        if self.place is OffloadActivations.CPU:
            host, ready = self._to_host(data, None)
            handle = attrs.evolve(handle, host=host, ready=ready)
        else:
            if record.spool is None:
                assert self._directory is not None
                record.spool = ActivationSpool(
                    self._directory,
                    name=f"activations-{current % 2}.bin",  # the pending forward's is the other
                    read_ahead_bytes=self._read_ahead_bytes,
                    pin=self._cuda,
                    on_transfer=self._count_io,
                )
            if self._cuda:  # into a buffer direct I/O writes as it is
                buffer = aligned_buffer(nbytes, pin=True)
                _, ready = self._to_host(data, buffer)
                index = record.spool.put(buffer, nbytes=nbytes, ready=ready.synchronize)
            else:
                index = record.spool.put(data.contiguous().view(-1).view(torch.uint8))
            handle = attrs.evolve(handle, index=index)
        with self._lock:
            record.pending += nbytes
        return handle

    def _to_host(self, data: torch.Tensor, buffer: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """A host copy of ``data`` (contiguous; on CUDA page-locked, in the uint8
        ``buffer`` when one is given, else counted as offloaded) and, on CUDA, the event
        after the copy."""
        if not self._cuda:
            start = time.perf_counter()
            host = data.clone(memory_format=torch.contiguous_format)
            self._count(_OUT, time.perf_counter() - start, host.numel() * host.element_size())
            return host, None
        nbytes = data.numel() * data.element_size()
        if buffer is not None:
            host = buffer[:nbytes].view(data.dtype).view(data.shape)
        else:
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        with torch.cuda.stream(self._stream):
            start.record()
            host.copy_(data, non_blocking=True)
            end.record()
        data.record_stream(self._stream)  # its memory is reused only after the copy
        if buffer is None:  # to the file: the write is what is counted
            self._timing(_OUT, start, end, nbytes)
        return host, end

    def restore(self, saved: object) -> torch.Tensor:
        """The tensor :meth:`offload` returned ``saved`` for, back on the device (bitwise
        its values; contiguous).

        Raises:
            StateError: its forward's offloaded inputs were dropped (a later forward
                became the pending one, or its backward ran already).
            DiskTierError: its write or read failed.
        """
        if not isinstance(saved, _Offloaded):
            assert isinstance(saved, torch.Tensor)
            return saved
        record = self._passes.get(saved.forward)
        if record is None:
            raise StateError(
                "an offloaded activation of an earlier training forward was asked for: its "
                "offloaded inputs were dropped when a later forward completed or its backward "
                "ended; run one backward of the last training forward"
            )
        with self._lock:
            record.pending -= saved.nbytes
        if self.place is OffloadActivations.CPU:
            assert saved.host is not None
            if not self._cuda:
                self._count(_IN, 0.0, saved.nbytes)  # host memory already: handed back
                return saved.host
            return self._to_device(saved.host, saved.ready, count=True)
        spool = record.spool
        assert spool is not None
        data, waited = spool.take(saved.index)
        spool.start_reads(saved.index)
        with self._lock:
            self._wait_seconds += waited
        host = data.view(saved.dtype).view(saved.shape)
        return self._to_device(host, None, count=False) if self._cuda else host

    def _to_device(self, host: torch.Tensor, after: Any, *, count: bool) -> torch.Tensor:
        current = torch.cuda.current_stream(self._device)
        if after is not None:
            current.wait_event(after)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record(current)
        out = host.to(self._device, non_blocking=True)
        end.record(current)
        if count:
            self._timing(_IN, start, end, host.numel() * host.element_size())
        return out

    # ---------------------------------------------------------------- figures

    def _count(self, direction: str, seconds: float, nbytes: int, operations: int = 1) -> None:
        with self._lock:
            total = self._totals[direction]
            total[0] += operations
            total[1] += seconds
            total[2] += nbytes

    def _count_io(self, what: str, seconds: float, nbytes: int) -> None:
        self._count(_OUT if what == "write" else _IN, seconds, nbytes)

    def _timing(self, direction: str, start: Any, end: Any, nbytes: int) -> None:
        """A CUDA copy: its bytes now, its seconds once its events are read."""
        self._count(direction, 0.0, nbytes)
        self._timings.append((direction, start, end))

    def _resolve_timings(self) -> None:
        timings, self._timings = self._timings, []
        for direction, start, end in timings:
            end.synchronize()
            self._count(direction, start.elapsed_time(end) / 1000.0, 0, operations=0)

    def transfers(self) -> dict[str, OperationStats]:
        """Totals since construction: ``activation_offload`` (copies to the host or
        writes to the file) and ``activation_restore`` (copies or reads back)."""
        with self._lock:
            return {
                key: OperationStats(operations=int(ops), time=seconds, bytes=int(nbytes))
                for key, (ops, seconds, nbytes) in self._totals.items()
            }

    def _figures(self) -> dict[str, float]:
        with self._lock:
            out, back = self._totals[_OUT], self._totals[_IN]
            return {
                "offload_bytes": out[2],
                "offload_seconds": out[1],
                "restore_bytes": back[2],
                "restore_seconds": back[1],
                "restore_wait_seconds": self._wait_seconds,
            }

    def step_figures(self) -> dict[str, Any]:
        """The ``activations`` field of a ``step`` event: bytes and seconds out and back
        since the previous call, the backward's wait for reads, and the place."""
        now = self._figures()
        delta = {key: now[key] - self._seen[key] for key in now}
        self._seen = now
        return {"place": self.place.value, **delta}
