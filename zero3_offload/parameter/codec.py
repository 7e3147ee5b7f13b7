"""The compute copy of a parameter shard, in its compression format.

The fp32 master shard is never compressed. What travels to the device for
gathering is a copy in the configured format, stored in its real dtype so its
byte count is what it costs:

- ``NONE``: the compute dtype itself (fp32, bf16 or fp16).
- ``FP16`` / ``BF16``: 2 bytes per element.
- ``INT8``: 1 byte per element plus one fp32 scale per block of
  ``block_size`` elements. Symmetric absmax quantisation per block:
  ``scale = absmax / 127``, ``q = round(x / scale)``, ``x̂ = q * scale``, so
  ``|x - x̂| <= scale / 2 = absmax / 254`` for every element. Scales and
  payload share one byte buffer (scales first), so the shard is one tensor.
- ``NF4``: the 4-bit NormalFloat code of QLoRA, two indices per byte, one
  fp32 absmax scale per block of 64 elements (whatever ``block_size`` says),
  scales first in one byte buffer as for INT8: ``ceil(n / 2) + 4 * ceil(n /
  64)`` bytes (see [Note: nf4] in ``parameter.nf4``). Meant for frozen
  parameters, whose shards start at block boundaries.

Encoding runs on the CPU (in a worker thread) into preallocated buffers;
decoding runs on the device after the copy, into a preallocated buffer of the
compute dtype. With ``gather_compression`` the stored bytes themselves are
all-gathered and decoded afterwards, rank by rank (:meth:`ShardCodec.decode_gathered_`).
"""

from __future__ import annotations

import threading

import attrs
import torch

from zero3_offload.config import CpuCompressionMethod
from zero3_offload.errors import InputError
from zero3_offload.parameter.nf4 import (
    NF4_BLOCK,
    nf4_decode_,
    nf4_encode_,
    nf4_nbytes,
    nf4_split,
)

__all__ = ["CompressedShard", "ShardCodec"]

_INT8_MAX = 127.0
# INT8 encoding works through the shard in chunks of this many elements, so its
# scratch space is small and reused instead of a fresh shard-sized temporary.
_CHUNK_ELEMENTS = 1 << 20
_scratch = threading.local()


def _scratch_buffer(numel: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, _CHUNK_ELEMENTS), dtype=torch.float32)
        _scratch.buf = buf
    return buf[:numel]


