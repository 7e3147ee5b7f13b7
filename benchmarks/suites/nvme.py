"""NVMe: the disk tier's bandwidth against the disk's, and training with the state on disk.

All in one run, under --nvme-path (a directory on the disk to measure):
1. The disk: --disk-mib MiB written, then read, with O_DIRECT in 8 MiB preadv/pwritev calls
   (the file is removed after), three times each; the median is the device's bandwidth here.
2. The tier alone: an NvmeShardTier holding the records of the training model's layers (rank 0's
   shards of 2), each made resident and written back in turn as an optimizer step does (reads
   run ahead into its 3 buffers, writes behind), three passes; achieved = the seconds the disk
   needs for those bytes at the step-1 bandwidths / the tier's wall seconds (goal >= 70 %).
3. Training: the GPT below on 2 gloo ranks, zero3_offload default with the optimizer state in
   memory and on disk, each also with the learning rate passed to backward_pass (the updates,
   and so the disk traffic, overlap the backward), and with the compute copies on disk too
   (offload_param_device nvme: every gather reads its layer's copy); step time, peak RSS, the
   disk traffic of a step per rank (the library's transfers: disk_read / disk_write), losses
   equal.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import train
from harness.plan import progress
from harness.report import Report, markdown_table, mib, systems_table
from harness.systems import System
from harness.train import loss_agreement, summarize

WORLD = 2
CHUNK = 8 * 2**20
GOAL_TIER = 0.70  # of the disk's bandwidth
GOAL_STEP = 1.15  # step on disk / step in memory, for a compute-bound step

OPTIONS = {
    "--nvme-path": {"help": "directory on the disk to measure (a temporary one under /var/tmp)"},
    "--disk-mib": {"type": int, "help": "MiB written and read to measure the disk (1024)"},
    "--batch": {"type": int, "help": "global batch of the training runs (64; quick 8)"},
    "--blocks": {"type": int, "help": "GPT blocks of the training runs (6; quick 2)"},
    "--rounds": {"type": int, "help": "rounds of the training runs (2; quick 1)"},
    "--seed": {"type": int, "default": 0, "help": "model seed (0)"},
    "--timeout": {"type": float, "help": "seconds per training run (1800; quick 300)"},
    **train.RANK_OPTIONS,
}
DEFAULTS = {"threads": 1, "warmup": 1, "repeats": 4, "disk_mib": 1024, "batch": 64}
DEFAULTS.update(blocks=6, rounds=2, timeout=1800.0)
QUICK = {"warmup": 1, "repeats": 2, "disk_mib": 64, "batch": 8, "blocks": 2, "rounds": 1}
QUICK["timeout"] = 300.0
EPILOG = "--repeats/--warmup: timed/untimed training steps (4/1); --threads: per rank (1)"


def check(args: Any) -> str | None:
    if min(args.disk_mib, args.batch, args.blocks, args.rounds, args.repeats) < 1:
        return "--disk-mib, --batch, --blocks, --rounds and --repeats must be >= 1"
    if args.batch % WORLD:
        return f"--batch must divide over {WORLD} ranks"
    return None


def disk_bandwidth(directory: Path, nbytes: int) -> dict[str, Any]:
    """Write then read ``nbytes`` with O_DIRECT in CHUNK calls, three times: GB/s each way."""
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(CHUNK))
    view = memoryview(buffer)
    path = directory / "disk-probe.bin"
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    writes, reads = [], []
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:  # no direct I/O on this filesystem: buffered, and said so
        flags &= ~getattr(os, "O_DIRECT", 0)
        fd = os.open(path, flags, 0o600)
    direct = bool(flags & getattr(os, "O_DIRECT", 0))
    try:
        for _ in range(3):
            start = time.perf_counter()
            for offset in range(0, nbytes, CHUNK):
                os.pwritev(fd, [view], offset)
            os.fsync(fd)
            writes.append(nbytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            for offset in range(0, nbytes, CHUNK):
                os.preadv(fd, [view], offset)
            reads.append(nbytes / (time.perf_counter() - start) / 1e9)
    finally:
        os.close(fd)
        path.unlink()
        view.release()
        buffer.close()
    return {
        "direct": direct,
        "bytes": nbytes,
        "write_gbs": writes,
        "read_gbs": reads,
        "write_gbs_median": statistics.median(writes),
        "read_gbs_median": statistics.median(reads),
    }


def tier_bandwidth(directory: Path, layers: dict[str, int], disk: dict[str, Any]) -> dict:
    """An NvmeShardTier with ``layers``' records (AdamW: master and two moments), every layer
    resident and written back in turn, three passes: bytes, wall seconds, achieved fraction."""
    import torch

    from zero3_offload.comm.worker_threads import WorkerThreads
    from zero3_offload.optimizer_state.disk_tier import NvmeShardTier
    from zero3_offload.stats.timeline import Timeline
    from zero3_offload.storage.rank_directory import RankDirectory

    async def passes() -> list[dict[str, float]]:
        io = WorkerThreads(threads=2, timeline=Timeline(rank=0))
        keys = ("exp_avg", "exp_avg_sq")
        claim = RankDirectory(directory, 0)
        tier = NvmeShardTier(claim.path, layers=layers, state_keys=keys, buffers=3, io=io)
        masters = {name: torch.empty(0) for name in layers}
        states: dict[str, dict[str, Any]] = {name: {} for name in layers}
        out = []
        try:
            for name in layers:
                tier.write_initial(name, torch.zeros(layers[name]))
            for _ in range(3):
                reads, writes = tier.file.reads, tier.file.writes
                start = time.perf_counter()

                async def one(name: str) -> None:
                    async with tier.resident(name, masters[name], states[name], write=True):
                        pass  # an update's work would run here

                await asyncio.gather(*(one(name) for name in layers))
                wall = time.perf_counter() - start
                read = tier.file.reads[2] - reads[2]
                written = tier.file.writes[2] - writes[2]
                need = read / (disk["read_gbs_median"] * 1e9)
                need += written / (disk["write_gbs_median"] * 1e9)
                out.append(
                    {"read": read, "written": written, "wall_s": wall, "achieved": need / wall}
                )
        finally:
            tier.close()
            claim.remove()
        return out

    runs = asyncio.run(passes())
    return {"passes": runs, "achieved_median": statistics.median(r["achieved"] for r in runs)}


class Hooks:
    """The library's disk transfers over the timed steps (after the warm-up)."""

    def __init__(self, spec: dict[str, Any], rank: Any) -> None:
        self.warmup, self.base = spec["warmup"], None

    def _now(self, system: Any) -> dict[str, tuple[int, float, int]]:
        transfers = system.manager.get_performance_stats().transfers
        return {
            k: (v.transfers, v.time, v.bytes) for k, v in transfers.items() if k.startswith("disk")
        }

    def step(self, i: int, clock: Any, system: Any) -> bool:
        if i == self.warmup - 1:
            self.base = self._now(system)
        return True

    async def end(self, system: Any, result: dict[str, Any]) -> None:
        now, base = self._now(system), self.base or {}
        result["disk"] = {
            k: [a - b for a, b in zip(v, base.get(k, (0, 0.0, 0)), strict=True)]
            for k, v in now.items()
        }


