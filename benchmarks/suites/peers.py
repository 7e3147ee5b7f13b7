"""zero3_offload vs FSDP2, FSDP2 + CPU offload, DeepSpeed ZeRO-3 offload and plain torch.

Same model, data and seed; --sweep-ours: our configurations; --device cuda: one GPU. Defaults
(small; --quick; --large): rounds 3/2/1, warm-up 2/1/1, steps 6/5/4, timeout 900/300/3600 s."""

from __future__ import annotations

from typing import Any

import torch
from harness import train
from harness.render import Col
from harness.systems import System
from harness.train import LOSS_STEPS, LOSS_TOLERANCE

WORLD = 2
SIZES = {  # d, heads, blocks, seq; the defaults of the options
    "quick": ((128, 4, 2, 64), {"rounds": 2, "warmup": 1, "repeats": 5, "timeout": 300}),
    "small": ((512, 8, 6, 128), {"rounds": 3, "warmup": 2, "repeats": 6, "timeout": 900}),
    "large": ((1024, 16, 24, 128), {"rounds": 1, "warmup": 1, "repeats": 4, "timeout": 3600}),
}


def ours(label: str, **options: Any) -> System:
    return System(label, "zero3_offload", WORLD, options)


LR_BWD, DEPTH1 = {"lr_in_backward": True}, {"prefetch_buffer_size": 1}
NO_OFFLOAD = dict.fromkeys(("offload_params", "offload_grads", "offload_optimizer_states"), False)
CLIP_NEVER, CLIP_ALWAYS = {"gradient_clipping": 1e6}, {"gradient_clipping": 1e-6}
SPEC, GUARD = {"speculative_step": True}, {"skip_nonfinite_steps": True}
FIRES = {**LR_BWD, **CLIP_ALWAYS, **SPEC}
FUSED, CKPT = {"fused": True}, {"activation_checkpointing": True}
OFFLOAD = {**FUSED, "cpu_offload": True}
PERSIST = {"param_persistence_threshold": 300_000}  # small layers kept gathered
SYSTEMS = {
    "torch": System("plain torch (1 process)", "torch", 1, FUSED),
    # ZeRO's compute and update split over the ranks with no communication (a bound, see Split)
    "torch_split": System("2 x plain torch, no communication (bound)", "split", WORLD, FUSED),
    "fsdp2": System("FSDP2", "fsdp2", WORLD, FUSED),
    "fsdp2_offload": System("FSDP2 + CPUOffloadPolicy", "fsdp2", WORLD, OFFLOAD),
    "deepspeed": System("DeepSpeed ZeRO-3 offload", "deepspeed", WORLD, {}),
    "ours_default": ours("zero3_offload default"),
    "ours_fast": ours("zero3_offload tuned", **LR_BWD, **DEPTH1),
    "ours_ckpt": ours("zero3_offload tuned + activation ckpt", **LR_BWD, **DEPTH1, **CKPT),
}
SWEEP = {  # candidates for ours' fastest configuration
    "ours_default": SYSTEMS["ours_default"],
    "lr_bwd": ours("lr in backward_pass", **LR_BWD),
    "lr_bwd_nooffload": ours("lr in backward, offload off", **LR_BWD, **NO_OFFLOAD),
    "lr_bwd_1worker": ours("lr in backward, cpu_worker_threads=1", **LR_BWD, cpu_worker_threads=1),
    "lr_bwd_depth1": ours("lr in backward, prefetch_buffer_size=1", **LR_BWD, **DEPTH1),
    "lr_bwd_persist": ours("lr in backward, small layers persistent", **LR_BWD, **PERSIST),
    "no_prefetch": ours("async_prefetch=False", async_prefetch=False),
    "unchecked": ours("divergence_check=False", divergence_check=False),
    "no_keep": ours("keep_gathered_for_backward=False", keep_gathered_for_backward=False),
    # clipping with updates in backward: speculative (never / always rolled back) and waiting
    "lr_bwd_clip": ours("lr in backward, clip 1e6, speculative", **LR_BWD, **CLIP_NEVER, **SPEC),
    "lr_bwd_clip_wait": ours("lr in backward, clip 1e6, waiting", **LR_BWD, **CLIP_NEVER),
    "lr_bwd_clip_fires": ours("lr in backward, clip 1e-6 (fires every step), speculative", **FIRES),
    "guard": ours("skip_nonfinite_steps", **GUARD),
    "lr_bwd_guard": ours("lr in backward, skip_nonfinite_steps, waiting", **LR_BWD, **GUARD),
}
CUDA_KINDS = ("torch", "fsdp2", "zero3_offload")  # DeepSpeed's ranks run DS_ACCELERATOR=cpu
TAKES = ["rounds", "seed", "timeout", "keep", "mmap_threshold"]
OPTIONS = {
    "--large": {"action": "store_true", "help": "the 303M-parameter model"},
    "--sweep-ours": {"action": "store_true", "help": f"ours' configurations: {', '.join(SWEEP)}"},
    "--systems": {"help": f"comma-separated subset of {', '.join(SYSTEMS)} (or the sweep's)"},
    "--blocks": {"type": int, "help": "blocks instead of the size's; the name gets -<N>blocks"},
    "--vocab": {"type": int, "help": "the GPT's vocabulary (256: bytes); the name gets -vocab<N>"},
    "--device": {"default": "cpu", "choices": ["cpu", "cuda"], "help": "cuda: 1 GPU, 1 rank each"},
}
DEFAULTS = {"threads": 1, "seed": 0}  # and the size's (SIZES); plain torch gets 2x the threads
TITLE = "zero3_offload vs peers ({size} model, same model, data and seed)"


