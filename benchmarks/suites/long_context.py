"""Long sequences: peak RSS per rank and tokens/s against the sequence length, one sequence per
data-parallel rank; plain torch, FSDP2, DeepSpeed ZeRO-3 and ours at S = 1 and S = 2.

Lengths double from the first; past --compare-seq only the systems still under --limit-mib go
on, up to --max-seq. The longest length under the limit is reported per system."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from harness import train
from harness.render import MIB, Col
from harness.systems import System

WORLD = 2
MODELS = {  # name: dims; the model and the ~300M Llama of hf-peers
    "small": dict(model="llama", d=256, ffn=688, n_layers=4, heads=4, kv_heads=2, vocab=32000),
    "llama300m": dict(model="llama", d=1024, ffn=2816, n_layers=20, heads=16, kv_heads=8,
                      vocab=32000),
    "quick": dict(model="llama", d=64, ffn=176, n_layers=2, heads=4, kv_heads=2, vocab=4096),
}  # fmt: skip
FIRST = {"small": 1024, "llama300m": 2048, "quick": 128}
AC = {"activation_checkpointing": True}
NO_TILES = {**AC, "loss_chunk_tokens": 0}  # the model's own loss, full logits
TILED = {**AC, "mlp_chunk_tokens": 1024}  # and the tiled loss (on by default)
ONE, TWO = {"global_batch": 1}, {"global_batch": 2}  # one sequence per data-parallel rank
SYSTEMS = {
    "torch": System("plain torch (1 process)", "torch", 1, {}, ONE),
    "torch_ac": System("plain torch + AC", "torch", 1, {"checkpoint": True}, ONE),
    "fsdp2": System("FSDP2", "fsdp2", WORLD, {"wrap": "decoder_layers"}, TWO),
    "fsdp2_ac": System("FSDP2 + AC", "fsdp2", WORLD, {"wrap": "decoder_layers", "checkpoint": True},
                       TWO),
    "deepspeed": System("DeepSpeed ZeRO-3 offload", "deepspeed", WORLD, {}, TWO),
    "deepspeed_ac": System("DeepSpeed ZeRO-3 offload + AC", "deepspeed", WORLD,
                           {"checkpoint": True}, TWO),
    "deepspeed_alst": System("DeepSpeed ZeRO-3 offload + AC, ALST's TiledMLP and tiled loss",
                             "deepspeed-alst", WORLD, {"tile": 1024}, TWO),
    "ours_untiled": System("ours S=1, AC, untiled", "ours-module", WORLD, NO_TILES, TWO),
    "ours_s1": System("ours S=1, AC, tiled loss and MLP", "ours-module", WORLD, TILED, TWO),
    "ours_s2": System("ours S=2, AC, tiled loss and MLP", "ours-module", WORLD,
                      {**TILED, "sequence_parallel_size": 2}, ONE),
}  # fmt: skip
OPTIONS = {
    "--models": {"default": "small", "help": f"comma-separated subset of {', '.join(MODELS)}"},
    "--systems": {"help": f"comma-separated subset of {', '.join(SYSTEMS)}"},
    "--limit-mib": {"type": float, "default": 1536.0, "help": "the per-rank peak RSS limit"},
    "--compare-seq": {"type": int, "default": 8192, "help": "every system runs up to this length"},
    "--max-seq": {"type": int, "default": 65536, "help": "the longest length tried"},
}
TAKES = ["seed", "timeout", "keep", "mmap_threshold"]
DEFAULTS = {"threads": 1, "warmup": 1, "repeats": 2, "rounds": 1, "timeout": 3600.0, "seed": 0}
DEFAULTS["mmap_threshold"] = 1 << 20  # MALLOC_MMAP_THRESHOLD_, as `zero3-offload train` sets
QUICK = {"timeout": 300.0, "repeats": 1}
TITLE = "Long sequences: peak RSS per rank and tokens/s against the sequence length"
GOALS = {"s1_vs_torch": 0.3, "s2_vs_torch": 0.2, "longest_vs_torch": 16, "longest_vs_fsdp2": 8}
GOALS["tokens_vs_untiled"] = 0.85


def check(args: Any) -> str | None:
    args.model_keys = ["quick"] if args.quick else args.models.split(",")
    args.system_keys = args.systems.split(",") if args.systems else list(SYSTEMS)
    if unknown := (set(args.model_keys) - set(MODELS)) | (set(args.system_keys) - set(SYSTEMS)):
        return f"unknown models or systems {sorted(unknown)}"
    if args.quick:
        args.compare_seq, args.max_seq = 256, 512
    if args.max_seq < args.compare_seq:
        return "--max-seq must be >= --compare-seq"
    return None


def tokens_per_s(run: dict[str, Any], seq: int, system: System) -> float:
    """The sequences a step trains (one per data-parallel group) x ``seq`` / the median step."""
    groups = system.world // system.options.get("sequence_parallel_size", 1)
    return groups * seq / train.run_median(run)


def sweep(args: Any, model: str) -> dict[str, Any]:
    """Every chosen system at lengths doubling from the model's first; past the compared length
    only those under the limit; per length the runs' figures, per system its longest fit."""
    systems = {k: SYSTEMS[k] for k in args.system_keys}
    if importlib.util.find_spec("deepspeed") is None:
        systems = {k: s for k, s in systems.items() if not s.kind.startswith("deepspeed")}
    limit, lengths, fits = args.limit_mib * MIB, {}, {k: None for k in systems}
    seq, live = FIRST[model], dict(systems)
    while live and seq <= args.max_seq:
        dims = {**MODELS[model], "seq": seq, "global_batch": 1}
        size = {**dims, "warmup": args.warmup, "timed_steps": args.repeats}
        threads = {k: args.threads for k in live}
        runs = train.train_runs(args, live, {str(seq): size}, threads)
        rows = {}
        for run in runs:
            key, system = run["key"], live[run["key"]]
            if not run["ok"]:
                rows[key] = {"label": system.label, "error": run["error"]}
                continue
            peak = max(rk["peak_rss_bytes"] for rk in run["ranks"])
            losses = train.global_losses(run)
            rows[key] = {"label": system.label, "peak_rss_bytes": peak, "losses": losses}
            rows[key].update(tokens_per_s=tokens_per_s(run, seq, system))
            rows[key]["median_step_s"] = train.run_median(run)
            if peak <= limit:
                fits[key] = seq
        lengths[str(seq)] = rows
        over = {k for k, r in rows.items() if r.get("peak_rss_bytes", limit + 1) > limit}
        live = {k: s for k, s in live.items() if seq < args.compare_seq or k not in over}
        seq *= 2
    return {"lengths": lengths, "longest": fits, "dims": MODELS[model]}


