"""Where a zero3_offload step's resident memory peaks: per phase, and per layer of the backward.

A diagnostic, not a comparison: it trains the GPT of ``_peers_model.py``
(d 1024, 16 heads, ``--blocks`` blocks, seq 128, global batch 8) on 2 gloo
ranks (``zero3_offload.testing.run_ranks``, 1 torch thread each, glibc's mmap
threshold at 1 MiB as ``zero3-offload train`` sets) in several
configurations, while a thread samples the process's ``VmRSS`` every 2 ms.
It prints, for rank 0 of each configuration:

- the peak RSS of every phase (setup, forward, backward, optimizer step) of
  every step;
- for the last backward, at the start of each layer (before its gradient
  buffer is taken): RSS and what the library counts at that moment
  (``get_memory_stats()``: kept activations, gathered, in-flight and pooled
  parameter buffers, gradient shards), so that RSS minus the counted bytes
  shows what no tensor of ours explains.

``python benchmarks/rss_phases.py`` (8 blocks, ~2 minutes here);
``--blocks 24`` is the 303M model of ``compare_peers.py --large``.
The flat gradient buffers (two, each the size of the largest layer) are
counted in the last column separately (``gradient_buffer_bytes``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_model import batches, lm_loss, local_slice, make_model

MIB = 2**20
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "lr-in-backward": {"lr_in_backward": True},
    "lr-in-backward+depth1": {"lr_in_backward": True, "prefetch_buffer_size": 1},
    "ckpt+lr-in-backward+depth1": {
        "lr_in_backward": True,
        "prefetch_buffer_size": 1,
        "activation_checkpointing": True,
    },
}


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096


class Sampler:
    """VmRSS every 2 ms in a thread; the peak per phase name."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            phase, rss = self.phase, _rss()
            self.peaks[phase] = max(self.peaks.get(phase, 0), rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def rank_body(ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager

    options = dict(spec["options"])
    lr_in_backward = options.pop("lr_in_backward", False)
    model = make_model(spec["dims"], 0)
    names = model.layer_names
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw", weight_decay=0.01), **options
    )
    sampler = Sampler()
    trace: list[dict[str, Any]] = []
    steps = spec["steps"]
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        prepare = manager.engine.reducer.prepare

        async def traced_prepare(layer: str, module: Any) -> Any:
            # Called at the start of each layer's backward, before its gradient buffer.
            if sampler.phase == f"backward {steps - 1}":
                st = manager.get_memory_stats()
                trace.append({"layer": layer, "rss": _rss(), **_counted(st)})
            return await prepare(layer, module)

        manager.engine.reducer.prepare = traced_prepare  # type: ignore[method-assign]
        for step, (x, y) in enumerate(batches(steps, 8, spec["dims"]["seq"], 1)):
            xs = local_slice(x, ctx.rank, ctx.world_size)
            ys = local_slice(y, ctx.rank, ctx.world_size)
            sampler.phase = f"forward {step}"
            out = await manager.forward_pass(xs, names)
            out.requires_grad_()
            lm_loss(out, ys).backward()
            sampler.phase = f"backward {step}"
            lr = 3e-4 if lr_in_backward else None
            await manager.backward_pass(out.grad, names, learning_rate=lr)
            sampler.phase = f"step {step}"
            await manager.optimizer_step(3e-4)
        sampler.phase = "after"
        final = manager.get_memory_stats()
        gradient_buffers = final.gradient_buffer_bytes
        state = final.model_state_bytes()
    sampler.stop()
    return {
        "peaks": sampler.peaks,
        "trace": trace,
        "gradient_buffers": gradient_buffers,
        "model_state": state,
    }


def _counted(st: Any) -> dict[str, int]:
    return {
        "activations": st.activation_bytes,
        "gathered": st.gathered_param_bytes,
        "in flight": st.inflight_param_bytes,
        "pool": st.gather_pool_bytes,
        "grad shards": st.gradient_bytes,
        "state": st.model_state_bytes() - st.gradient_bytes,
    }


def report(name: str, result: dict[str, Any], wall: float) -> str:
    lines = [f"## {name} ({wall:.0f} s)", ""]
    lines.append("peak RSS MiB per phase: " + ", ".join(
        f"{phase} {peak / MIB:,.0f}" for phase, peak in result["peaks"].items()
    ))  # fmt: skip
    buffers = result["gradient_buffers"]
    lines += [
        f"model state {result['model_state'] / MIB:,.0f} MiB; flat gradient buffers "
        f"{buffers / MIB:,.0f} MiB",
        "",
    ]
    if result["trace"]:
        keys = [k for k in result["trace"][0] if k not in ("layer", "rss")]
        head = ["layer", "RSS", *keys, "RSS - counted - grad buffers"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in result["trace"]:
            counted = sum(row[k] for k in keys)
            cells = [row["layer"], *(f"{row[k] / MIB:,.0f}" for k in ["rss", *keys])]
            cells.append(f"{(row['rss'] - counted - buffers) / MIB:,.0f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


async def main(argv: list[str] | None = None) -> int:
    from zero3_offload.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="transformer blocks (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of: {', '.join(CONFIGS)}",
    )
    args = parser.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown or args.blocks < 1 or args.steps < 1:
        parser.error(f"unknown configs {unknown}" if unknown else "--blocks/--steps must be >= 1")
    dims = {"d": 1024, "heads": 16, "n_layers": args.blocks, "seq": 128}
    print(f"# RSS by phase, GPT {dims}, 2 gloo ranks x 1 thread, rank 0\n", flush=True)
    for name in args.configs.split(","):
        t0 = time.perf_counter()
        spec = {"dims": dims, "options": CONFIGS[name], "steps": args.steps}
        results = await run_ranks(
            rank_body, 2, spec, threads_per_rank=1, mmap_threshold=2**20, timeout_s=3600
        )
        print(report(name, results[0], time.perf_counter() - t0), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
