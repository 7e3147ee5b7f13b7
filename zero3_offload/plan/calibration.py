"""``Calibration``: this machine's figures that turn a plan's bytes and FLOPs into time.

``measure()`` times, once: a matrix product (FLOP/s per rank, with the threads each
of the run's local ranks gets, all ranks computing at once; the best of a few tries),
a memory copy (bytes/s), a gloo all-gather between local ranks (bytes/s), and writing
and reading a file (bytes/s). It also measures the runtime every rank holds whatever
its model: it trains a two-layer, 256-wide Llama for three steps with ``zero3-offload
train`` on the same number of local ranks, with and without LoRA adapters, and takes
each run's peak resident set (``VmHWM``) less the planner's figure for that model's
own tensors: what remains is torch, transformers and this library loaded, the
autograd engine, thread pools and the C heap's arenas. The figures are cached as JSON
in the user's cache directory (``$XDG_CACHE_HOME/zero3_offload/calibration-<ranks>
.json``, else under ``~/.cache``) and read back by :func:`load_or_measure`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from zero3_offload import logging as zlogging
from zero3_offload.errors import ConfigError
from zero3_offload.testing import RankContext, run_ranks

__all__ = ["Calibration", "cache_path", "load_or_measure", "measure"]

log = zlogging.get_logger(__name__)

_VERSION = 1
_MATMUL_N = 1024
_COPY_BYTES = 64 << 20
_GATHER_BYTES = 16 << 20
_FILE_BYTES = 128 << 20
_MIN_S = 0.3
_TRIES = 5


@attrs.frozen(kw_only=True)
class Calibration:
    """Measured figures of this machine for ``ranks`` local ranks."""

    ranks: int
    threads_per_rank: int
    matmul_flops: dict[str, float]  # dtype name -> FLOP/s of one rank, all ranks busy
    copy_bytes_per_s: float
    gather_bytes_per_s: float  # all-gather output bytes per second on one rank
    disk_write_bytes_per_s: float
    disk_read_bytes_per_s: float
    runtime_rss_bytes: int  # a rank's resident memory besides its model's tensors
    adapter_runtime_rss_bytes: int  # the same with LoRA adapters (peft loaded)
    measured_at: float
    version: int = _VERSION

    def flops(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        return self.matmul_flops.get(name) or self.matmul_flops["float32"]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def cache_path(ranks: int) -> Path:
    """Where the figures for ``ranks`` local ranks are cached."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zero3_offload" / f"calibration-{ranks}.json"


