"""NF4: the 4-bit NormalFloat code of QLoRA, by blocks of 64 elements with absmax scales.

[Note: nf4]
A tensor is cut into blocks of ``NF4_BLOCK`` = 64 consecutive elements from
its first one (the last block may be shorter). Each block keeps one fp32
scale, its absmax ``a = max |x|``, and each element the 4-bit index of the
code value nearest to ``x / a`` among the 16 of :data:`NF4_CODE`
(bitsandbytes' NF4 table: -1.0 ... 1.0 with an exact 0, index 7). The
nearest value is found against the midpoints between neighbouring codes
(computed in float64, rounded to fp32); a value exactly on a midpoint takes
the *lower* code, as bitsandbytes' quantizer does (it compares ``x >
midpoint``). An all-zero block has scale 0 and every index 7. The element of
largest magnitude always maps to -1 or 1 exactly, so decoding keeps every
block's absmax and encoding the decoded values (fp32) gives the same bytes
again.

Layout (one uint8 buffer, so a shard is one tensor to copy and all-gather):
the fp32 scales first (``4 * ceil(n / 64)`` bytes), then the indices, two
per byte, element ``2i`` in the high nibble and ``2i + 1`` in the low one
(bitsandbytes' order); an odd count pads the last low nibble with the code of
0. That is ``ceil(n / 2) + 4 * ceil(n / 64)`` bytes, about 0.56 byte per
element.

Decoding is ``code[index] * scale`` computed in the target dtype (the code
value and the scale each rounded to it, then multiplied): the values the
layers see. Encoding works through the tensor in chunks of
``_CHUNK_ELEMENTS`` into per-thread scratch buffers, so it runs in several
worker threads at once and never allocates a tensor-sized temporary; decoding
works in chunks too (a 256-entry table of byte -> two values, selected as one
integer of twice the element's width).

:func:`nf4_roundtrip` gives a tensor's values after encoding and decoding, with
the blocks of 64 starting at its first element: the weights a plain reference
(e.g. peft on the dequantized base model) trains with.
"""

from __future__ import annotations

import itertools
import threading

import torch

from zero3_offload.errors import InputError

__all__ = [
    "NF4_BLOCK",
    "NF4_CODE",
    "nf4_blocks",
    "nf4_decode_",
    "nf4_dequantize",
    "nf4_encode_",
    "nf4_nbytes",
    "nf4_quantize",
    "nf4_roundtrip",
    "nf4_split",
]

NF4_BLOCK = 64
"""Elements per absmax scale."""