def _quantize(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    # x: [rows, block] fp32; q: same shape int8; scales: [rows] fp32.
    on_cpu = x.device.type == "cpu"
    tmp = _scratch_buffer(x.numel()).view_as(x) if on_cpu else torch.empty_like(x)
    torch.abs(x, out=tmp)
    torch.amax(tmp, dim=1, out=scales)
    scales.div_(_INT8_MAX)
    # An all-zero block has scale 0; dividing its zeros by the smallest normal
    # float gives 0, not nan.
    safe = scales.clamp(min=torch.finfo(torch.float32).tiny)
    torch.div(x, safe.unsqueeze(1), out=tmp)
    q.copy_(tmp.round_().clamp_(-_INT8_MAX, _INT8_MAX))


@attrs.define
class CompressedShard:
    """One shard's compute copy in its storage format.

    An ``INT8`` or ``NF4`` shard's scales and payload are views of one byte buffer,
    ``packed`` (the scales' bytes first, so they are 4-byte aligned), so the whole
    shard is one tensor to copy to the device and to all-gather (see :meth:`wire`).
    """

    payload: torch.Tensor  # 1D [numel] in the storage dtype (NF4: uint8 [ceil(numel / 2)])
    scales: torch.Tensor | None  # 1D fp32 [ceil(numel / block)], INT8 and NF4 only
    packed: torch.Tensor | None = None  # 1D uint8 that scales and payload view
    nf4_numel: int | None = None  # elements of an NF4 shard (two per payload byte)

    @classmethod
    def from_packed(
        cls, packed: torch.Tensor, numel: int, blocks: int, *, nf4: bool = False
    ) -> CompressedShard:
        """An ``INT8`` (or ``nf4``: ``NF4``) shard of ``numel`` elements and ``blocks``
        scales viewing ``packed``.

        ``packed`` is 1D uint8: the scales (``4 * blocks`` bytes), then the payload
        (INT8: ``numel`` bytes; NF4: ``ceil(numel / 2)``). Where it does not start at a
        multiple of 4 bytes of its storage (a rank's part of a gathered buffer), the
        scales are a copy, not a view.
        """
        if nf4:
            scales, payload = nf4_split(packed, numel)
            return cls(payload, scales, packed, nf4_numel=numel)
        scale_bytes = packed[: 4 * blocks]
        if scale_bytes.storage_offset() % 4:
            scale_bytes = scale_bytes.clone()
        return cls(packed[4 * blocks :].view(torch.int8), scale_bytes.view(torch.float32), packed)

    @property
    def numel(self) -> int:
        """Elements of the shard (an NF4 payload byte holds two)."""
        return self.payload.numel() if self.nf4_numel is None else self.nf4_numel

    def nbytes(self) -> int:
        """Bytes of the payload and scales, counted from the tensors."""
        total = self.payload.numel() * self.payload.element_size()
        if self.scales is not None:
            total += self.scales.numel() * self.scales.element_size()
        return total

    def wire(self) -> torch.Tensor:
        """The whole shard as one 1D uint8 tensor (a view): what a compressed gather sends.

        Raises:
            InputError: for an ``INT8`` shard built without its packed buffer.
        """
        if self.scales is None:
            return self.payload.view(torch.uint8)
        if self.packed is None:
            raise InputError(
                "an INT8 or NF4 shard without its packed buffer cannot be sent as one tensor"
            )
        return self.packed

    def to(self, device: torch.device, *, non_blocking: bool = False) -> CompressedShard:
        """A copy on ``device`` (the same object when already there); a packed shard is
        copied as one tensor."""
        if self.payload.device == device:
            return self
        if self.packed is not None and self.scales is not None:
            packed = self.packed.to(device, non_blocking=non_blocking)
            return CompressedShard.from_packed(
                packed, self.numel, self.scales.numel(), nf4=self.nf4_numel is not None
            )
        scales = None if self.scales is None else self.scales.to(device, non_blocking=non_blocking)
        return CompressedShard(self.payload.to(device, non_blocking=non_blocking), scales)


class ShardCodec:
    """Encodes fp32 master shards into a compression format and decodes them back.

    Args:
        method: the compression format.
        compute_dtype: dtype the device computes in (the decode target).
        block_size: INT8 block length (elements sharing one scale); NF4's is 64.
    """

    def __init__(
        self, method: CpuCompressionMethod, compute_dtype: torch.dtype, *, block_size: int = 256
    ) -> None:
        self.method = method
        self.compute_dtype = compute_dtype
        self._nf4 = method is CpuCompressionMethod.NF4
        self.block_size = NF4_BLOCK if self._nf4 else block_size
        self.storage_dtype = method.storage_dtype(compute_dtype)
        # Scales and payload in one byte buffer.
        self._packed = self._nf4 or method is CpuCompressionMethod.INT8

    @property
    def compute_itemsize(self) -> int:
        """Bytes per element of the compute dtype."""
        return torch.empty((), dtype=self.compute_dtype).element_size()

    @property
    def is_identity(self) -> bool:
        """True when the compute copy of an fp32 master is the master itself."""
        return self.storage_dtype == torch.float32 and self.compute_dtype == torch.float32

    @property
    def align(self) -> int:
        """Elements a block-wise format's blocks hold (1 for a plain dtype): where shards of
        frozen parameters may start (see [Note: frozen parameters])."""
        return self.block_size if self._packed else 1

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def empty(self, numel: int, *, device: torch.device, pin: bool = False) -> CompressedShard:
        """A preallocated compressed shard of ``numel`` elements."""
        if self._packed:
            packed = torch.empty(
                self.wire_nbytes(numel), dtype=torch.uint8, device=device, pin_memory=pin
            )
            return self.view(packed, numel)
        payload = torch.empty(numel, dtype=self.storage_dtype, device=device, pin_memory=pin)
        return CompressedShard(payload, None)

    def view(self, buffer: torch.Tensor, numel: int) -> CompressedShard:
        """The shard of ``numel`` elements laid out at the start of ``buffer`` (1D uint8,
        at least :meth:`wire_nbytes` long) as :meth:`CompressedShard.wire` lays it out."""
        if self._packed:
            return CompressedShard.from_packed(
                buffer[: self.wire_nbytes(numel)], numel, self.num_blocks(numel), nf4=self._nf4
            )
        return CompressedShard(buffer[: self.wire_nbytes(numel)].view(self.storage_dtype), None)

    def wire_nbytes(self, numel: int) -> int:
        """Bytes :meth:`CompressedShard.wire` has for a shard of ``numel`` elements."""
        if self._nf4:
            return nf4_nbytes(numel)
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        scales = 4 * self.num_blocks(numel) if self.method is CpuCompressionMethod.INT8 else 0
        return itemsize * numel + scales

    def encode_(self, master: torch.Tensor, out: CompressedShard) -> None:
        """Write ``master`` (1D fp32) into ``out`` in the storage format.

        Safe to call from several worker threads at once (INT8 and NF4 scratch space
        is per thread).
        """
        if out.scales is None:
            out.payload.copy_(master)
            return
        if self._nf4:
            nf4_encode_(master, out.scales, out.payload)
            return
        block = self.block_size
        full = master.numel() // block * block
        rows = max(1, _CHUNK_ELEMENTS // block)
        for r0 in range(0, full // block, rows):
            r1 = min(r0 + rows, full // block)
            _quantize(
                master[r0 * block : r1 * block].view(-1, block),
                out.payload[r0 * block : r1 * block].view(-1, block),
                out.scales[r0:r1],
            )
        if full < master.numel():
            _quantize(
                master[full:].view(1, -1),
                out.payload[full:].view(1, -1),
                out.scales[full // block :],
            )

    def decode_(self, src: CompressedShard, out: torch.Tensor) -> None:
        """Write the compute-dtype values of ``src`` into ``out`` (same device, 1D)."""
        if src.scales is None:
            out.copy_(src.payload)
            return
        if self._nf4:
            nf4_decode_(src.scales, src.payload, out)
            return
        block = self.block_size
        numel = src.payload.numel()
        full = numel // block * block
        if full:
            dest = out[:full].view(-1, block)
            dest.copy_(src.payload[:full].view(-1, block))
            dest.mul_(src.scales[: full // block].unsqueeze(1).to(out.dtype))
        if full < numel:
            dest = out[full:]
            dest.copy_(src.payload[full:])
            dest.mul_(src.scales[full // block :].to(out.dtype))

    def decode_gathered_(self, wire: torch.Tensor, out: torch.Tensor, *, world_size: int) -> None:
        """Decode an all-gather of ``world_size`` ranks' :meth:`CompressedShard.wire` into ``out``.

        ``wire`` is 1D uint8, rank ``r``'s shard in its ``r``-th equal part; ``out`` is the
        1D compute-dtype buffer of ``world_size`` shards. Each rank's part is decoded as
        :meth:`decode_` decodes that rank's shard (``INT8`` and ``NF4`` blocks restart at
        every shard), so the result is bitwise that of decoding each shard and gathering.
        """
        if not self._packed:
            out.copy_(wire.view(self.storage_dtype))
            return
        shard, part = out.numel() // world_size, wire.numel() // world_size
        for r in range(world_size):
            src = self.view(wire[r * part : (r + 1) * part], shard)
            self.decode_(src, out[r * shard : (r + 1) * shard])

    def decode_gathered_range_(
        self,
        wire: torch.Tensor,
        out: torch.Tensor,
        *,
        world_size: int,
        shard_numel: int,
        start: int,
    ) -> None:
        """Decode elements ``[start, start + out.numel())`` of an all-gather's buffer into ``out``.

        ``wire`` is as for :meth:`decode_gathered_`, each rank's part a shard of
        ``shard_numel`` elements. Only the blocks holding the range are decoded, each
        as :meth:`decode_` decodes it, so ``out`` is bitwise that slice of the whole
        decode (see [Note: frozen weights decoded at use] in ``parameter.frozen_rows``).
        """
        part = self.wire_nbytes(shard_numel)
        pos, end = start, start + out.numel()
        while pos < end:
            rank = pos // shard_numel
            lo, hi = pos - rank * shard_numel, min(shard_numel, end - rank * shard_numel)
            dest = out[pos - start : pos - start + hi - lo]
            mine = wire[rank * part : (rank + 1) * part]
            if self._packed:
                self._decode_span_(self.view(mine, shard_numel), lo, hi, dest)
            else:
                dest.copy_(mine.view(self.storage_dtype)[lo:hi])
            pos += hi - lo

    def _decode_span_(self, src: CompressedShard, lo: int, hi: int, out: torch.Tensor) -> None:
        """Decode elements ``[lo, hi)`` of a block-wise shard into ``out``: from the block
        ``lo`` falls in (into a one-block temporary where ``lo`` is inside a block)."""
        block = self.block_size
        first = lo - lo % block
        if first < lo:  # the head, inside a block: decoded whole into a temporary
            head_end = min(first + block, src.numel)
            head = torch.empty(head_end - first, dtype=out.dtype, device=out.device)
            self._decode_from_(src, first, head)
            take = min(hi, head_end) - lo
            out[:take].copy_(head[lo - first : lo - first + take])
            out, lo = out[take:], lo + take
        if lo < hi:
            self._decode_from_(src, lo, out)

    def _decode_from_(self, src: CompressedShard, first: int, out: torch.Tensor) -> None:
        """Decode ``out.numel()`` elements of a block-wise shard from element ``first``, a
        multiple of the block size."""
        assert src.scales is not None
        block, n = self.block_size, out.numel()
        scales = src.scales[first // block : -(-(first + n) // block)]
        if self._nf4:  # the block (64) is even: ``first`` starts a byte
            nf4_decode_(scales, src.payload[first // 2 : -(-(first + n) // 2)], out)
            return
        self.decode_(CompressedShard(src.payload[first : first + n], scales), out)

    def decode(self, src: CompressedShard) -> torch.Tensor:
        """The compute-dtype values of ``src`` in a new tensor."""
        out = torch.empty(src.numel, dtype=self.compute_dtype, device=src.payload.device)
        self.decode_(src, out)
        return out