def goals(part: dict[str, Any], compare: int) -> dict[str, Any]:
    """The issue's goals against this part's figures (None where a system did not run)."""
    at = part["lengths"].get(str(compare), {})

    def ratio(a: str, b: str, field: str) -> float | None:
        x, y = at.get(a, {}).get(field), at.get(b, {}).get(field)
        return x / y if x is not None and y else None

    longest = part["longest"]

    def fit_ratio(a: str, b: str) -> float | None:
        return longest[a] / longest[b] if longest.get(a) and longest.get(b) else None

    got = {"s1_vs_torch": ratio("ours_s1", "torch", "peak_rss_bytes")}
    got["s2_vs_torch"] = ratio("ours_s2", "torch", "peak_rss_bytes")
    got["longest_vs_torch"] = fit_ratio("ours_s2", "torch_ac")
    got["longest_vs_fsdp2"] = fit_ratio("ours_s2", "fsdp2_ac")
    got["tokens_vs_untiled"] = ratio("ours_s1", "ours_untiled", "tokens_per_s")
    met = {}
    for k, v in got.items():
        higher = k.startswith(("longest", "tokens"))
        met[k] = None if v is None else (v >= GOALS[k] if higher else v <= GOALS[k])
    return {"values": got, "met": met}


def run(args: Any) -> dict[str, Any] | None:
    started, parts = time.perf_counter(), {}
    for model in args.model_keys:
        parts[model] = sweep(args, model)
        parts[model]["goals"] = goals(parts[model], args.compare_seq)
    config = {"limit_mib": args.limit_mib, "compare_seq": args.compare_seq}
    config.update(max_seq=args.max_seq, warmup=args.warmup, steps=args.repeats, seed=args.seed)
    config["systems"] = {k: SYSTEMS[k]._asdict() for k in args.system_keys}
    failed = [f"{m} {s} {k}" for m, p in parts.items() for s, rows in p["lengths"].items()
              for k, r in rows.items() if "error" in r]  # fmt: skip
    return {"config": config, "parts": parts, "failed": failed, "total_wall_s": time.perf_counter()
            - started}  # fmt: skip


