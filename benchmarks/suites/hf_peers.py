"""Module mode vs torch, FSDP2, DeepSpeed on a ~300M HF Llama (peers' method); gpt: vs chain."""

from __future__ import annotations

import importlib.util
from typing import Any

from harness import train
from harness.systems import System

from suites import peers
from zero3_offload.memory.allocator import TRAIN_MMAP_THRESHOLD

WORLD, BATCH = 2, 4
LLAMA = dict(model="llama", d=1024, ffn=2816, n_layers=20, heads=16, kv_heads=8, vocab=32000)
TINY = {"d": 64, "ffn": 176, "n_layers": 2, "heads": 4, "kv_heads": 2, "seq": 64}
MODELS = {  # name: (full dims, quick dims), indexed by args.quick
    "llama": ({**LLAMA, "seq": 128}, {**LLAMA, **TINY}),
    "lora": ({**LLAMA, "seq": 128, "lora": 16}, {**LLAMA, **TINY, "lora": 4}),  # r=16, all proj
    "gpt": (dict(d=1024, heads=16, n_layers=24, seq=128), dict(d=128, heads=4, n_layers=2, seq=64)),
}
MODULE = System("zero3_offload module mode", "ours-module", WORLD, {})
BY_LAYER = {"fused": True, "wrap": "decoder_layers"}  # torchtitan's: each decoder layer, the root
FSDP2 = System("FSDP2 (decoder layers + root)", "fsdp2", WORLD, BY_LAYER)
LLAMA_PEERS = {"fsdp2": FSDP2, "deepspeed": peers.SYSTEMS["deepspeed"]}
CHAIN = System("zero3_offload chain mode", "zero3_offload", WORLD, {})
GPT_PEERS = {"fsdp2": peers.SYSTEMS["fsdp2"], "ours_chain": CHAIN, "ours_module": MODULE}
PARTS = {"llama": {**LLAMA_PEERS, "ours_module": MODULE}, "gpt": GPT_PEERS}
LORA = {f"ours_{f}{k}": System(f"zero3_offload, {f} frozen{k and ', none kept'}", "ours-module",
        WORLD, {"frozen_compression": f, "keep_gathered_for_backward": not k})
        for f in ("bf16", "nf4") for k in ("", "_lean")}  # fmt: skip
AC = {"activation_checkpointing": True, "keep_gathered_for_backward": False,
      "frozen_decode_at_use": True, "trim_heap_after_forward": True}  # fmt: skip
AC_NAME = "zero3_offload, {} frozen, AC, at use, trim"
LORA.update({f"ours_{f}_ac": System(AC_NAME.format(f), "ours-module", WORLD,
             {"frozen_compression": f, **AC}) for f in ("bf16", "nf4")})  # fmt: skip
KEPT = {"bf16_ac_keep": (128, 0), "nf4_ac_keep": (64, 0), "bf16_ac_sel": (64, 6)}  # MiB, units
for k, (mib, n) in KEPT.items():  # the LM head + 2 bf16 / 6 nf4 layers; sel: the head alone
    f, saving = k.split("_")[0], f", last {n} units save their products" if n else ""
    LORA[f"ours_{k}"] = System(f"{AC_NAME.format(f)}, {mib} MiB kept{saving}", "ours-module", WORLD,
        {**LORA[f"ours_{f}_ac"].options, "keep_gathered_for_backward": True,
         "keep_gathered_bytes": mib << 20, "selective_checkpointing_units": n})  # fmt: skip
FSDP2_AC = System("FSDP2 + full AC", "fsdp2", WORLD, {**BY_LAYER, "checkpoint": True})
# The goal rows reached by a budget alone: 0.6x and 0.45x FSDP2's peak of the 2026-12-07 run
# (1,919 MiB); the planner chooses every memory option (see docs/planning.md).
BUDGETS = {"ours_budget_bf16": 1151, "ours_budget_nf4": 863}  # MiB per rank
LORA.update({k: System(f"zero3_offload, --memory-per-rank {mib:,} MiB, options chosen by the "
             "planner", "ours-module", WORLD, {"memory_per_rank": mib << 20})
             for k, mib in BUDGETS.items()})  # fmt: skip
