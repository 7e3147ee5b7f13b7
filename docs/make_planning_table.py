"""Print docs/planning.md's scale table: the planner's peaks for Llama-3-8B and 70B shapes
on 8 ranks with 80 GB accelerators, next to DeepSpeed's ZeRO-3 estimator for the same shapes.

    python docs/make_planning_table.py            # the Markdown table, on stdout

Writes the two ``config.json`` files (no weights) to a temporary directory; the planner
runs one decoder layer of each shape on this machine's CPU in bf16 (a few minutes for
70B) and uses this machine's cached calibration for the host's runtime. Needs
transformers and peft; DeepSpeed's columns need deepspeed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from zero3_offload import Zero3CpuOffloadConfig
from zero3_offload.plan import load_or_measure, plan

SHAPES = {
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64),
}  # fmt: skip
COMMON = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
              num_key_value_heads=8, max_position_embeddings=131072,
              tie_word_embeddings=False)  # fmt: skip
GIB, WORLD = 2**30, 8
DEVICE = dict(device="cuda", compute_dtype="bf16", activation_checkpointing=True,
              gpu_param_memory_budget=8 * GIB, max_gpu_memory_mb=80 * 1024)  # fmt: skip
NO_OFFLOAD = dict(offload_params=False, offload_grads=False, offload_optimizer_states=False)


def deepspeed_columns(params: int, largest: int, offload: bool) -> tuple[str, str]:
    """DeepSpeed's estimate_zero3_model_states_mem_needs: GPU bytes per GPU, CPU per node."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except ImportError:
        return "-", "-"
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        params, largest, num_gpus_per_node=WORLD, cpu_offload=offload, cpu_offload_params=offload
    )
    return f"{gpu / GIB:,.1f}", f"{cpu / GIB:,.0f}"


def main() -> None:
    calibration = load_or_measure(1)
    rows = ["| model | training | offload | tokens | our device peak GiB | our host peak GiB "
            "per rank | DeepSpeed estimate GPU GiB | DeepSpeed estimate CPU GiB per node |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in SHAPES.items():
            model = Path(tmp) / name
            model.mkdir()
            (model / "config.json").write_text(json.dumps({**COMMON, **shape}))
            for lora in (None, "r=16"):
                for offload in (True, False):
                    config = Zero3CpuOffloadConfig(**DEVICE, **({} if offload else NO_OFFLOAD))
                    for tokens in (4096, 32768):
                        run = dict(batch_size=1, seq_len=tokens, lora=lora, corpus_mb=1.0)
                        p = plan(model, config, calibration=calibration, world_size=WORLD, **run)
                        largest = p.train["largest_unit"]
                        ds_gpu, ds_cpu = deepspeed_columns(p.params, largest, offload)
                        rows.append(
                            f"| {name} | {'LoRA r=16' if lora else 'full'} | "
                            f"{'yes' if offload else 'no'} | {tokens:,} | "
                            f"{p.device_peak_bytes / GIB:,.1f} | {p.host_peak_bytes / GIB:,.1f} "
                            f"| {ds_gpu} | {ds_cpu} |"
                        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