NF4_CODE: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""The 16 code values (bitsandbytes' NF4 table), by index."""

_ZERO_INDEX = NF4_CODE.index(0.0)
_MIDPOINTS = torch.tensor(
    [(a + b) / 2 for a, b in itertools.pairwise(NF4_CODE)], dtype=torch.float64
).float()
# Encoding and decoding work through a tensor in chunks of this many elements (a
# multiple of the block and even, so no block or byte straddles two chunks).
_CHUNK_ELEMENTS = 1 << 20
_scratch = threading.local()
_tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_tables_lock = threading.Lock()


def nf4_blocks(numel: int) -> int:
    """Blocks (scales) of a tensor of ``numel`` elements."""
    return -(-numel // NF4_BLOCK)


def nf4_nbytes(numel: int) -> int:
    """Bytes of the encoding of ``numel`` elements: ``4 * blocks + ceil(numel / 2)``."""
    return 4 * nf4_blocks(numel) + -(-numel // 2)


def nf4_split(packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scales and the uint8 index bytes of an encoding of ``numel`` elements.

    ``packed`` is 1D uint8 of at least :func:`nf4_nbytes` bytes. The scales are a
    view where ``packed`` starts at a multiple of 4 bytes of its storage, else a copy
    (e.g. a rank's part of a gathered buffer).
    """
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() < nf4_nbytes(numel):
        raise InputError(
            f"an NF4 encoding of {numel} elements is 1D uint8 of {nf4_nbytes(numel)} bytes, "
            f"got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    blocks = nf4_blocks(numel)
    scale_bytes = packed[: 4 * blocks]
    if scale_bytes.storage_offset() % 4:
        scale_bytes = scale_bytes.clone()
    return scale_bytes.view(torch.float32), packed[4 * blocks : nf4_nbytes(numel)]


def _scratch_buffers(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's fp32 and int32 scratch of at least ``numel`` (+1 pad) elements."""
    buf = getattr(_scratch, "nf4", None)
    if buf is None or buf[0].numel() < numel + 1:
        size = max(numel, _CHUNK_ELEMENTS) + 1
        buf = (torch.empty(size, dtype=torch.float32), torch.empty(size, dtype=torch.int32))
        _scratch.nf4 = buf
    return buf


def _encode_rows(x: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor) -> None:
    # x: [rows, cols] fp32 (cols = NF4_BLOCK, or the last block's length, one row);
    # scales: [rows] fp32; payload: [ceil(rows * cols / 2)] uint8.
    n = x.numel()
    on_cpu = x.device.type == "cpu"
    if on_cpu:
        values, indices = _scratch_buffers(n)
        tmp, idx = values[:n].view_as(x), indices[: n + n % 2]
    else:
        tmp = torch.empty_like(x)
        idx = torch.empty(n + n % 2, dtype=torch.int32, device=x.device)
    torch.abs(x, out=tmp)
    torch.amax(tmp, dim=1, out=scales)
    # An all-zero block has scale 0; dividing its zeros by the smallest normal float
    # gives 0 (index 7), not nan.
    safe = scales.clamp(min=torch.finfo(torch.float32).tiny)
    torch.div(x, safe.unsqueeze(1), out=tmp)
    mids = _MIDPOINTS.to(x.device)
    # Index = the midpoints strictly below the value: a tie takes the lower code.
    torch.bucketize(tmp.view(-1), mids, out_int32=True, right=False, out=idx[:n])
    if n % 2:
        idx[n] = _ZERO_INDEX
    high, low = idx[0::2], idx[1::2]
    payload.copy_(high.mul_(16).add_(low))


def nf4_encode_(x: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor) -> None:
    """Encode ``x`` (1D fp32) into preallocated ``scales`` (fp32, :func:`nf4_blocks`)
    and ``payload`` (uint8, ``ceil(numel / 2)``), blocks from ``x``'s first element.

    Safe to call from several threads at once (the scratch space is per thread).
    """
    numel = x.numel()
    if x.dtype != torch.float32 or x.dim() != 1:
        raise InputError(f"NF4 encodes 1D fp32 tensors, got {x.dtype} of shape {tuple(x.shape)}")
    block = NF4_BLOCK
    full_rows = numel // block
    rows = _CHUNK_ELEMENTS // block
    for r0 in range(0, full_rows, rows):
        r1 = min(r0 + rows, full_rows)
        _encode_rows(
            x[r0 * block : r1 * block].view(-1, block),
            scales[r0:r1],
            payload[r0 * block // 2 : r1 * block // 2],
        )
    full = full_rows * block
    if full < numel:
        _encode_rows(x[full:].view(1, -1), scales[full_rows:], payload[full // 2 :])


def _pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2] ``dtype`` on ``device``: byte -> (code of its high nibble, of its low)."""
    key = (dtype, device)
    table = _tables.get(key)
    if table is None:
        code = torch.tensor(NF4_CODE, dtype=torch.float32).to(dtype)
        byte = torch.arange(256)
        table = torch.stack([code[byte >> 4], code[byte & 15]], dim=1).to(device)
        with _tables_lock:
            table = _tables.setdefault(key, table)
    return table


# The integer type of two elements of a dtype side by side: a byte's pair of codes is
# then one table entry, copied by one 1-D index_select.
_PAIR_INT = {4: torch.int64, 2: torch.int32}


def _pairs_view(table: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``table`` as [256] and ``out``'s whole pairs as one integer per pair, or None
    when ``out``'s dtype or its storage offset does not allow that view."""
    pair = _PAIR_INT.get(out.element_size())
    if pair is None or out.storage_offset() % 2 or not out.is_contiguous():
        return None
    pairs = out.numel() // 2
    return table.contiguous().view(pair).view(-1), out[: 2 * pairs].view(pair)


def nf4_decode_(scales: torch.Tensor, payload: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``code[index] * scale`` of ``out.numel()`` elements into ``out`` (1D, its
    dtype; on the device of ``scales`` and ``payload``).

    Each byte's two codes are one entry of a 256-entry table viewed as integers twice
    the element's width, so a chunk is one 1-D ``index_select`` of those (with the
    byte indices widened into this thread's scratch on the CPU, not a new tensor):
    3-5x the speed of selecting rows of two."""
    numel = out.numel()
    table = _pair_table(out.dtype, out.device)
    pairs = numel // 2
    step = _CHUNK_ELEMENTS // 2
    viewed = _pairs_view(table, out)
    scratch = _scratch_buffers(step)[1] if out.device.type == "cpu" else None
    for p0 in range(0, pairs, step):
        p1 = min(p0 + step, pairs)
        if scratch is not None:
            index = scratch[: p1 - p0]
            index.copy_(payload[p0:p1])
        else:
            index = payload[p0:p1].to(torch.int32)
        if viewed is not None:
            torch.index_select(viewed[0], 0, index, out=viewed[1][p0:p1])
        else:
            torch.index_select(table, 0, index, out=out[2 * p0 : 2 * p1].view(-1, 2))
    if numel % 2:
        out[numel - 1] = table[payload[pairs].to(torch.int64), 0]
    block = NF4_BLOCK
    full = numel // block * block
    scale = scales.to(out.dtype)
    if full:
        out[:full].view(-1, block).mul_(scale[: full // block].unsqueeze(1))
    if full < numel:
        out[full:].mul_(scale[full // block])


def nf4_quantize(t: torch.Tensor) -> torch.Tensor:
    """The NF4 encoding of ``t`` (any shape; its fp32 values in ``reshape(-1)`` order).

    Returns:
        1D uint8 of :func:`nf4_nbytes` bytes on ``t``'s device: the fp32 scales, then
        the index bytes (see [Note: nf4]).
    """
    flat = t.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    packed = torch.empty(nf4_nbytes(numel), dtype=torch.uint8, device=flat.device)
    scales, payload = nf4_split(packed, numel)
    nf4_encode_(flat, scales, payload)
    return packed


def nf4_dequantize(
    packed: torch.Tensor,
    numel: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The ``numel`` values of an NF4 encoding (from :func:`nf4_quantize`), 1D ``dtype``.

    Decoded on ``device`` (default: ``packed``'s), the encoding copied there first.
    """
    if device is not None:
        packed = packed.to(device)
    scales, payload = nf4_split(packed, numel)
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    nf4_decode_(scales, payload, out)
    return out


def nf4_roundtrip(t: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t``'s values after NF4 encoding and decoding, in ``t``'s shape.

    The blocks of 64 start at ``t``'s first element, as they do for a parameter
    stored with NF4 (every parameter and shard starts at a block boundary). The
    values are decoded in ``dtype`` (default ``t``'s dtype): pass the compute dtype
    to get what the layers compute with.
    """
    target = t.dtype if dtype is None else dtype
    return nf4_dequantize(nf4_quantize(t), t.numel(), dtype=target).view(t.shape)