PARTS["lora"] = {**LLAMA_PEERS, "fsdp2_ac": FSDP2_AC, **LORA}
TORCH = peers.SYSTEMS["torch"]
SYSTEMS = {m: {"torch": TORCH, **t} for m, t in PARTS.items()}
KEYS = sorted({k for table in SYSTEMS.values() for k in table})
OPTIONS = {
    "--models": {"default": "llama,gpt", "help": "comma-separated subset of llama, lora, gpt"},
    "--systems": {"help": f"comma-separated subset of {', '.join(KEYS)} (each model's own)"},
}
TAKES = ["rounds", "seed", "timeout", "keep", "mmap_threshold"]
DEFAULTS = {"threads": 1, "warmup": 1, "repeats": 4, "rounds": 1, "timeout": 3600.0, "seed": 0}
DEFAULTS["mmap_threshold"] = TRAIN_MMAP_THRESHOLD  # MALLOC_MMAP_THRESHOLD_, as `train` sets
QUICK = {"timeout": 300.0}
TITLE = "zero3_offload module mode vs peers on a transformers Llama (same model, data and seed)"
TITLES = {"gpt": "Module mode vs chain mode on the library's GPT, with plain torch and FSDP2:"}
SAVED = "The seeded weights are saved once (fp32 safetensors); each system loads them: ours by "
SAVED += "from_pretrained (each rank its slices), the others by transformers' (in full)."
TITLES["lora"] = "LoRA (peft, r=16 on every attention and MLP projection) of the same Llama:"


def check(args: Any) -> str | None:
    args.model_keys = args.models.split(",")
    args.system_keys = args.systems.split(",") if args.systems else KEYS
    if unknown := (set(args.model_keys) - set(MODELS)) | (set(args.system_keys) - set(KEYS)):
        return f"unknown models or systems {sorted(unknown)}; known: {', '.join([*MODELS, *KEYS])}"
    if set(args.model_keys) - {"gpt"} and importlib.util.find_spec("transformers") is None:
        return "the llama needs transformers (pip install transformers), or --models gpt"
    return train.check_loss_steps(args)


def run(args: Any) -> dict[str, Any] | None:
    parts = {}
    for model in args.model_keys:
        systems = {k: s for k, s in SYSTEMS[model].items() if k in args.system_keys}
        dims = {**MODELS[model][args.quick], "global_batch": BATCH}
        threads = {k: args.threads * WORLD // s.world for k, s in systems.items()}  # torch: 2x
        config = dict(world_size=WORLD, malloc_mmap_threshold=args.mmap_threshold)
        if model != "gpt":  # a fine-tune starts from saved weights: every system loads them
            config.update(spec={"pretrained": True}, from_saved_weights=True)
        part, runs = train.compare(args, systems, dims, threads, **config)
        ok = [r for r in runs if r["ok"] and r["key"] in ("ours_module", *LORA)]
        ticks = [rk["loop_worst_tick_ms"] for r in ok for rk in r["ranks"]]  # the worse rank's
        loop = {k: max(t[k] for t in ticks) for k in ("median_step", "max")} if ticks else None
        chosen = {r["key"]: r["ranks"][0]["chosen"] for r in ok if "chosen" in r["ranks"][0]}
        parts[model] = {"size": model, **part, "loop_ms": loop, "chosen": chosen}
    if not any(p["systems"] for p in parts.values()):
        return None
    failed = [f"{m}/{r['key']}" for m, p in parts.items() for r in p["runs"] if not r["ok"]]
    agree = all(p["agreement"]["agree"] for p in parts.values() if p["systems"])
    name = "hf-peers" + ("" if args.models == "llama,gpt" else "-" + args.models.replace(",", "-"))
    return {"benchmark": name, "parts": parts, "failed": failed, "losses_agree": agree}


def layout(p: dict[str, Any]) -> list:
    parts = p["parts"].items()
    return [b for m, part in parts for b in [TITLES.get(m, ""), *peers.layout(part)] if b]


def notes(p: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for i, (model, part) in enumerate(p["parts"].items()):
        cfg, dims = part["config"], part["config"]["dims"]
        shape = f"blocks, byte vocabulary, seq {dims['seq']}"
        if model != "gpt":
            lora = f", LoRA r={dims['lora']}" if dims.get("lora") else ""
            shape = (
                f"decoder layers, {dims['kv_heads']} KV heads, MLP {dims['ffn']}, vocabulary "
                f"{dims['vocab']} (the bytes as token ids), seq {dims['seq']}, loss the model's "
                f"own from labels = input ids{lora}"
            )
        size = f"{cfg['model']} d={dims['d']}, {dims['heads']} heads, {dims['n_layers']}"
        lines = peers.notes(part, f"Model: {size} {shape}: {cfg['params']:,} fp32 params")
        lines += [SAVED] if cfg.get("from_saved_weights") else []
        out += [f"{model}: {n}" if i else n for n in lines if n not in out]
        for key, chosen in part.get("chosen", {}).items():
            what = ", ".join(f"{k}={v}" for k, v in chosen.items()) or "the defaults"
            out.append(f"{model}: {key}: the planner chose {what}.")
        if ms := part["loop_ms"]:
            ticker = "(a 10 ms ticker's worst lateness per step, first step out, worse rank)"
            out.append(f"{model}: the event loop in a module-mode step {ticker}: median "
                       f"{ms['median_step']:.1f} ms, worst {ms['max']:.1f} ms.")  # fmt: skip
    return out


NOTES = [notes]