def layout(p: dict[str, Any]) -> list:
    blocks: list = []
    names = {k: s["label"] for k, s in p["config"]["systems"].items()}
    for model, part in p["parts"].items():
        dims = part["dims"]
        blocks.append(f"{model}: Llama d={dims['d']}, {dims['n_layers']} layers, {dims['heads']} "
                      f"heads / {dims['kv_heads']} KV, MLP {dims['ffn']}, vocabulary {dims['vocab']}."
                      " Peak RSS per rank, MiB (ratio to plain torch at the same length):")  # fmt: skip
        cols = [Col("tokens", "seq"), *(Col(names[k], k) for k in names)]
        peaks, speeds = [], []
        for seq, rows in part["lengths"].items():
            base = rows.get("torch", {}).get("peak_rss_bytes")
            peak, speed = {"seq": f"{int(seq):,}"}, {"seq": f"{int(seq):,}"}
            for k, r in rows.items():
                if "error" in r:
                    peak[k] = speed[k] = "FAILED"
                    continue
                x = f" ({r['peak_rss_bytes'] / base:.2f}x)" if base and k != "torch" else ""
                peak[k] = f"{r['peak_rss_bytes'] / MIB:,.0f}{x}"
                speed[k] = f"{r['tokens_per_s']:,.0f}"
            peaks.append(peak)
            speeds.append(speed)
        blocks += [(cols, peaks), "Tokens/s (all ranks together):", (cols, speeds)]
        fit = {k: f"{v:,}" if v else "none" for k, v in part["longest"].items()}
        limit = f"{p['config']['limit_mib']:,.0f}"
        blocks += [f"The longest sequence under {limit} MiB per rank:", (cols[1:], [fit])]
        rows = []
        for k, v in part["goals"]["values"].items():
            met = part["goals"]["met"][k]
            rows.append({"goal": k, "want": f"{'>=' if k[0] in 'lt' else '<='} {GOALS[k]:g}",
                         "got": "-" if v is None else f"{v:.3g}",
                         "met": "-" if met is None else "yes" if met else "NO"})  # fmt: skip
        goal_cols = [Col("goal", "goal"), Col("wanted", "want"), Col("measured", "got")]
        blocks += ["Goals:", ([*goal_cols, Col("met", "met")], rows)]
    return blocks


NOTES = [
    "One sequence per data-parallel rank of each step ({config[warmup]} warm-up + {config[steps]} "
    "timed steps per run, fresh processes); S=2: both ranks train the same sequence, half each. "
    "Peak RSS: the largest rank's VmHWM over the run (load included). AC: each decoder layer "
    "recomputed in backward (torch: torch.utils.checkpoint; FSDP2: checkpoint_wrapper, torchtitan's "
    "full AC; DeepSpeed: transformers' gradient checkpointing).",
    "Lengths double; past {config[compare_seq]} tokens only the systems under {config[limit_mib]:.0f} "
    "MiB go on, up to {config[max_seq]}. Whole benchmark {total_wall_s:.0f} s wall.",
]
