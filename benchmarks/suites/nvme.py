"""NVMe: the disk's bandwidth, and training with the optimizer state (and compute copies) on disk.

In one run, under --nvme-path (a directory on the disk to measure): --disk-mib MiB written, then
read, with O_DIRECT in 8 MiB pwritev/preadv calls, three times (the medians are the device's
bandwidths here); then the GPT below on 2 gloo ranks, zero3_offload default with the optimizer
state in memory and on disk, each also with the learning rate passed to backward_pass, and with
the compute copies on disk too (offload_param_device nvme): step time, peak RSS, the disk traffic
of a step per rank (the `disk_read` / `disk_write` transfers of get_performance_stats()), losses
equal.
"""

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
    view, path, direct = (
        memoryview(buffer),
        directory / "disk-probe.bin",
        getattr(os, "O_DIRECT", 0),
    )
    flags, gbs = os.O_RDWR | os.O_CREAT | os.O_TRUNC | direct, {"write": [], "read": []}
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:  # no direct I/O on this filesystem: buffered, and said so
        flags &= ~direct
        fd = os.open(path, flags, 0o600)
    try:
        for _ in range(3):
            for way, call in (("write", os.pwritev), ("read", os.preadv)):
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
    out = {"direct": bool(flags & direct), "bytes": nbytes, "write_gbs": gbs["write"]}
    out.update(read_gbs=gbs["read"], write_gbs_median=statistics.median(gbs["write"]))
    return {**out, "read_gbs_median": statistics.median(gbs["read"])}


def disk_rows(part: dict[str, Any], runs: list[dict], disk: dict[str, Any]) -> dict[str, Any]:
    """Per system: rank 0's disk traffic per timed step (the median over runs), the seconds of
    its I/O calls, and the disk time those bytes need at the disk's bandwidths / the step's."""
    out, steps = {}, part["config"]["steps"]
    for key, s in part["systems"].items():
        out[key] = row = {"label": s["label"]}
        per_run = []  # rank 0's disk transfers over the timed steps: kind -> [seconds, bytes]
        for r in (r for r in runs if r["ok"] and r["key"] == key):
            timed = [st["stats"]["transfers"] for st in r["ranks"][0]["steps"][r["warmup"] :]]
            kinds = {k for t in timed for k in t if k.startswith("disk")}
            per_run.append(
                {
                    k: [sum(t[k][f] for t in timed if k in t) for f in ("time", "bytes")]
                    for k in kinds
                }
            )
        if not any(d.get("disk_read", [0, 0])[1] for d in per_run):  # in memory: no column of it
            continue
        for kind in ("disk_read", "disk_write"):
            row[f"{kind}_bytes"] = statistics.median(d[kind][1] / steps for d in per_run)
            row[f"{kind}_s"] = statistics.median(d[kind][0] / steps for d in per_run)
        io_s = row["disk_read_s"] + row["disk_write_s"]
        need = row["disk_read_bytes"] / (disk["read_gbs_median"] * 1e9)
        need += row["disk_write_bytes"] / (disk["write_gbs_median"] * 1e9)
        row.update(io_s=io_s, need=need / s["median_step_s"])
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
        progress(
            f"disk: write {disk['write_gbs_median']:.2f} GB/s, read {disk['read_gbs_median']:.2f} GB/s"
        )
        systems = {}
        for key, (options, label) in SYSTEMS.items():
            on_disk = (
                {"nvme_path": str(work / "tier")} if "offload_optimizer_device" in options else {}
            )
            systems[key] = System(label, "zero3_offload", WORLD, {**options, **on_disk})
        threads, spec = dict.fromkeys(systems, args.threads), {"stats": True}
        part, runs = train.compare(
            args,
            systems,
            dims,
            threads,
            spec=spec,
            reference="ram",
            world_size=WORLD,
            nvme_path=str(root),
        )
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
            f"{systems[a]['label']}: {step:.3f}x the step in memory (goal <= {GOAL_STEP:.2f}x for a "
            f"compute-bound step), peak RSS per rank "
            f"{systems[a]['peak_rss_bytes'] / systems[b]['peak_rss_bytes']:.2f}x ({rss})."
        )
    return [
        f"Disk under {p['config']['nvme_path']} (direct I/O: {disk['direct']}): write "
        f"{disk['write_gbs_median']:.2f} GB/s, read {disk['read_gbs_median']:.2f} GB/s (median of 3 "
        f"passes of {mib(disk['bytes'])} MiB in 8 MiB calls).",
        (peers.system_columns({"in memory": "ram"}), systems),
        "Disk traffic per timed step, rank 0 (the library's `disk_read` / `disk_write` transfers):",
        (DISK, p["disk_rows"]),
        *ratios,
    ]


NOTES = [
    "GPT d={config[dims][d]}, {config[dims][n_layers]} blocks, vocabulary {config[dims][vocab]}, "
    "seq {config[dims][seq]}, global batch {config[dims][global_batch]}: {config[params]:,} params; "
    "2 gloo ranks x 1 thread; AdamW; {config[warmup]} warm-up + {config[steps]} timed steps, "
    "{config[rounds]} rounds.",
    "Disk time needed = the step's bytes at the disk's measured read and write bandwidths; "
    "I/O call s = seconds inside preadv/pwritev (2 I/O threads per rank, which may overlap).",
    "Losses agree with the state in memory: {losses_agree}.",
    "whole benchmark {total_wall_s:.0f} s wall (training runs).",
]