def check(args: Any) -> str | None:
    if args.quick and args.large:
        return "--quick and --large exclude each other"
    args.size = "quick" if args.quick else "large" if args.large else "small"
    for key, value in SIZES[args.size][1].items():  # the size's, for those not given
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    table = SWEEP if args.sweep_ours else SYSTEMS
    args.system_keys = args.systems.split(",") if args.systems else list(table)
    if unknown := [k for k in args.system_keys if k not in table]:
        return f"unknown systems {unknown}; known: {', '.join(table)}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return f"--device cuda: CUDA is not available (torch {torch.__version__})"
    if (args.blocks or 1) < 1 or (args.vocab or 256) < 256:
        return "--blocks must be >= 1, --vocab >= 256 (the token ids are bytes)"
    return train.check_loss_steps(args)


def run(args: Any) -> dict[str, Any] | None:
    systems = {k: (SWEEP if args.sweep_ours else SYSTEMS)[k] for k in args.system_keys}
    spec, cuda = {}, args.device == "cuda"
    if cuda:  # one GPU: every system on one rank of its own
        systems = {k: s._replace(world=1) for k, s in systems.items() if s.kind in CUDA_KINDS}
        spec = {"device": "cuda", "backend": "nccl"}
    d, heads, blocks, seq = SIZES[args.size][0]
    dims = dict(d=d, heads=heads, n_layers=args.blocks or blocks, seq=seq, global_batch=8)
    dims.update({"vocab": args.vocab} if args.vocab is not None else {})
    threads = {k: args.threads * WORLD // s.world for k, s in systems.items()}  # torch: 2x
    config = dict(world_size=WORLD, threads_per_rank=args.threads, device=args.device)
    config["malloc_mmap_threshold"] = args.mmap_threshold
    part, _ = train.compare(args, systems, dims, threads, spec=spec, **config)
    name = "peers-sweep" if args.sweep_ours else "peers"
    name += ("" if args.size == "small" else f"-{args.size}") + "-cuda" * cuda
    name += f"-{args.blocks}blocks" if args.blocks else ""
    name += f"-vocab{args.vocab}" if args.vocab is not None else ""
    if not part["systems"]:
        return None
    agree = part["agreement"]["agree"]
    return {"benchmark": name, "size": args.size, **part, "losses_agree": agree}


def system_columns(refs: dict[str, str]) -> list[Col]:
    """The systems table's columns, ratios to ``refs`` (CPU and GPU: to the first only)."""

    def vs(field: str, names: dict[str, str] = refs) -> list[Col]:
        return [Col(f"vs {name}", field, "x", key) for name, key in names.items()]

    first = dict(list(refs.items())[:1])
    # fmt: off
    return [
        Col("system", "label"), Col("ranks x threads", "{world_size} x {threads_per_rank}"),
        Col("median step s", "median_step_s", ".3f"), *vs("median_step_s"),
        Col("best run step s", "best_run_step_s", ".3f"),
        Col("CPU s / step", "median_cpu_s", ".3f"), *vs("median_cpu_s", first),
        Col("fwd+loss s", "median_forward_s", ".3f"), Col("backward s", "median_backward_s", ".3f"),
        Col("optimizer s", "median_optimizer_s", ".3f"),
        Col("peak GPU allocated MiB", "peak_gpu_bytes", "mib"), *vs("peak_gpu_bytes", first),
        Col("peak RSS / rank MiB", "peak_rss_bytes", "mib"), *vs("peak_rss_bytes"),
        Col("steps' peak RSS MiB", "step_peak_rss_bytes", "mib"), *vs("step_peak_rss_bytes"),
        Col("RSS after import MiB", "import_rss_bytes", "mib"),
        Col("model state / rank MiB", "model_state_bytes", "mib1"),
    ]
    # fmt: on


def layout(p: dict[str, Any], refs: dict[str, str] | None = None) -> list:
    """The systems table, the losses per step, and the runs per round."""
    ref = next(s for s in p["systems"].values() if s["label"] == p["agreement"]["reference"])
    k = min(p["config"]["warmup"] + p["config"]["steps"], len(ref["losses"]))
    losses = [Col("system", "label"), *(Col(f"step {i}", f"{{losses[{i}]:.5f}}") for i in range(k))]
    diff = f"max |diff| vs {ref['label']} (first {LOSS_STEPS})"
    losses += [Col(diff, "loss_max_diff", ".2e", missing="- (bound)")]
    rounds = []
    for r in range(p["config"]["rounds"]):
        runs = [x for x in p["runs"] if x["round"] == r]
        loads = [x["load"] for x in runs]
        rounds.append({"round": str(r), "order": " > ".join(x["key"] for x in runs)})
        rounds[-1]["load"] = f"{min(loads):.1f}-{max(loads):.1f}"
        for x in (x for x in runs if x["ok"]):
            rounds[-1][x["key"]] = f"{x['median_step_s']:.3f} ({x['cpu_s']:.2f})"
    per_system = [Col("round", "round"), Col("order", "order"), Col("load avg", "load")]
    per_system += [Col(s["label"], key) for key, s in p["systems"].items()]
    return [
        (system_columns(refs or {"FSDP2": "fsdp2", "torch": "torch"}), p["systems"]),
        f"Loss per step (global-batch mean; the first {k} steps of the first run; same initial "
        "weights and data for every system):",
        ([*losses, Col("max spread between runs", "loss_spread", ".1e")], p["systems"]),
        "Per round: median step s of each run (CPU s / step of all ranks in parentheses) and the "
        "1-minute load average at the runs' starts; drift of the machine shows here:",
        (per_system, rounds),
    ]


def notes(p: dict[str, Any], model: str | None = None) -> list[str]:
    """The notes of a comparison; ``model`` replaces the GPT's description."""
    cfg, dims, ag, skipped = p["config"], p["config"]["dims"], p["agreement"], p["skipped"].values()
    mmap = cfg.get("malloc_mmap_threshold")
    malloc = f"MALLOC_MMAP_THRESHOLD_={mmap} in every rank of every system" if mmap else (
        "defaults (dynamic mmap threshold, up to 32 MiB) in every process")  # fmt: skip
    model = model or (
        f"Model: {cfg['model']} d={dims['d']}, {dims['heads']} heads, {dims['n_layers']} blocks, "
        f"seq {dims['seq']}, vocabulary {dims.get('vocab') or 256} (token ids are bytes): "
        f"{cfg['params']:,} fp32 params in {cfg['layers']} layers (largest {cfg['largest_layer']:,}"
        ")"
    )
    return [
        f"{model}; global batch {dims['global_batch']}, split evenly over the ranks; seed "
        f"{cfg['seed']} and the same batches ({cfg['corpus']['description']}, sha256 "
        f"{cfg['corpus']['sha256'][:12]}) for every system.",
        f"AdamW lr {cfg['lr']}, betas (0.9, 0.999), eps 1e-8, weight decay {cfg['weight_decay']}, "
        "fp32, no clipping (DeepSpeed's default of 1.0 set to 0): torch's fused kernel in torch, "
        "FSDP2 and per shard in zero3_offload, DeepSpeedCPUAdam in DeepSpeed.",
        f"Each run: fresh processes, {cfg['warmup']} warm-up + {cfg['steps']} timed steps; "
        f"{cfg['rounds']} rounds, the order rotated each round; columns as docs/benchmarks.md "
        "(peers) defines them.",
        *["Device: one CUDA GPU, every system on 1 rank."] * (cfg.get("device") == "cuda"),
        f"Losses agree with {ag['reference']} within {LOSS_TOLERANCE:g} for the first {LOSS_STEPS} "
        f"steps: {ag['agree']} (max |diff| {ag['max_diff']:.2e}). glibc malloc: {malloc}.",
        *(f"{'FAILED' * s['failed'] or 'SKIPPED'} {s['label']}: {s['why']}" for s in skipped),
        f"whole benchmark {p['total_wall_s']:.0f} s wall.",
    ]


NOTES = [notes]
