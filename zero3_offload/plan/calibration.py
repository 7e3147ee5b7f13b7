"""``Calibration``: this machine's figures that turn a plan's bytes and FLOPs into time.

:func:`measure_figures` times, once: a matrix product (FLOP/s per rank, with the
threads each of the run's local ranks gets, all ranks computing at once; the best of a
few tries), one training step of a decoder layer (forward and backward: the FLOP/s
a model's layers reach, norms, attention and activations included), a memory copy
(bytes/s), decoding frozen weights' compressed copies to
fp32 with the engine's own codec (elements/s per format), fresh memory (a block mapped,
first written and unmapped, as glibc serves each allocation of 1 MiB or more in a
``zero3-offload train`` process: bytes/s beyond the write itself), a gloo all-gather between
local ranks (bytes/s), the engine's own all-gather through its shared-memory region
(bytes/s), and writing and reading a file (bytes/s). ``plan.calibrate``
adds the runtime's memory and caches the figures as JSON in the user's cache directory
(:func:`cache_path`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist

from zero3_offload import logging as zlogging
from zero3_offload.comm.collectives import Collectives
from zero3_offload.config import CpuCompressionMethod
from zero3_offload.engine.engine import SHARED_MEMORY_BLOCK_BYTES
from zero3_offload.errors import ConfigError
from zero3_offload.memory.allocator import TRAIN_MMAP_THRESHOLD
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.testing import RankContext, run_ranks

__all__ = ["VERSION", "Calibration", "cache_path", "in_own_loop", "measure_figures"]

_T = TypeVar("_T")

log = zlogging.get_logger(__name__)

VERSION = 4
"""The cache file's format; a file of another version is measured again."""
_MATMUL_N = 1024
_COPY_BYTES = 64 << 20
_FRESH_BYTES = 16 << 20
_DECODE_NUMEL = 4 << 20
_LAYER = {"d": 768, "ffn": 2048, "heads": 12, "tokens": 256}  # the timed decoder layer
_LAYER_TRIES = 2
_DECODED = (CpuCompressionMethod.BF16, CpuCompressionMethod.NF4)  # frozen weights' lossy formats
_GATHER_BYTES = 16 << 20
_GATHERS = 10
_FILE_BYTES = 128 << 20
_DISK_TRIES = 3
_MIN_S = 0.3
_TRIES = 5


@attrs.frozen(kw_only=True)
class Calibration:
    """Measured figures of this machine for ``ranks`` local ranks."""

    ranks: int
    threads_per_rank: int
    matmul_flops: dict[str, float]  # dtype name -> FLOP/s of one rank, all ranks busy
    layer_flops: dict[str, float]  # dtype name -> FLOP/s of a decoder layer's training step
    layer_flops_alone: dict[str, float]  # the same with one rank busy, the others idle
    copy_bytes_per_s: float
    fresh_bytes_per_s: float  # mapping, first touch and unmapping of new memory
    decode_elements_per_s: dict[str, float]  # frozen format -> fp32 elements decoded per s
    gather_bytes_per_s: float  # all-gather output bytes per second on one rank
    shared_gather_bytes_per_s: float  # the engine's all-gather through shared memory
    disk_write_bytes_per_s: float
    disk_read_bytes_per_s: float
    runtime_rss_bytes: int  # a rank's resident memory besides its model's tensors
    adapter_runtime_rss_bytes: int  # the same with LoRA adapters (peft loaded)
    measured_at: float
    unit_overhead_s: float = 0.0  # a step beyond its planned parts, per unit (plan.calibrate)
    version: int = VERSION

    def busy(self, dtype: torch.dtype) -> float:
        """How much of its speed alone a rank keeps with every local rank computing (the
        decoder layer's FLOP/s both ways; 1 with one rank)."""
        name = _name(dtype)
        name = name if name in self.layer_flops_alone else "float32"
        return self.layer_flops[name] / self.layer_flops_alone[name]

    def matmul_rate(self, dtype: torch.dtype) -> float:
        """FLOP/s of a rank's matrix products in ``dtype`` with every local rank busy."""
        name = _name(dtype)
        return self.matmul_flops.get(name) or self.matmul_flops["float32"]

    def decode_rate(self, method: CpuCompressionMethod) -> float:
        """Elements per second a rank decodes from ``method`` to the compute dtype."""
        return self.decode_elements_per_s.get(method.value) or self.copy_bytes_per_s / 4

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def cache_path(ranks: int) -> Path:
    """Where the figures for ``ranks`` local ranks are cached:
    ``$XDG_CACHE_HOME/zero3_offload/calibration-<ranks>.json``, else under ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zero3_offload" / f"calibration-{ranks}.json"


def _name(dtype: torch.dtype) -> str:
    """The figures' key for ``dtype`` (``float32``, ``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def _timed(work: Any) -> float:
    """Seconds per call of ``work``, repeated for at least ``_MIN_S``."""
    work()  # warm up
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < _MIN_S or n < 3:
        work()
        n += 1
    return elapsed / n


