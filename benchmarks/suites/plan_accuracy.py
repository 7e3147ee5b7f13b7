"""Plan accuracy: `zero3-offload plan`'s peak RSS per rank and step time against real runs.

Each case trains a transformers model with weights (a Llama and a Qwen2 built from configs) with
`zero3-offload train --model` for 5 steps; the largest rank's VmHWM and the median step after
the first are compared with what `zero3-offload plan --json` predicted for the same flags just
before the run (a process of its own, as a user runs it)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.render import Col
from harness.runner import progress, work_directory

FAMILIES = {"llama": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                          num_key_value_heads=4),
            "qwen2": dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6,
                          num_key_value_heads=2)}  # fmt: skip
SHAPE = dict(vocab_size=4096, num_hidden_layers=6, max_position_embeddings=8192,
             tie_word_embeddings=False)  # fmt: skip
AC, LORA, NF4, BF16 = "--activation-checkpointing", "--lora r=16", "--frozen-compression nf4", \
    "--frozen-compression bf16"  # fmt: skip
SP2, AT_USE, NVME = "--sequence-parallel-size 2", "--frozen-decode-at-use", "--nvme-path {work}"
CASES = [  # model, ranks, tokens, flags
    ("llama", 1, 512, ""), ("llama", 2, 512, ""), ("llama", 1, 2048, ""), ("llama", 1, 2048, AC),
    ("llama", 1, 1024, f"{AC} --selective-checkpointing-units 3"),
    ("llama", 1, 2048, f"{AC} --mlp-chunk-tokens 256"),
    ("llama", 1, 1024, "--batch-size 2 --gradient-accumulation-steps 2"), ("llama", 2, 2048, SP2),
    ("llama", 1, 1024, f"{AC} --offload-optimizer-device nvme {NVME}"),
    ("llama", 1, 1024, f"{AC} --offload-param-device nvme {NVME}"),
    ("llama", 1, 2048, f"{AC} --offload-activations cpu"),
    ("llama", 1, 2048, f"{AC} --offload-activations nvme {NVME}"),
    ("llama", 1, 2048, f"{LORA} {AC}"),
    ("llama", 1, 1024, f"{LORA} {BF16}"), ("qwen2", 1, 1024, ""), ("qwen2", 2, 2048, AC),
    ("qwen2", 1, 1024, f"{AC} --selective-checkpointing-units 6"), ("qwen2", 1, 512, LORA),
    ("qwen2", 1, 1024, f"{LORA} {BF16}"), ("qwen2", 1, 1024, f"{LORA} {NF4} {AT_USE}"),
    ("qwen2", 1, 4096, f"{LORA} {AC}"),
    ("qwen2", 2, 2048, f"{LORA} {AC} {NF4} --offload-activations nvme {NVME}"),
    ("llama", 1, 4096, f"{LORA} {AC} {NF4} {AT_USE}"),
    ("llama", 2, 8192, f"{AC} {SP2} --mlp-chunk-tokens 1024"),
    ("qwen2", 2, 8192, f"{LORA} {AC} {SP2}"),
]  # fmt: skip
COMMON = "--steps 5 --eval-batches 1 --eval-every 0 --warmup-steps 1 --corpus-mb 0.3 --batch-size 1"
TAKES = ["timeout", "keep"]
OPTIONS = {"--cases": {"help": "comma-separated case numbers (from 1; default: all)"},
            "--budget-s": {"type": float, "default": 0.0, "help": "start no case after this many "
                           "seconds (0: no limit)"}}  # fmt: skip
DEFAULTS = {"repeats": 2, "warmup": 1, "threads": 1, "timeout": 1800.0}
QUICK = {"cases": "1,14", "timeout": 300.0}
TITLE = "Plan accuracy: predicted against measured peak RSS per rank and step time"
GOALS = {"peak": 0.10, "step": 0.25}


def case(n: int, work: Path, timeout: float) -> dict[str, Any]:
    """Case ``n``: the run's measured peak and step, and the plan's for the same flags."""
    family, world, seq, flags = CASES[n - 1]
    row = {"case": n, "model": family, "ranks": world, "tokens": seq, "options": flags or "-"}
    progress(f"case {n}: {family} x{world} {seq} {flags}")
    argv = ["train", "--model", str(work / family), "--world-size", str(world), "--seq-len",
            str(seq), "--out", str(work / f"run{n}"), *f"{COMMON} {flags}".format(
                work=work / f"nvme{n}").split()]  # fmt: skip
    # The plan as a user gets it before the run: `zero3-offload plan --json` with the same
    # flags, in a process of its own (its probe times the model's layer there).
    command = [sys.executable, "-m", "zero3_offload", "plan", *argv[1:], "--json"]
    planning = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if planning.returncode:
        return {**row, "error": "plan: " + planning.stderr.strip().splitlines()[-1]}
    planned = json.loads(planning.stdout)
    row.update(predicted=planned["host_peak_bytes"], predicted_step=planned["predicted_step_s"],
               step_breakdown=planned["step_breakdown"])  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "zero3_offload", *argv], capture_output=True,
                          text=True, timeout=timeout, check=False)  # fmt: skip
    if done.returncode:
        return {**row, "error": done.stderr.strip().splitlines()[-1]}
    logs = [json.loads(line) for f in sorted((work / f"run{n}" / "logs").iterdir())
            for line in f.read_text(encoding="utf-8").splitlines()]  # fmt: skip
    row["peak"] = max(r["peak_rss_bytes"] for r in logs if r["event"] == "train_done")
    row["step"] = statistics.median(
        r["seconds"] for r in logs if r["event"] == "train_step" and r["step"] > 1)  # fmt: skip
    row.update(peak_ratio=row["predicted"] / row["peak"])
    row.update(step_ratio=row["predicted_step"] / row["step"])
    row.update(met=abs(row["peak_ratio"] - 1) <= GOALS["peak"],
               step_met=abs(row["step_ratio"] - 1) <= GOALS["step"])  # fmt: skip
    return row


def run(args: Any) -> dict[str, Any]:
    import transformers

    started, rows = time.perf_counter(), []
    chosen = [int(c) for c in args.cases.split(",")] if args.cases else range(1, len(CASES) + 1)
    with work_directory("plan-accuracy-", args.keep) as work:
        for name, extra in FAMILIES.items():
            config = transformers.AutoConfig.for_model(name, **extra, **SHAPE)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(work / name)
        for n in chosen:
            if not args.budget_s or time.perf_counter() - started < args.budget_s:
                rows.append(case(n, work, args.timeout))
    ok = [r for r in rows if "met" in r]
    worst = max((abs(r["peak_ratio"] - 1) for r in ok), default=0.0)
    summary = {"cases": len(rows), "peaks_within": sum(r["met"] for r in ok),
               "steps_within": sum(r["step_met"] for r in ok),
               "worst_peak_ratio": worst}  # fmt: skip
    return {"config": {"common": COMMON, "goals": GOALS, **SHAPE}, "rows": rows,
            "summary": summary, "failed": [f"case {r['case']}: {r['error']}" for r in rows
                                           if "error" in r],
            "total_wall_s": time.perf_counter() - started}  # fmt: skip


LAYOUT = [([Col("#", "case", "d"), Col("model", "model"), Col("ranks", "ranks", "d"),
            Col("tokens", "tokens", ","), Col("options", "options"),
            Col("predicted MiB", "predicted", "mib"), Col("measured MiB", "peak", "mib"),
            Col("ratio", "peak_ratio", ".3f"), Col("within ±10%", "met", "yes"),
            Col("predicted s", "predicted_step", ".2f"), Col("measured s", "step", ".2f"),
            Col("ratio", "step_ratio", ".2f"), Col("within ±25%", "step_met", "yes"),
            Col("error", "error")], "rows"),
          "Peaks within ±10%: {summary[peaks_within]} of {summary[cases]}; step times within "
          "±25%: {summary[steps_within]}; worst peak error "
          "{summary[worst_peak_ratio]:.1%}."]  # fmt: skip
NOTES = ["Each case: `zero3-offload train --model` with weights (from_pretrained), "
         "{config[common]}; peak: the largest rank's VmHWM over the run; step: the median of the "
         "steps after the first. Predicted: `zero3-offload plan --json` with the same flags just "
         "before the run (a process of its own) and this machine's cached calibration. Whole "
         "benchmark {total_wall_s:.0f} s wall."]  # fmt: skip
