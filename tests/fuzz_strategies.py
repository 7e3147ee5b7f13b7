"""Hypothesis strategies of the API fuzz: valid setups (model and config) and call arguments.

Every drawn config is valid (built with ``Zero3CpuOffloadConfig`` here, so an
invalid one fails in the driver, not on the ranks). Where a choice has a default,
the default comes first, so shrinking moves towards it.
"""

from __future__ import annotations

import math
from typing import Any

from fuzz_calls import MODELS, Setup, layer_numels
from hypothesis import strategies as st

from zero3_offload import Zero3CpuOffloadConfig

__all__ = ["BAD_LRS", "GOOD_LRS", "learning_rates", "plain_setup", "setups"]

_MIB = 2**20
_DEFAULT_CPU_BUDGET = 32 * 2**30

GOOD_LRS = (1e-3, 1e-2, 0.0, 1)  # an int is a number too
BAD_LRS = (-1e-3, math.nan, math.inf, -math.inf, True, "0.01", None)


def learning_rates() -> st.SearchStrategy[Any]:
    """A learning rate for optimizer_step: valid half of the time."""
    return st.one_of(st.sampled_from(GOOD_LRS), st.sampled_from(BAD_LRS))


def _optimizer(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["adamw", "adam", "sgd"]))
    opt: dict[str, Any] = {
        "kind": kind,
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
        "fused": draw(st.sampled_from([None, False])),
    }
    if kind == "sgd":
        opt["momentum"] = draw(st.sampled_from([0.0, 0.9]))
        opt["nesterov"] = opt["momentum"] > 0 and draw(st.booleans())
    else:
        opt["amsgrad"] = draw(st.booleans())
    return opt


@st.composite
def setups(draw: st.DrawFn, collective_timeout_s: float = 20.0) -> Setup:
    """A model and a valid config for it (``Setup.directory`` is left for the machine)."""
    model = draw(st.sampled_from(sorted(MODELS)))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float32", "float16"]))
    itemsize = 4 if dtype == "float32" else 2
    largest = max(n + n % 2 for n in layer_numels(model).values()) * itemsize  # padded, 2 ranks
    # The gathered-parameter budget: the default, or so tight that prefetch waits and
    # memory pressure (gathered bytes over the budget on the CPU) acts.
    budget = draw(st.sampled_from([2 * 2**30, largest, int(2.5 * largest)]))
    # 64 MiB of "CPU memory": a rank's RSS is far above it, so the pressure policy
    # releases gathered layers and shrinks the prefetch at every update.
    max_cpu_mb = draw(st.sampled_from([65536, 64]))
    checkpointing = draw(st.booleans())
    config = {
        "offload_params": draw(st.booleans()),
        "offload_grads": draw(st.booleans()),
        "offload_optimizer_states": draw(st.booleans()),
        "gradient_accumulation_steps": draw(st.integers(1, 3)),
        # Updates start during backward only without clipping, with overlap, not in
        # fp16: those choices come twice, so that path is drawn more often.
        "gradient_clipping": draw(st.sampled_from([0.0, 0.0, 0.5])),
        "compute_dtype": dtype,
        "overlap_computation": draw(st.sampled_from([True, True, False])),
        "async_prefetch": draw(st.booleans()),
        "prefetch_buffer_size": draw(st.integers(1, 3)),
        "prefetch_bucket_size": draw(st.sampled_from([0, 1, largest])),
        "param_persistence_threshold": draw(st.sampled_from([0, 1000, 10**6])),
        "gpu_param_memory_budget": budget,
        "cpu_compression": draw(st.sampled_from(["none", "fp16", "bf16", "int8"])),
        "compression_block_size": draw(st.sampled_from([256, 16])),
        "activation_checkpointing": checkpointing,
        "selective_checkpointing_units": draw(st.integers(0, 3)) if checkpointing else 0,
        "auto_memory_management": draw(
            st.sampled_from(["balanced", "conservative", "aggressive", "extreme"])
        ),
        "max_cpu_memory_mb": max_cpu_mb,
        "cpu_memory_budget": min(_DEFAULT_CPU_BUDGET, max_cpu_mb * _MIB),
        "cpu_worker_threads": draw(st.integers(1, 2)),
        "collective_timeout_s": collective_timeout_s,
        "optimizer": _optimizer(draw),
    }
    validated = Zero3CpuOffloadConfig.from_dict(config)
    return Setup(
        model=model,
        seed=draw(st.integers(0, 3)),
        dropout=draw(st.sampled_from([0.0, 0.1])),
        config=validated.to_dict(),
        directory="",
    )


def plain_setup(model: str = "gpt", directory: str = "") -> Setup:
    """The default config on ``model`` (for tests that drive the machine by hand)."""
    return Setup(
        model=model,
        seed=0,
        dropout=0.0,
        config=Zero3CpuOffloadConfig().to_dict(),
        directory=directory,
    )