def _timed(work: Any) -> float:
    """Seconds per call of ``work``, repeated for at least ``_MIN_S``."""
    work()  # warm up
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < _MIN_S or n < 3:
        work()
        n += 1
    return elapsed / n


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
    flops: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(_MATMUL_N, _MATMUL_N, dtype=dtype)
        b = torch.randn(_MATMUL_N, _MATMUL_N, dtype=dtype)
        dist.barrier(group=ctx.group)
        # The best of a few tries: other processes on the machine slow some of them.
        seconds = min(_timed(lambda a=a, b=b: torch.mm(a, b)) for _ in range(_TRIES))
        flops[str(dtype).removeprefix("torch.")] = 2 * _MATMUL_N**3 / seconds
    src = torch.ones(_COPY_BYTES // 4)
    dst = torch.empty_like(src)
    copy = _COPY_BYTES / _timed(lambda: dst.copy_(src))
    gather = copy
    if ctx.world_size > 1:
        part = torch.ones(_GATHER_BYTES // 4 // ctx.world_size)
        outs = [torch.empty_like(part) for _ in range(ctx.world_size)]
        dist.barrier(group=ctx.group)
        seconds = _timed(lambda: dist.all_gather(outs, part, group=ctx.group))
        gather = part.numel() * 4 * ctx.world_size / seconds
    with tempfile.TemporaryDirectory(prefix="zero3-calibrate-") as tmp:
        path = Path(tmp) / "probe.bin"
        data = os.urandom(_FILE_BYTES // 16) * 16
        start = time.perf_counter()
        with path.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        write = _FILE_BYTES / (time.perf_counter() - start)
        start = time.perf_counter()
        with path.open("rb") as f:
            while f.read(8 << 20):
                pass
        read = _FILE_BYTES / (time.perf_counter() - start)
    return {
        "flops": flops,
        "copy": copy,
        "gather": gather,
        "write": write,
        "read": read,
    }


_TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
_CORPUS_MB = 0.05
_TINY_RUN = (
    "--steps",
    "3",
    "--seq-len",
    "256",
    "--batch-size",
    "1",
    "--corpus-mb",
    str(_CORPUS_MB),
)
_TINY_RUN += ("--eval-batches", "1", "--eval-every", "0", "--warmup-steps", "1")


def _runtime(calibration: Calibration, ranks: int, *, adapters: bool) -> int:
    """A rank's peak resident set training a tiny Llama, less the planner's figure for
    that model's tensors (see the module docstring)."""
    from zero3_offload.plan.planner import plan

    with tempfile.TemporaryDirectory(prefix="zero3-calibrate-") as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(_TINY))
        lora = ("--lora", "r=4") if adapters else ()
        args = ("--model", str(model), "--world-size", str(ranks), "--out", f"{tmp}/run")
        command = [sys.executable, "-m", "zero3_offload", "train", *args, *_TINY_RUN, *lora]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise ConfigError(f"calibration: the tiny training run failed: {done.stderr[-2000:]}")
        peaks = [
            record["peak_rss_bytes"]
            for log_file in Path(tmp, "run", "logs").glob("rank*.jsonl")
            for record in map(json.loads, log_file.read_text().splitlines())
            if record.get("event") == "train_done"
        ]
        train = {"lora": "r=4"} if adapters else {}
        tiny = plan(
            model,
            calibration=calibration,
            world_size=ranks,
            seq_len=256,
            corpus_mb=_CORPUS_MB,
            **train,
        )
    return max(peaks) - tiny.host_peak_bytes


def measure(ranks: int, *, threads_per_rank: int | None = None) -> Calibration:
    """Measure this machine's figures with ``ranks`` local ranks (each with
    ``threads_per_rank`` torch threads; default: the cores divided by the ranks)."""
    if ranks < 1:
        raise ConfigError(f"ranks={ranks} is invalid: must be >= 1")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // ranks)
    started = time.perf_counter()
    figures = asyncio.run(
        run_ranks(
            _rank_figures,
            ranks,
            None,
            timeout_s=600.0,
            threads_per_rank=threads,
            mmap_threshold=1 << 20,
        )
    )
    calibration = Calibration(
        ranks=ranks,
        threads_per_rank=threads,
        matmul_flops={k: min(f["flops"][k] for f in figures) for k in figures[0]["flops"]},
        copy_bytes_per_s=min(f["copy"] for f in figures),
        gather_bytes_per_s=min(f["gather"] for f in figures),
        disk_write_bytes_per_s=min(f["write"] for f in figures),
        disk_read_bytes_per_s=min(f["read"] for f in figures),
        runtime_rss_bytes=0,
        adapter_runtime_rss_bytes=0,
        measured_at=time.time(),
    )
    calibration = attrs.evolve(
        calibration,
        runtime_rss_bytes=_runtime(calibration, ranks, adapters=False),
        adapter_runtime_rss_bytes=_runtime(calibration, ranks, adapters=True),
    )
    log.info("calibrated", seconds=time.perf_counter() - started, **calibration.to_dict())
    return calibration


def load_or_measure(ranks: int, *, remeasure: bool = False) -> Calibration:
    """The cached figures for ``ranks`` local ranks, measured and cached first when
    there are none (or ``remeasure``)."""
    path = cache_path(ranks)
    if not remeasure and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("version") == _VERSION:
                return Calibration(**data)
        except (OSError, ValueError, TypeError):
            log.warning("unreadable calibration cache, measuring again", path=str(path))
    calibration = measure(ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(calibration.to_dict(), indent=2))
    tmp.replace(path)
    return calibration
