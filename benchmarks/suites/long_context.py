"""Long sequences: peak RSS per rank and tokens/s against the sequence length (one sequence per
data-parallel rank); plain torch, FSDP2, DeepSpeed ZeRO-3 (and ALST's pieces), ours at S=1, 2.

Lengths double from the model's first; past --compare-seq only the systems still under
--limit-mib go on, up to --max-seq; the longest length under the limit is reported."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from harness import train
from harness.render import MIB, Col
from harness.systems import System

from zero3_offload.memory.allocator import TRAIN_MMAP_THRESHOLD

W, LLAMA = 2, {"model": "llama", "vocab": 32000}
MODELS = {  # name: dims, first length; the issue's model and hf-peers' ~300M Llama
    "small": ({**LLAMA, "d": 256, "ffn": 688, "n_layers": 4, "heads": 4, "kv_heads": 2}, 1024),
    "llama300m": ({**LLAMA, "d": 1024, "ffn": 2816, "n_layers": 20, "heads": 16, "kv_heads": 8},
                  2048),
    "quick": ({**LLAMA, "vocab": 4096, "d": 64, "ffn": 176, "n_layers": 2, "heads": 4,
               "kv_heads": 2}, 128),
}  # fmt: skip
AC, FSDP = {"activation_checkpointing": True}, {"wrap": "decoder_layers"}
TILED = {**AC, "mlp_chunk_tokens": 1024}  # and the tiled loss (256 tokens), on by default
ONE, TWO = {"global_batch": 1}, {"global_batch": 2}  # one sequence per data-parallel rank
SYSTEMS = {
    "torch": System("plain torch (1 process)", "torch", 1, {}, ONE),
    "torch_ac": System("plain torch + AC", "torch", 1, {"checkpoint": True}, ONE),
    "fsdp2": System("FSDP2", "fsdp2", W, FSDP, TWO),
    "fsdp2_ac": System("FSDP2 + AC", "fsdp2", W, {**FSDP, "checkpoint": True}, TWO),
    "deepspeed_ac": System("DeepSpeed ZeRO-3 offload + AC", "deepspeed", W, {"checkpoint": True},
                           TWO),
    "deepspeed_alst": System("DeepSpeed ZeRO-3 offload + AC + ALST's TiledMLP, tiled loss",
                             "deepspeed-alst", W, {"tile": 1024, "loss_tile": 256}, TWO),
    "deepspeed_ulysses": System("DeepSpeed ZeRO-3 offload + AC + ALST: Ulysses S=2, TiledMLP, "
                                "tiled loss", "deepspeed-alst", W,
                                {"tile": 1024, "loss_tile": 256, "sequence_parallel_size": 2}, ONE),
    "ours_untiled": System("ours S=1, AC, untiled", "ours-module", W,
                           {**AC, "loss_chunk_tokens": 0}, TWO),
    "ours_s1": System("ours S=1, AC, tiled loss and MLP", "ours-module", W, TILED, TWO),
    "ours_s2": System("ours S=2, AC, tiled loss and MLP", "ours-module", W,
                      {**TILED, "sequence_parallel_size": 2}, ONE),
}  # fmt: skip
OPTIONS = {
    "--models": {"default": "small", "help": f"comma-separated subset of {', '.join(MODELS)}"},
    "--systems": {"help": f"comma-separated subset of {', '.join(SYSTEMS)}"},
    "--limit-mib": {"type": float, "default": 1536.0, "help": "the per-rank peak RSS limit"},
    "--compare-seq": {"type": int, "default": 8192, "help": "every system runs up to this length"},
    "--max-seq": {"type": int, "default": 32768, "help": "the longest length tried"},
}
TAKES = ["seed", "timeout", "keep", "mmap_threshold"]
DEFAULTS = {"threads": 1, "warmup": 1, "repeats": 1, "rounds": 1, "timeout": 3600.0, "seed": 0}
DEFAULTS["mmap_threshold"] = TRAIN_MMAP_THRESHOLD  # MALLOC_MMAP_THRESHOLD_, as `train` sets
QUICK = {"timeout": 300.0}
TITLE = "Long sequences: peak RSS per rank and tokens/s against the sequence length"
GOALS = {  # name: (measured as, wanted, at least?)
    "peak S=1 / plain torch's at the compared length": ("ours_s1/torch peak", 0.3, False),
    "peak S=2 / plain torch's at the compared length": ("ours_s2/torch peak", 0.2, False),
    "longest under the limit, S=2 / plain torch + AC's": ("ours_s2/torch_ac longest", 16, True),
    "longest under the limit, S=2 / FSDP2 + AC's": ("ours_s2/fsdp2_ac longest", 8, True),
    "tokens/s S=1 / untiled at the compared length": ("ours_s1/ours_untiled speed", 0.85, True),
}


def check(args: Any) -> str | None:
    args.model_keys = ["quick"] if args.quick else args.models.split(",")
    args.system_keys = args.systems.split(",") if args.systems else list(SYSTEMS)
    if unknown := (set(args.model_keys) - set(MODELS)) | (set(args.system_keys) - set(SYSTEMS)):
        return f"unknown models or systems {sorted(unknown)}"
    args.compare_seq, args.max_seq = (256, 512) if args.quick else (args.compare_seq, args.max_seq)
    return "--max-seq must be >= --compare-seq" if args.max_seq < args.compare_seq else None


def figures(run: dict[str, Any], seq: int, system: System) -> dict[str, Any]:
    """A run's peak (the largest rank's), losses and tokens/s (a sequence per group)."""
    if not run["ok"]:
        return {"error": run["error"]}
    groups, step = system.world // system.options.get("sequence_parallel_size", 1), 0.0
    step = train.run_median(run)
    peak = max(rk["peak_rss_bytes"] for rk in run["ranks"])
    return {"peak": peak, "losses": train.global_losses(run), "speed": groups * seq / step}


def sweep(args: Any, model: str) -> dict[str, Any]:
    """The chosen systems at lengths doubling from the model's first (see the docstring)."""
    live = {k: SYSTEMS[k] for k in args.system_keys}
    if importlib.util.find_spec("deepspeed") is None:  # an optional extra
        live = {k: s for k, s in live.items() if not s.kind.startswith("deepspeed")}
    dims, seq = MODELS[model]
    limit, lengths, longest = args.limit_mib * MIB, {}, dict.fromkeys(live)
    while live and seq <= args.max_seq:
        size = {**dims, "seq": seq, "global_batch": 1, "warmup": args.warmup}
        runs = train.train_runs(args, live, {str(seq): {**size, "timed_steps": args.repeats}},
                                dict.fromkeys(live, args.threads))  # fmt: skip
        rows = lengths[str(seq)] = {r["key"]: figures(r, seq, live[r["key"]]) for r in runs}
        for key, row in rows.items():  # the first step's loss against the same data's
            ref = rows.get("torch" if SYSTEMS[key].dims is ONE else "fsdp2", {})
            if "losses" in row and "losses" in ref:
                row["loss_diff"] = abs(row["losses"][0] - ref["losses"][0])
            if (base := rows.get("torch", {}).get("peak")) and "peak" in row and key != "torch":
                row["vs_torch"] = row["peak"] / base
        fits = {k for k, r in rows.items() if r.get("peak", limit + 1) <= limit}
        longest.update(dict.fromkeys(fits, seq))
        live = {k: s for k, s in live.items() if k in fits or seq < args.compare_seq}
        seq *= 2
    at = lengths.get(str(args.compare_seq), {})
    goals = {}
    for name, (how, want, at_least) in GOALS.items():
        pair, field = how.split()
        a, b = pair.split("/")
        x, y = ((longest.get(a), longest.get(b)) if field == "longest"
                else (at.get(a, {}).get(field), at.get(b, {}).get(field)))  # fmt: skip
        got = x / y if x and y else None
        met = None if got is None else got >= want if at_least else got <= want
        goals[name] = {"want": f"{'>=' if at_least else '<='} {want:g}", "got": got, "met": met}
    return {"dims": dims, "lengths": lengths, "longest": longest, "goals": goals}


