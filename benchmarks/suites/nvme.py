"""NVMe: the disk's bandwidth, and training with the optimizer state (and compute copies) on disk.

The disk's O_DIRECT bandwidth under --nvme-path, then peers' comparison of the state's places."""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import train
from harness.render import Col, mib
from harness.runner import progress
from harness.systems import System

from suites import peers

WORLD, CHUNK = 2, 8 * 2**20
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
NVME, LR_BWD = {"offload_optimizer_device": "nvme"}, {"lr_in_backward": True}
SYSTEMS = {
    "ram": ({}, "state in memory"),
    "nvme": (NVME, "state on disk"),
    "ram_lr_bwd": (LR_BWD, "state in memory, lr in backward"),
    "nvme_lr_bwd": ({**NVME, **LR_BWD}, "state on disk, lr in backward"),
    "nvme_both": ({**NVME, "offload_param_device": "nvme"}, "state and compute copies on disk"),
}
PAIRS = [("nvme", "ram"), ("nvme_lr_bwd", "ram_lr_bwd"), ("nvme_both", "ram")]
# fmt: off
DISK = [Col("system", "label"), Col("disk read / step / rank MiB", "disk_read_bytes", "mib"),
        Col("written MiB", "disk_write_bytes", "mib"), Col("I/O call s", "io_s", ".3f"),
        Col("GB/s in the calls", "gbs", ".2f"), Col("disk time needed / step time", "need", ".2f")]
# fmt: on


def check(args: Any) -> str | None:
    if min(args.disk_mib, args.batch, args.blocks) < 1 or args.batch % WORLD:
        return f"--disk-mib, --batch and --blocks must be >= 1, --batch divide over {WORLD} ranks"
    return None


def disk_bandwidth(directory: Path, nbytes: int) -> dict[str, Any]:
    """Write then read ``nbytes`` with O_DIRECT in CHUNK calls, three times: GB/s each way."""
    buffer, path, direct = mmap.mmap(-1, CHUNK), directory / "disk-probe.bin", os.O_DIRECT
    buffer.write(os.urandom(CHUNK))  # an mmap is page-aligned, as O_DIRECT needs
    view, flags = memoryview(buffer), os.O_RDWR | os.O_CREAT | os.O_TRUNC
    gbs: dict[str, list[float]] = {"write": [], "read": []}
    try:
        fd = os.open(path, flags | direct, 0o600)
    except OSError:  # no direct I/O on this filesystem: buffered, and said so
        fd, direct = os.open(path, flags, 0o600), 0
    try:
        for way, call in [("write", os.pwritev), ("read", os.preadv)] * 3:
            start = time.perf_counter()
            for offset in range(0, nbytes, CHUNK):
                call(fd, [view], offset)
            if way == "write":
                os.fsync(fd)
            gbs[way].append(nbytes / (time.perf_counter() - start) / 1e9)
    finally:
        os.close(fd)
        path.unlink()
        view.release()
        buffer.close()
    out = {"direct": bool(direct), "bytes": nbytes, **{f"{way}_gbs": v for way, v in gbs.items()}}
    return {**out, **{f"{way}_gbs_median": statistics.median(v) for way, v in gbs.items()}}


def disk_rows(part: dict[str, Any], runs: list[dict], disk: dict[str, Any]) -> dict[str, Any]:
    """Per system: rank 0's disk traffic and I/O seconds per timed step, against the disk's."""
    out, steps, median = {}, part["config"]["steps"], statistics.median

    def per_step(transfers: list[dict], kind: str, field: str) -> float:
        return sum(t.get(kind, {}).get(field, 0) for t in transfers) / steps

    for key, s in part["systems"].items():
        out[key] = row = {"label": s["label"]}
        ok = [r for r in runs if r["ok"] and r["key"] == key]  # rank 0's, over the timed steps:
        per_run = [[st["stats"]["transfers"] for st in train.timed(r)[0]] for r in ok]
        if not any(per_step(t, "disk_read", "bytes") for t in per_run):  # in memory: no columns
            continue
        for kind in ("disk_read", "disk_write"):
            row[f"{kind}_bytes"] = median(per_step(t, kind, "bytes") for t in per_run)
            row[f"{kind}_s"] = median(per_step(t, kind, "time") for t in per_run)
        io_s = row["io_s"] = row["disk_read_s"] + row["disk_write_s"]
        need = row["disk_read_bytes"] / (disk["read_gbs_median"] * 1e9)
        need += row["disk_write_bytes"] / (disk["write_gbs_median"] * 1e9)
        row["need"] = need / s["median_step_s"]
        if io_s:
            row["gbs"] = (row["disk_read_bytes"] + row["disk_write_bytes"]) / io_s / 1e9
    return out


