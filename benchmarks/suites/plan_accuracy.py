"""Plan accuracy: `zero3-offload plan`'s peak RSS per rank and step time against real runs.

Each case trains a transformers model with weights (a Llama and a Qwen2, built from configs)
with `zero3-offload train --model` for a few steps; the largest rank's VmHWM and the median
step after the first are compared with what the planner predicts for the same flags."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from harness.render import Col
from harness.runner import progress, work_directory

from zero3_offload.plan import load_or_measure, plan_run
from zero3_offload.train.sources import resolve

FAMILIES = {"llama": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                          num_key_value_heads=4),
            "qwen2": dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6,
                          num_key_value_heads=2)}  # fmt: skip
SHAPE = dict(vocab_size=4096, num_hidden_layers=6, max_position_embeddings=8192,
             tie_word_embeddings=False)  # fmt: skip
AC, LORA, NF4 = ["--activation-checkpointing"], ["--lora", "r=16"], ["--frozen-compression", "nf4"]
BF16, SP2 = ["--frozen-compression", "bf16"], ["--sequence-parallel-size", "2"]
CASES = [  # model, ranks, tokens, flags ({nvme}: a directory of the run)
    ("llama", 1, 512, []), ("llama", 2, 512, []), ("llama", 1, 2048, []),
    ("llama", 1, 2048, AC), ("llama", 1, 1024, [*AC, "--selective-checkpointing-units", "3"]),
    ("llama", 1, 2048, [*AC, "--mlp-chunk-tokens", "256"]),
    ("llama", 1, 1024, ["--batch-size", "2", "--gradient-accumulation-steps", "2"]),
    ("llama", 2, 2048, SP2), ("llama", 1, 1024, [*AC, "--offload-optimizer-device", "nvme"]),
    ("llama", 1, 1024, [*AC, "--offload-param-device", "nvme"]),
    ("llama", 1, 2048, [*AC, "--offload-activations", "cpu"]),
    ("llama", 1, 2048, [*AC, "--offload-activations", "nvme"]), ("llama", 1, 2048, [*LORA, *AC]),
    ("llama", 1, 1024, [*LORA, *BF16]), ("qwen2", 1, 1024, []), ("qwen2", 2, 2048, AC),
    ("qwen2", 1, 1024, [*AC, "--selective-checkpointing-units", "6"]),
    ("qwen2", 1, 512, LORA), ("qwen2", 1, 1024, [*LORA, *BF16]),
    ("qwen2", 1, 1024, [*LORA, *NF4, "--frozen-decode-at-use"]),
    ("qwen2", 1, 4096, [*LORA, *AC]), ("qwen2", 2, 2048, [*LORA, *AC, *NF4, "--offload-activations",
                                                          "nvme"]),
    ("llama", 1, 4096, [*LORA, *AC, *NF4, "--frozen-decode-at-use"]),
    ("llama", 2, 8192, [*AC, *SP2, "--mlp-chunk-tokens", "1024"]),
    ("qwen2", 2, 8192, [*LORA, *AC, *SP2]),
]  # fmt: skip
COMMON = ["--steps", "3", "--eval-batches", "1", "--eval-every", "0", "--warmup-steps", "1",
          "--corpus-mb", "0.3", "--batch-size", "1"]  # fmt: skip
TAKES = ["timeout", "keep"]
OPTIONS = {"--cases": {"help": "comma-separated case numbers (from 1; default: all)"},
           "--budget-s": {"type": float, "default": 0.0,
                          "help": "start no case after this many seconds (0: no limit)"}}  # fmt: skip
DEFAULTS = {"repeats": 2, "warmup": 1, "threads": 1, "timeout": 1800.0}
QUICK = {"cases": "1,14", "timeout": 300.0}
TITLE = "Plan accuracy: predicted against measured peak RSS per rank and step time"
GOALS = {"peak": 0.10, "step": 0.25}


def measure(model: str, world: int, flags: list[str], out: str, timeout: float) -> dict:
    args = ["--model", model, "--world-size", str(world), "--out", out, *COMMON, *flags]
    cmd = [sys.executable, "-m", "zero3_offload", "train", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1]}
    logs = [json.loads(line) for f in sorted(os.listdir(f"{out}/logs"))
            for line in open(f"{out}/logs/{f}", encoding="utf-8")]  # fmt: skip
    steps = [r["seconds"] for r in logs if r["event"] == "train_step" and r["step"] > 1]
    peak = max(r["peak_rss_bytes"] for r in logs if r["event"] == "train_done")
    return {"peak": peak, "step": statistics.median(steps)}


def run(args: Any) -> dict[str, Any]:
    import transformers

    started, rows, failed = time.perf_counter(), [], []
    chosen = [int(c) for c in args.cases.split(",")] if args.cases else range(1, len(CASES) + 1)
    with work_directory("plan-accuracy-", args.keep) as work:
        for name, extra in FAMILIES.items():
            config = transformers.AutoConfig.for_model(name, **extra, **SHAPE)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(work / name)
        for n in chosen:
            if args.budget_s and time.perf_counter() - started > args.budget_s:
                break
            family, world, seq, flags = CASES[n - 1]
            flags = [*flags, "--seq-len", str(seq)]
            if any("nvme" in f for f in flags):
                flags += ["--nvme-path", str(work / f"nvme{n}")]
            model, row = str(work / family), {"case": n, "model": family, "ranks": world}
            row.update(tokens=seq, options=" ".join(flags[:-2]).replace("--", "") or "defaults")
            progress(f"case {n}: {family} x{world} {seq} {row['options']}")
            row.update(measure(model, world, flags, str(work / f"run{n}"), args.timeout))
            values = {"model": model, "world_size": world, "seq_len": seq, "corpus_mb": 0.3}
            values.update(batch_size=1, steps=3, nvme_path=str(work / f"nvme{n}"))
            resolved = resolve({**values, **_flags(flags)}, env={})
            planned = plan_run(resolved.train, resolved.zero3, load_or_measure(world))
            row.update(predicted=planned.host_peak_bytes, predicted_step=planned.predicted_step_s)
            if "error" in row:
                failed.append(f"case {n}: {row['error']}")
            else:
                row["peak_ratio"] = row["predicted"] / row["peak"]
                row["step_ratio"] = row["predicted_step"] / row["step"]
                row["met"] = abs(row["peak_ratio"] - 1) <= GOALS["peak"]
                row["step_met"] = abs(row["step_ratio"] - 1) <= GOALS["step"]
            rows.append(row)
    ok = [r for r in rows if "met" in r]
    summary = {"cases": len(rows), "peaks_within": sum(r["met"] for r in ok),
               "steps_within": sum(r["step_met"] for r in ok),
               "worst_peak_ratio": max((abs(r["peak_ratio"] - 1) for r in ok), default=None)}  # fmt: skip
    return {"config": {"common": " ".join(COMMON), "goals": GOALS, **SHAPE}, "rows": rows,
            "summary": summary, "failed": failed, "total_wall_s": time.perf_counter() - started}  # fmt: skip


def _flags(flags: list[str]) -> dict[str, Any]:
    """``--name value`` pairs and bare ``--switch`` flags as option values."""
    out, i = {}, 0
    while i < len(flags):
        name = flags[i][2:].replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value = flags[i + 1]
            out[name] = int(value) if value.isdigit() else value
            i += 2
        else:
            out[name], i = True, i + 1
    return out


LAYOUT = [([Col("#", "case", "d"), Col("model", "model"), Col("ranks", "ranks", "d"),
            Col("tokens", "tokens", ","), Col("options", "options"),
            Col("predicted MiB", "predicted", "mib"), Col("measured MiB", "peak", "mib"),
            Col("ratio", "peak_ratio", ".3f"), Col("within ±10%", "met", "yes"),
            Col("predicted s", "predicted_step", ".2f"), Col("measured s", "step", ".2f"),
            Col("ratio", "step_ratio", ".2f"), Col("within ±25%", "step_met", "yes"),
            Col("error", "error")], "rows"),
          "Peaks within ±10%: {summary[peaks_within]} of {summary[cases]}; step times within "
          "±25%: {summary[steps_within]}; worst peak error {summary[worst_peak_ratio]:.1%}."]  # fmt: skip
NOTES = ["Each case: `zero3-offload train --model` with weights (from_pretrained), {config[common]}; "
         "peak: the largest rank's VmHWM over the run; step: the median of the steps after the "
         "first. Predicted: `zero3-offload plan` with the same flags and this machine's cached "
         "calibration. Whole benchmark {total_wall_s:.0f} s wall."]  # fmt: skip