def run(args: Any) -> dict[str, Any]:
    started = time.perf_counter()
    parts = {model: sweep(args, model) for model in args.model_keys}
    config = {k: getattr(args, k) for k in ("limit_mib", "compare_seq", "max_seq", "warmup")}
    config.update(steps=args.repeats, seed=args.seed, lr=train.LR)
    config["systems"] = {k: SYSTEMS[k]._asdict() for k in args.system_keys}
    every = [(f"{m} {n} {k}", r) for m, p in parts.items() for n, rows in p["lengths"].items()
             for k, r in rows.items()]  # fmt: skip
    failed = [f"{name}: {r['error']}" for name, r in every if "error" in r]
    return {"config": config, "parts": parts, "failed": failed,
            "total_wall_s": time.perf_counter() - started}  # fmt: skip


def cells(rows: dict[str, Any], show: Any) -> dict[str, str]:
    return {k: "FAILED" if "error" in r else show(k, r) for k, r in rows.items()}


def peak_cell(key: str, row: dict[str, Any]) -> str:
    return f"{row['peak'] / MIB:,.0f}" + (f" ({row['vs_torch']:.2f}x)" if "vs_torch" in row else "")


def layout(p: dict[str, Any]) -> list:
    blocks: list = []
    names = {k: s["label"] for k, s in p["config"]["systems"].items()}
    cols = [Col("tokens", "seq"), *(Col(label, k) for k, label in names.items())]
    for model, part in p["parts"].items():
        d = part["dims"]
        blocks.append(f"{model}: transformers Llama, d={d['d']}, {d['n_layers']} layers, "
                      f"{d['heads']} heads / {d['kv_heads']} KV, MLP {d['ffn']}, vocabulary "
                      f"{d['vocab']}. Peak RSS per rank, MiB (x plain torch's):")  # fmt: skip
        peaks, speeds, losses = [], [], []
        for seq, rows in part["lengths"].items():
            n = {"seq": f"{int(seq):,}"}
            peaks.append({**n, **cells(rows, peak_cell)})
            speeds.append({**n, **cells(rows, lambda k, r: f"{r['speed']:,.0f}")})
            losses.append({**n, **cells(rows, lambda k, r: f"{r.get('loss_diff', 0):.1e}")})
        fit = {k: f"{v:,}" if v else "none" for k, v in part["longest"].items()}
        goals = [{"goal": g, **v, "got": "-" if v["got"] is None else f"{v['got']:.3g}",
                  "met": {None: "-", True: "yes", False: "NO"}[v["met"]]}
                 for g, v in part["goals"].items()]  # fmt: skip
        blocks += [(cols, peaks), "Tokens/s (all ranks together):", (cols, speeds)]
        same = "plain torch's (global batch 1) or FSDP2's (global batch 2) on the same data:"
        blocks += [f"The first step's loss, |difference| from {same}", (cols, losses)]
        limit = f"The longest sequence whose peak stays under {p['config']['limit_mib']:,.0f} MiB:"
        blocks += [limit, (cols[1:], [fit]), "Goals:"]
        blocks.append(([Col("goal", "goal"), Col("wanted", "want"), Col("measured", "got"),
                        Col("met", "met")], goals))  # fmt: skip
    return blocks


NOTES = [
    "One sequence per data-parallel rank per step ({config[warmup]} warm-up + {config[steps]} "
    "timed step(s) per run, fresh processes; S=2: the 2 ranks train one sequence, half each), "
    "AdamW lr {config[lr]}, seed {config[seed]}. Peak RSS: the largest rank's VmHWM over the "
    "whole run. AC: each decoder layer recomputed in backward (plain torch and FSDP2: "
    "checkpoint_wrapper, torchtitan's full AC; DeepSpeed: transformers' gradient checkpointing).",
    "Lengths double; past {config[compare_seq]} tokens only the systems under the limit go on, "
    "up to {config[max_seq]}. Whole benchmark {total_wall_s:.0f} s wall.",
]