def _fresh_bytes_per_s() -> float:
    """Bytes/s of new memory beyond writing it: a private anonymous block mapped,
    written once (each page faulted in and zeroed by the kernel) and unmapped, as glibc
    serves a large allocation, against the same write into a block written before."""
    numel = _FRESH_BYTES // 4
    reused = torch.empty(numel)
    reused.fill_(1.0)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)

    def fresh() -> None:
        with mmap.mmap(-1, _FRESH_BYTES, flags=flags) as block:
            torch.frombuffer(block, dtype=torch.float32).fill_(1.0)

    extra = _timed(fresh) - _timed(lambda: reused.fill_(1.0))
    return _FRESH_BYTES / max(extra, 1e-9)


def _vm_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.Process().memory_info().rss)


async def _rank_figures(ctx: RankContext, _settings: None) -> dict[str, Any]:
    """One rank's figures, all ranks working at once (a collective)."""
    figures = _figures(ctx.group, ctx.world_size)
    return {**figures, "shared": await _shared_gather_bytes_per_s(ctx.group)}


async def _shared_gather_bytes_per_s(group: dist.ProcessGroup) -> float:
    """Output bytes/s of the engine's own all-gather with shared-memory collectives (as
    ``train`` runs it on one host: the data through the region, one small all-reduce per
    block to order the ranks); the same count of calls on every rank."""
    comm = Collectives(
        group, device=torch.device("cpu"), shared_memory_block_bytes=SHARED_MEMORY_BLOCK_BYTES
    )
    try:
        part = torch.ones(_GATHER_BYTES // 4 // group.size())
        out = torch.empty(part.numel() * group.size())
        await comm.all_gather(out, part)  # warm up
        start = time.perf_counter()
        for _ in range(_GATHERS):
            await comm.all_gather(out, part)
        return out.numel() * 4 * _GATHERS / (time.perf_counter() - start)
    finally:
        comm.close()


def _layer_step_flops(d: int, ffn: int, tokens: int) -> float:
    """FLOPs of a training step (forward, and a backward of twice its products) of a
    Llama-like decoder layer of width ``d`` and MLP ``ffn`` on ``tokens`` tokens."""
    params = 4 * d * d + 3 * d * ffn
    return 3 * (2 * tokens * params + 2 * tokens * tokens * d)


def _layer_seconds(dtype: torch.dtype) -> float:
    """Seconds of one training step of a decoder layer (``_LAYER``) in ``dtype``."""
    d, ffn, heads, t = _LAYER["d"], _LAYER["ffn"], _LAYER["heads"], _LAYER["tokens"]
    g = torch.Generator().manual_seed(0)
    shapes = {"qkv": (3 * d, d), "o": (d, d), "gate": (ffn, d), "up": (ffn, d), "down": (d, ffn)}
    w = {
        n: (torch.randn(s, generator=g) * 0.02).to(dtype).requires_grad_()
        for n, s in shapes.items()
    }
    x = torch.randn(1, t, d, generator=g).to(dtype).requires_grad_()
    F = torch.nn.functional

    def step() -> None:
        h = F.rms_norm(x, (d,))
        q, k, v = F.linear(h, w["qkv"]).view(1, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        h = x + F.linear(a.reshape(1, t, d), w["o"])
        m = F.rms_norm(h, (d,))
        out = h + F.linear(F.silu(F.linear(m, w["gate"])) * F.linear(m, w["up"]), w["down"])
        out.float().sum().backward()

    return min(_timed(step) for _ in range(_LAYER_TRIES))


def _figures(group: dist.ProcessGroup | None, world_size: int) -> dict[str, Any]:
    """This process's figures; with a ``group``, all its ranks working at once."""
    flops: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(_MATMUL_N, _MATMUL_N, dtype=dtype)
        b = torch.randn(_MATMUL_N, _MATMUL_N, dtype=dtype)
        if group is not None:
            dist.barrier(group=group)
        # The best of a few tries: other processes on the machine slow some of them.
        seconds = min(_timed(lambda a=a, b=b: torch.mm(a, b)) for _ in range(_TRIES))
        flops[_name(dtype)] = 2 * _MATMUL_N**3 / seconds
    layer: dict[str, float] = {}
    step_flops = _layer_step_flops(_LAYER["d"], _LAYER["ffn"], _LAYER["tokens"])
    for dtype in (torch.float32, torch.bfloat16):
        if group is not None:
            dist.barrier(group=group)
        layer[_name(dtype)] = step_flops / _layer_seconds(dtype)
    alone = dict(layer)  # the same layer with the other ranks idle (rank 0 only)
    for dtype in (torch.float32, torch.bfloat16) if world_size > 1 else ():
        dist.barrier(group=group)
        if dist.get_rank(group) == 0:
            alone[_name(dtype)] = step_flops / _layer_seconds(dtype)
        dist.barrier(group=group)
    src = torch.ones(_COPY_BYTES // 4)
    dst = torch.empty_like(src)
    copy = _COPY_BYTES / _timed(lambda: dst.copy_(src))
    fresh = _fresh_bytes_per_s()
    decode: dict[str, float] = {}
    master = torch.randn(_DECODE_NUMEL)
    out = torch.empty_like(master)
    for method in _DECODED:
        codec = ShardCodec(method, torch.float32)
        encoded = codec.empty(_DECODE_NUMEL, device=torch.device("cpu"))
        codec.encode_(master, encoded)
        seconds = _timed(lambda c=codec, e=encoded: c.decode_(e, out))
        decode[method.value] = _DECODE_NUMEL / seconds
    gather = copy
    if group is not None and world_size > 1:
        part = torch.ones(_GATHER_BYTES // 4 // world_size)
        outs = [torch.empty_like(part) for _ in range(world_size)]
        dist.barrier(group=group)
        dist.all_gather(outs, part, group=group)  # warm up
        # A fixed count: every rank must launch the same collectives.
        start = time.perf_counter()
        for _ in range(_GATHERS):
            dist.all_gather(outs, part, group=group)
        seconds = (time.perf_counter() - start) / _GATHERS
        gather = part.numel() * 4 * world_size / seconds
    write, read = 0.0, 0.0
    with tempfile.TemporaryDirectory(prefix="zero3-calibrate-") as tmp:
        path = Path(tmp) / "probe.bin"
        data = os.urandom(_FILE_BYTES // 16) * 16
        for _ in range(_DISK_TRIES):  # the best of a few: the disk is shared
            start = time.perf_counter()
            with path.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):  # read from the disk, not the page cache
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            write = max(write, _FILE_BYTES / (time.perf_counter() - start))
            start = time.perf_counter()
            with path.open("rb") as f:
                while f.read(8 << 20):
                    pass
            read = max(read, _FILE_BYTES / (time.perf_counter() - start))
            path.unlink()
    return {
        "flops": flops,
        "layer": layer,
        "alone": alone,
        "copy": copy,
        "fresh": fresh,
        "decode": decode,
        "gather": gather,
        "write": write,
        "read": read,
    }


def in_own_loop(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run the coroutine ``make()`` returns to completion, in an event loop of its own: on
    this thread, or on a thread of its own when this one runs a loop already (a manager
    built with ``memory_per_rank`` inside an async function measures the figures there)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="calibrate") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def measure_figures(ranks: int, *, threads_per_rank: int | None = None) -> Calibration:
    """The timed figures (FLOP/s, bandwidths) with ``ranks`` local ranks; the runtime's
    memory is left at 0 (see ``plan.calibrate.measure``)."""
    if ranks < 1:
        raise ConfigError(f"ranks={ranks} is invalid: must be >= 1")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // ranks)
    if ranks == 1:  # no group to join: measured here, with the rank's threads
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            figures = [_figures(None, 1)]
        finally:
            torch.set_num_threads(before)
    else:
        figures = in_own_loop(
            lambda: run_ranks(
                _rank_figures,
                ranks,
                None,
                timeout_s=600.0,
                threads_per_rank=threads,
                mmap_threshold=TRAIN_MMAP_THRESHOLD,
            )
        )
    calibration = Calibration(
        ranks=ranks,
        threads_per_rank=threads,
        matmul_flops={k: min(f["flops"][k] for f in figures) for k in figures[0]["flops"]},
        layer_flops={k: min(f["layer"][k] for f in figures) for k in figures[0]["layer"]},
        layer_flops_alone=figures[0]["alone"],
        copy_bytes_per_s=min(f["copy"] for f in figures),
        fresh_bytes_per_s=min(f["fresh"] for f in figures),
        decode_elements_per_s={
            k: min(f["decode"][k] for f in figures) for k in figures[0]["decode"]
        },
        gather_bytes_per_s=min(f["gather"] for f in figures),
        shared_gather_bytes_per_s=min(f.get("shared", f["copy"]) for f in figures),
        disk_write_bytes_per_s=min(f["write"] for f in figures),
        disk_read_bytes_per_s=min(f["read"] for f in figures),
        runtime_rss_bytes=0,
        adapter_runtime_rss_bytes=0,
        measured_at=time.time(),
    )
    return calibration
