"""NVMe: the disk tier's bandwidth against the disk's, and training with the state on disk.

All in one run, under --nvme-path (a directory on the disk to measure):
1. The disk: --disk-mib MiB written, then read, with O_DIRECT in 8 MiB preadv/pwritev calls
   (the file is removed after), three times each; the median is the device's bandwidth here.
2. The tier alone: an NvmeShardTier holding the records of the training model's layers (rank 0's
   shards of 2), each made resident and written back in turn as an optimizer step does (reads
   run ahead into its 3 buffers, writes behind), three passes; the bytes it moved are the
   kernel's count (/proc/self/io); achieved = the seconds the disk needs for them at the step-1
   bandwidths / the tier's wall seconds (goal >= 70 %).
3. Training: the GPT below on 2 gloo ranks, zero3_offload default with the optimizer state in
   memory and on disk, each also with the learning rate passed to backward_pass (the updates,
   and so the disk traffic, overlap the backward), and with the compute copies on disk too
   (offload_param_device nvme: every gather reads its layer's copy); step time, peak RSS, the
   disk traffic of a step per rank (the `disk_read` / `disk_write` transfers of
   get_performance_stats()), losses equal.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import train, workload
from harness.render import Col, mib
from harness.runner import progress
from harness.systems import System

from suites import peers

WORLD, CHUNK = 2, 8 * 2**20
GOAL_TIER = 0.70  # of the disk's bandwidth
GOAL_STEP = 1.15  # step on disk / step in memory, for a compute-bound step
OPTIONS = {
    "--nvme-path": {"help": "directory on the disk to measure (a temporary one under /var/tmp)"},
    "--disk-mib": {"type": int, "help": "MiB written and read to measure the disk"},
    "--batch": {"type": int, "help": "global batch of the training runs"},
    "--blocks": {"type": int, "help": "GPT blocks of the training runs"},
}
TAKES = ["rounds", "seed", "timeout", "keep", "mmap_threshold"]
DEFAULTS = {"threads": 1, "warmup": 1, "repeats": 4, "disk_mib": 1024, "batch": 64}
DEFAULTS.update(blocks=6, rounds=2, timeout=1800.0, seed=0)
QUICK = {"warmup": 1, "repeats": 2, "disk_mib": 64, "batch": 8, "blocks": 2, "rounds": 1}
QUICK["timeout"] = 300.0
TITLE = "The disk tier: bandwidth and training step"
NVME = {"offload_optimizer_device": "nvme"}
SYSTEMS = {
    "ram": ({}, "state in memory"),
    "nvme": (NVME, "state on disk"),
    "ram_lr_bwd": ({"lr_in_backward": True}, "state in memory, lr in backward"),
    "nvme_lr_bwd": ({**NVME, "lr_in_backward": True}, "state on disk, lr in backward"),
    "nvme_both": ({**NVME, "offload_param_device": "nvme"}, "state and compute copies on disk"),
}
PAIRS = [("nvme", "ram"), ("nvme_lr_bwd", "ram_lr_bwd"), ("nvme_both", "ram")]
DISK = [
    Col("system", "label"),
    Col("disk read / step / rank MiB", "disk_read_bytes", "mib"),
    Col("written MiB", "disk_write_bytes", "mib"),
    Col("I/O call s", "io_s", ".3f"),
    Col("GB/s in the calls", "gbs", ".2f"),
    Col("disk time needed / step time", "need", ".2f"),
]


def check(args: Any) -> str | None:
    if min(args.disk_mib, args.batch, args.blocks, args.rounds, args.repeats) < 1:
        return "--disk-mib, --batch, --blocks, --rounds and --repeats must be >= 1"
    return f"--batch must divide over {WORLD} ranks" if args.batch % WORLD else None


def disk_bandwidth(directory: Path, nbytes: int) -> dict[str, Any]:
    """Write then read ``nbytes`` with O_DIRECT in CHUNK calls, three times: GB/s each way."""
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(CHUNK))
    view, path = memoryview(buffer), directory / "disk-probe.bin"
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    writes, reads = [], []
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:  # no direct I/O on this filesystem: buffered, and said so
        flags &= ~getattr(os, "O_DIRECT", 0)
        fd = os.open(path, flags, 0o600)
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
    out = {"direct": bool(flags & getattr(os, "O_DIRECT", 0)), "bytes": nbytes}
    out.update(write_gbs=writes, read_gbs=reads, write_gbs_median=statistics.median(writes))
    return {**out, "read_gbs_median": statistics.median(reads)}


def io_counts() -> tuple[int, int]:
    """Bytes this process has passed through read and write calls (the kernel's count)."""
    with open("/proc/self/io", encoding="ascii") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def tier_bandwidth(directory: Path, layers: dict[str, int], disk: dict[str, Any]) -> dict:
    """An NvmeShardTier with ``layers``' records (AdamW: master and two moments), every layer
    resident and written back in turn, three passes: bytes, wall seconds, achieved fraction."""
    import torch

    from zero3_offload.comm.worker_threads import WorkerThreads
    from zero3_offload.optimizer_state.disk_tier import NvmeShardTier
    from zero3_offload.stats.timeline import Timeline
    from zero3_offload.storage.rank_directory import RankDirectory

    async def passes() -> list[dict[str, float]]:
        io, claim = WorkerThreads(threads=2, timeline=Timeline(rank=0)), RankDirectory(directory, 0)
        keys = ("exp_avg", "exp_avg_sq")
        tier = NvmeShardTier(claim.path, layers=layers, state_keys=keys, buffers=3, io=io)
        masters, states = {n: torch.empty(0) for n in layers}, {n: {} for n in layers}
        out = []

        async def one(name: str) -> None:
            async with tier.resident(name, masters[name], states[name], write=True):
                pass  # an update's work would run here

        try:
            for name in layers:
                tier.write_initial(name, torch.zeros(layers[name]))
            for _ in range(3):
                before, start = io_counts(), time.perf_counter()
                await asyncio.gather(*(one(name) for name in layers))
                wall, (read, written) = time.perf_counter() - start, io_counts()
                read, written = read - before[0], written - before[1]
                need = read / (disk["read_gbs_median"] * 1e9) + written / (
                    disk["write_gbs_median"] * 1e9
                )
                out.append(
                    {"read": read, "written": written, "wall_s": wall, "achieved": need / wall}
                )
        finally:
            tier.close()
            claim.remove()
        return out

    runs = asyncio.run(passes())
    return {"passes": runs, "achieved_median": statistics.median(r["achieved"] for r in runs)}


def disk_rows(part: dict[str, Any], runs: list[dict], disk: dict[str, Any]) -> dict[str, Any]:
    """Per system: rank 0's disk traffic per timed step (the median over runs), the seconds of
    its I/O calls, and the disk time those bytes need at the disk's bandwidths / the step's."""
    out = {}
    for key, s in part["systems"].items():
        per_run = [
            d for r in runs if r["ok"] and r["key"] == key if (d := r["ranks"][0].get("disk"))
        ]
        row, steps = {"label": s["label"]}, part["config"]["steps"]
        for kind in ("disk_read", "disk_write") if per_run else ():
            row[f"{kind}_bytes"] = statistics.median(d[kind][2] / steps for d in per_run)
            row[f"{kind}_s"] = statistics.median(d[kind][1] / steps for d in per_run)
        if row.get("disk_read_bytes"):
            io_s = row["disk_read_s"] + row["disk_write_s"]
            need = row["disk_read_bytes"] / (disk["read_gbs_median"] * 1e9)
            need += row["disk_write_bytes"] / (disk["write_gbs_median"] * 1e9)
            row.update(io_s=io_s, need=need / s["median_step_s"])
            if io_s:
                row["gbs"] = (row["disk_read_bytes"] + row["disk_write_bytes"]) / io_s / 1e9
        else:  # in memory: no column of it
            row = {"label": s["label"]}
        out[key] = row
    return out


def run(args: Any) -> dict[str, Any] | None:
    import torch

    from zero3_offload import Zero3RankMapping

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
            f"disk: write {disk['write_gbs_median']:.2f} GB/s, read {disk['read_gbs_median']:.2f} "
            f"GB/s"
        )
        torch.manual_seed(args.seed)
        mapping = Zero3RankMapping(rank=0, world_size=WORLD)
        numels = {
            n: sum(p.numel() for p in m.parameters())
            for n, m in workload.build(dims).named_children()
        }
        shards = {n: mapping.shard_numel(k) for n, k in numels.items() if k}
        tier = tier_bandwidth(work, shards, disk)
        progress(f"tier alone: {100 * tier['achieved_median']:.0f} % of the disk's bandwidth")
        nvme_path = {"nvme_path": str(work / "tier")}
        systems = {}
        for key, (options, label) in SYSTEMS.items():
            on_disk = {**nvme_path} if "offload_optimizer_device" in options else {}
            systems[key] = System(label, "zero3_offload", WORLD, {**options, **on_disk})
        threads = dict.fromkeys(systems, args.threads)
        compared = train.compare(args, systems, dims, threads=threads, spec={"stats": True})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in compared["runs"]:  # rank 0's disk transfers over the timed steps: transfers, s, bytes
        for rk in r["ranks"][:1]:
            timed = [s["stats"]["transfers"] for s in rk["steps"][r["warmup"] :]]
            kinds = {k for t in timed for k in t if k.startswith("disk")}
            rk["disk"] = {
                k: [sum(t[k][f] for t in timed if k in t) for f in ("transfers", "time", "bytes")]
                for k in kinds
            }
    config = dict(world_size=WORLD, nvme_path=str(root), shards=len(shards))
    part = train.part(compared, reference="ram", **config)
    if not part["systems"]:
        return None
    out = {"benchmark": "nvme-quick" if args.quick else "nvme", "disk": disk, "tier": tier, **part}
    out["disk_rows"] = disk_rows(part, compared["runs"], disk)
    return {**out, "losses_agree": part["agreement"]["agree"]}