def run(args: Any) -> dict[str, Any] | None:
    import torch
    from harness import workload

    from zero3_offload.parameter.flat_layout import build_layouts
    from zero3_offload.parameter.rank_mapping import Zero3RankMapping

    root = Path(args.nvme_path) if args.nvme_path else Path(tempfile.mkdtemp(dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nvme-bench-", dir=root))
    dims = dict(d=512, heads=8, n_layers=args.blocks, seq=128, vocab=8192, global_batch=args.batch)
    if args.quick:
        dims.update(d=128, heads=4, vocab=256)
    try:
        progress(f"disk: {args.disk_mib} MiB written and read with O_DIRECT under {root}")
        disk = disk_bandwidth(work, args.disk_mib * 2**20)
        progress(
            f"disk: write {disk['write_gbs_median']:.2f} GB/s, read {disk['read_gbs_median']:.2f}"
            f" GB/s (direct I/O: {disk['direct']})"
        )
        torch.manual_seed(args.seed)
        model = workload.build(dims)
        mapping = Zero3RankMapping(rank=0, world_size=WORLD)
        layers = dict(model.named_children())
        layouts = build_layouts(layers, mapping)
        shards = {n: lay.shard_numel for n, lay in layouts.items() if lay.numel}
        del model
        tier = tier_bandwidth(work, shards, disk)
        progress(f"tier alone: {100 * tier['achieved_median']:.0f} % of the disk's bandwidth")
        nvme = {"offload_optimizer_device": "nvme", "nvme_path": str(work / "tier")}
        systems = {
            "ram": System("state in memory", "zero3_offload", WORLD, {}),
            "nvme": System("state on disk", "zero3_offload", WORLD, nvme),
            "ram_lr_bwd": System(
                "state in memory, lr in backward", "zero3_offload", WORLD, {"lr_in_backward": True}
            ),
            "nvme_lr_bwd": System(
                "state on disk, lr in backward",
                "zero3_offload",
                WORLD,
                {**nvme, "lr_in_backward": True},
            ),
            "nvme_both": System(
                "state and compute copies on disk",
                "zero3_offload",
                WORLD,
                {**nvme, "offload_param_device": "nvme"},
            ),
        }
        spec = {"hooks": "suites.nvme:Hooks"}
        result = train.compare(
            args, systems, dims, threads=dict.fromkeys(systems, args.threads), spec=spec
        )
    finally:
        for path in sorted(work.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        work.rmdir()
    result["config"].update(world_size=WORLD, nvme_path=str(root), shards=shards)
    payload = {"benchmark": "nvme-quick" if args.quick else "nvme", "disk": disk, "tier": tier}
    payload.update(result)
    if not summarize(payload):
        progress("no training run produced a result")
        return None
    return {**payload, "losses_agree": loss_agreement(summarize(payload), "ram")["agree"]}


def _disk_per_step(payload: dict[str, Any], key: str) -> dict[str, float] | None:
    """Median over runs of rank 0's disk traffic per timed step: bytes and call seconds."""
    steps = payload["config"]["steps"]
    per_run = [r["ranks"][0].get("disk") for r in payload["runs"] if r["ok"] and r["key"] == key]
    per_run = [d for d in per_run if d]
    if not per_run:
        return None
    out = {}
    for kind in ("disk_read", "disk_write"):
        out[f"{kind}_bytes"] = statistics.median(d[kind][2] / steps for d in per_run)
        out[f"{kind}_s"] = statistics.median(d[kind][1] / steps for d in per_run)
    return out


def report(payload: dict[str, Any]) -> Report:
    disk, tier, cfg = payload["disk"], payload["tier"], payload["config"]
    summary = summarize(payload)
    table = systems_table(summary, {"in memory": "ram"})
    rows = []
    for key, s in summary.items():
        d = _disk_per_step(payload, key)
        if d is None or not d["disk_read_bytes"]:
            rows.append([s["label"], "-", "-", "-", "-", "-"])
            continue
        moved = d["disk_read_bytes"] + d["disk_write_bytes"]
        need = d["disk_read_bytes"] / (disk["read_gbs_median"] * 1e9)
        need += d["disk_write_bytes"] / (disk["write_gbs_median"] * 1e9)
        io_s = d["disk_read_s"] + d["disk_write_s"]
        rows.append(
            [
                s["label"],
                mib(d["disk_read_bytes"]),
                mib(d["disk_write_bytes"]),
                f"{io_s:.3f}",
                f"{moved / io_s / 1e9:.2f}" if io_s else "-",
                f"{need / s['median_step_s']:.2f}",
            ]
        )
    headers = [
        "system",
        "disk read / step / rank MiB",
        "written MiB",
        "I/O call s",
        "GB/s in the calls",
        "disk time needed / step time",
    ]
    pairs = [("nvme", "ram"), ("nvme_lr_bwd", "ram_lr_bwd"), ("nvme_both", "ram")]
    ratios = []
    for a, b in pairs:
        if a not in summary or b not in summary:
            continue
        step = summary[a]["median_step_s"] / summary[b]["median_step_s"]
        less = summary[b]["peak_rss_bytes"] - summary[a]["peak_rss_bytes"]
        rss = f"{mib(less)} MiB less" if less >= 0 else f"{mib(-less)} MiB more"
        ratios.append(
            f"{summary[a]['label']}: {step:.3f}x the step in memory (goal <= {GOAL_STEP:.2f}x "
            f"for a compute-bound step), peak RSS per rank "
            f"{summary[a]['peak_rss_bytes'] / summary[b]['peak_rss_bytes']:.2f}x ({rss})."
        )
    passes = ", ".join(f"{100 * p['achieved']:.0f} %" for p in tier["passes"])
    dims = cfg["dims"]
    tables = "\n\n".join(
        [
            f"Disk under {cfg['nvme_path']} (direct I/O: {disk['direct']}): write "
            f"{disk['write_gbs_median']:.2f} GB/s, read {disk['read_gbs_median']:.2f} GB/s "
            f"(median of 3 passes of {mib(disk['bytes'])} MiB in 8 MiB calls).",
            f"The tier alone (rank 0's {len(cfg['shards'])} records, AdamW, 3 buffers): "
            f"{100 * tier['achieved_median']:.0f} % of the disk's bandwidth (passes: {passes}; "
            f"goal >= {100 * GOAL_TIER:.0f} %).",
            table,
            "Disk traffic per timed step, rank 0 (the library's `disk_read` / `disk_write` "
            "transfers):",
            markdown_table(headers, rows),
            *ratios,
        ]
    )
    notes = [
        f"GPT d={dims['d']}, {dims['n_layers']} blocks, vocabulary {dims.get('vocab', 256)}, seq "
        f"{dims['seq']}, global batch {dims['global_batch']}: {cfg['params']:,} params; "
        f"{WORLD} gloo ranks x 1 thread; AdamW; {cfg['warmup']} warm-up + {cfg['steps']} timed "
        f"steps, {cfg['rounds']} rounds.",
        "Disk time needed = the step's bytes at the disk's measured read and write bandwidths; "
        "I/O call s = seconds inside preadv/pwritev (2 I/O threads per rank, which may overlap).",
        f"Losses agree with the state in memory: {payload.get('losses_agree')}.",
        f"whole benchmark {payload['total_wall_s']:.0f} s wall (training runs).",
    ]
    return Report("The disk tier: bandwidth and training step", tables, notes)