def run(args: Any) -> dict[str, Any] | None:
    root = Path(args.nvme_path) if args.nvme_path else Path(tempfile.mkdtemp(dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nvme-bench-", dir=root))
    dims = dict(d=512, heads=8, n_layers=args.blocks, seq=128, vocab=8192, global_batch=args.batch)
    dims.update(dict(d=128, heads=4, vocab=256) if args.quick else {})
    try:
        progress(f"disk: {args.disk_mib} MiB written and read with O_DIRECT under {root}")
        disk = disk_bandwidth(work, args.disk_mib * 2**20)
        systems, tier = {}, {"nvme_path": str(work / "tier")}
        for key, (options, label) in SYSTEMS.items():
            on_disk = tier if "offload_optimizer_device" in options else {}
            systems[key] = System(label, "zero3_offload", WORLD, {**options, **on_disk})
        threads, config = dict.fromkeys(systems, args.threads), {"world_size": WORLD}
        config.update(spec={"stats": True}, reference="ram", nvme_path=str(root))
        part, runs = train.compare(args, systems, dims, threads, **config)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not part["systems"]:
        return None
    out = {"disk": disk, **part, "disk_rows": disk_rows(part, runs, disk)}
    return {**out, "losses_agree": part["agreement"]["agree"]}


def layout(p: dict[str, Any]) -> list:
    disk, systems = p["disk"], p["systems"]
    ratios = []
    for a, b in [(a, b) for a, b in PAIRS if a in systems and b in systems]:
        step = systems[a]["median_step_s"] / systems[b]["median_step_s"]
        less = systems[b]["peak_rss_bytes"] - systems[a]["peak_rss_bytes"]
        rss = f"{mib(less)} MiB less" if less >= 0 else f"{mib(-less)} MiB more"
        ratios.append(
            f"{systems[a]['label']}: {step:.3f}x the step in memory (goal <= {GOAL_STEP:.2f}x for "
            "a compute-bound step), peak RSS per rank "
            f"{systems[a]['peak_rss_bytes'] / systems[b]['peak_rss_bytes']:.2f}x ({rss})."
        )
    return [
        f"Disk under {p['config']['nvme_path']} (direct I/O: {disk['direct']}): write "
        f"{disk['write_gbs_median']:.2f} GB/s, read {disk['read_gbs_median']:.2f} GB/s (median of "
        f"3 passes of {mib(disk['bytes'])} MiB in 8 MiB calls).",
        (peers.system_columns({"in memory": "ram"}), systems),
        "Disk traffic per timed step, rank 0 (the library's `disk_read` / `disk_write` transfers):",
        (DISK, p["disk_rows"]),
        *ratios,
    ]


NOTES = [
    "GPT d={config[dims][d]}, {config[dims][n_layers]} blocks, vocabulary {config[dims][vocab]}, "
    "seq {config[dims][seq]}, global batch {config[dims][global_batch]}: {config[params]:,} "
    "params; 2 gloo ranks x 1 thread; AdamW; {config[warmup]} warm-up + {config[steps]} timed "
    "steps, {config[rounds]} rounds.",
    "Disk time needed = the step's bytes at the disk's measured read and write bandwidths; "
    "I/O call s = seconds inside preadv/pwritev (2 I/O threads per rank, which may overlap).",
    "Losses agree with the state in memory: {losses_agree}.",
    "whole benchmark {total_wall_s:.0f} s wall (training runs).",
]