def layout(p: dict[str, Any]) -> list:
    disk, tier, cfg, systems = p["disk"], p["tier"], p["config"], p["systems"]
    passes = ", ".join(f"{100 * x['achieved']:.0f} %" for x in tier["passes"])
    ratios = []
    for a, b in [(a, b) for a, b in PAIRS if a in systems and b in systems]:
        step = systems[a]["median_step_s"] / systems[b]["median_step_s"]
        less = systems[b]["peak_rss_bytes"] - systems[a]["peak_rss_bytes"]
        rss = f"{mib(less)} MiB less" if less >= 0 else f"{mib(-less)} MiB more"
        ratios.append(
            f"{systems[a]['label']}: {step:.3f}x the step in memory (goal <= {GOAL_STEP:.2f}x for "
            f"a "
            f"compute-bound step), peak RSS per rank "
            f"{systems[a]['peak_rss_bytes'] / systems[b]['peak_rss_bytes']:.2f}x ({rss})."
        )
    return [
        f"Disk under {cfg['nvme_path']} (direct I/O: {disk['direct']}): write "
        f"{disk['write_gbs_median']:.2f} GB/s, read {disk['read_gbs_median']:.2f} GB/s (median of "
        f"3 "
        f"passes of {mib(disk['bytes'])} MiB in 8 MiB calls).",
        f"The tier alone (rank 0's {cfg['shards']} records, AdamW, 3 buffers): "
        f"{100 * tier['achieved_median']:.0f} % of the disk's bandwidth (passes: {passes}; goal >= "
        f"{100 * GOAL_TIER:.0f} %).",
        (peers.system_columns({"in memory": "ram"}), systems),
        "Disk traffic per timed step, rank 0 (the library's `disk_read` / `disk_write` transfers):",
        (DISK, p["disk_rows"]),
        *ratios,
    ]


NOTES = [
    lambda p: (
        f"GPT d={p['config']['dims']['d']}, {p['config']['dims']['n_layers']} blocks, "
        f"vocabulary {p['config']['dims'].get('vocab', 256)}, seq {p['config']['dims']['seq']}, "
        f"global "
        f"batch {p['config']['dims']['global_batch']}: {p['config']['params']:,} params; {WORLD} "
        f"gloo "
        f"ranks x 1 thread; AdamW; {p['config']['warmup']} warm-up + {p['config']['steps']} timed "
        f"steps, {p['config']['rounds']} rounds."
    ),
    "Disk time needed = the step's bytes at the disk's measured read and write bandwidths; "
    "I/O call s = seconds inside preadv/pwritev (2 I/O threads per rank, which may overlap).",
    "Losses agree with the state in memory: {losses_agree}.",
    "whole benchmark {total_wall_s:.0f} s wall (training runs).",
]
