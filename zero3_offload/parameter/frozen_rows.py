"""A frozen 2-D weight decoded at use, by blocks of rows, from its unit's gathered stored bytes.

[Note: frozen weights decoded at use]
With ``frozen_decode_at_use`` (module mode) a gathered unit keeps its frozen
parameters as they were all-gathered, in ``frozen_compression``'s format (the
*wire*), instead of decoding them into the compute dtype. The weights of the
unit's frozen plain ``nn.Linear`` and ``nn.Embedding`` modules are never bound:
each such module's ``forward`` is replaced by one that decodes the rows it needs
into this thread's scratch buffer (the whole weight when it fits in
``SCRATCH_ELEMENTS`` elements, else blocks of rows), computes with them and
lets them go; the scratch itself is freed at the end of each pass. A
linear's backward decodes its weight again for the input's gradient:
autograd saves only the wire, as a place in the unit's gathered buffers like
any saved parameter view (see [Note: saved activations] in
``execution.layer_runner``), so nothing decoded outlives one call. The unit's
other frozen parameters (norms, biases, weights shared by two modules) are
decoded when the gather completes, into a compact part of its buffer.

Every decoded element is bitwise what decoding the whole buffer gives
(:meth:`ShardCodec.decode_gathered_range_`). A weight that fits the scratch
computes with torch's own ``F.linear`` / ``F.embedding``; one split into blocks
of rows runs a matmul per block and sums its input's gradient block by block,
which may round differently from one matmul in the last bits. The cost is a
decode per use (forward, recomputation, backward) instead of one per gather;
the saving, for every such weight gathered, is the difference between the
compute dtype's bytes and the stored ones (fp32 compute with nf4 frozen
copies: about 7/8).

Not decoded at use: a weight shared by two modules (tied embeddings), a module
whose ``forward`` is already replaced on the instance, an ``nn.Embedding`` with
``max_norm`` (it writes its weight), and every weight of a unit with peft's
DoRA (which reads the base layer's weight itself).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator

import torch

from zero3_offload.parameter.codec import ShardCodec

__all__ = ["SCRATCH_ELEMENTS", "FrozenRows", "release_scratch", "reserve_scratch"]

SCRATCH_ELEMENTS = 1 << 22
"""Elements of the per-thread scratch a weight decoded at use is decoded into (16 MiB
of fp32); a larger weight is decoded in blocks of rows."""

# Every thread's scratch, by thread: released together at the end of a pass.
_scratch: dict[int, dict[tuple[torch.dtype, torch.device], torch.Tensor]] = {}
_scratch_lock = threading.Lock()


class FrozenRows:
    """Where one frozen 2-D weight lies in its unit's gathered stored bytes, and its rows'
    decode (see [Note: frozen weights decoded at use]).

    Args:
        layer: the unit whose gathered wire holds the weight.
        shape: ``(rows, cols)``.
        offset: the weight's first element in the unit's frozen layout.
        codec: the frozen parameters' codec.
        world_size: ranks whose shards the wire holds.
        shard_numel: elements of each rank's frozen shard.
        wire: unit name -> its gathered wire now (see :meth:`wire`).
        scratch_elements: most elements decoded at once (more only where one group of
            rows that starts on a block boundary is larger).
    """

    def __init__(
        self,
        *,
        layer: str,
        shape: tuple[int, int],
        offset: int,
        codec: ShardCodec,
        world_size: int,
        shard_numel: int,
        wire: Callable[[str], torch.Tensor],
        scratch_elements: int = SCRATCH_ELEMENTS,
    ) -> None:
        self.layer = layer
        self._wire = wire
        self.rows, self.cols = shape
        self._offset = offset
        self._codec = codec
        self._world_size = world_size
        self._shard_numel = shard_numel
        # Blocks start at multiples of row_step rows, so each starts on a block of the
        # codec (no partial block decoded twice).
        self.row_step = codec.align // math.gcd(self.cols, codec.align) if self.cols else 1
        fit = scratch_elements // max(self.cols, 1) // self.row_step * self.row_step
        self.block_rows = min(self.rows, max(self.row_step, fit))

    def wire(self) -> torch.Tensor:
        """The unit's gathered stored bytes now (raises when it is not gathered)."""
        return self._wire(self.layer)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype rows are decoded into (the compute dtype)."""
        return self._codec.compute_dtype

    @property
    def whole(self) -> bool:
        """Whether the whole weight is decoded at once."""
        return self.block_rows >= self.rows

    @property
    def block_numel(self) -> int:
        """Elements of the largest block decoded at once."""
        return self.block_rows * self.cols

    def blocks(self) -> Iterator[tuple[int, int]]:
        """``(first, end)`` rows of each block, in order."""
        for first in range(0, self.rows, self.block_rows):
            yield first, min(first + self.block_rows, self.rows)

    def decode(self, wire: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Rows ``[first, end)`` decoded from ``wire`` (the unit's gathered stored bytes):
        ``[end - first, cols]`` in the compute dtype, a view of this thread's scratch,
        valid until this thread's next decode."""
        numel = (end - first) * self.cols
        out = _scratch_for(numel, self._codec.compute_dtype, wire.device)
        self._codec.decode_gathered_range_(
            wire,
            out,
            world_size=self._world_size,
            shard_numel=self._shard_numel,
            start=self._offset + first * self.cols,
        )
        return out.view(end - first, self.cols)


def reserve_scratch(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Allocate this thread's scratch for ``numel`` elements now (at the start of a pass).

    So no decode allocates it inside a unit: selective checkpointing records every
    allocation a unit's forward makes and expects its recomputation to make the same
    ones, which a scratch first allocated in one of them and found in the other breaks.
    """
    _scratch_for(numel, dtype, device)


def release_scratch() -> None:
    """Free every thread's scratch (the next decode allocates it again).

    Called at the end of each pass, so that the scratch does not sit in memory
    through the loss and the top of the backward, when no weight is decoded.
    """
    with _scratch_lock:
        _scratch.clear()


def _scratch_for(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's scratch of ``dtype`` on ``device``, its first ``numel`` elements."""
    with _scratch_lock:
        buffers = _scratch.setdefault(threading.get_ident(), {})
    buf = buffers.get((dtype, device))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        buffers[(dtype, device)] = buf
    return buf[:numel]
