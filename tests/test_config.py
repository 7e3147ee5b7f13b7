"""Tests of config.py: defaults, validation, parsing; and the rank mapping."""

import json
import math

import pytest
import torch

from zero3_offload import Zero3RankMapping
from zero3_offload.config import (
    AutoMemoryStrategy,
    CpuCompressionMethod,
    GatherCompressionMethod,
    OffloadActivations,
    OffloadDevice,
    OptimizerConfig,
    ReduceDtype,
    Zero3CpuOffloadConfig,
)
from zero3_offload.errors import ConfigError

EXPECTED_DEFAULTS = {
    "offload_params": True,
    "offload_grads": True,
    "offload_optimizer_states": True,
    "cpu_memory_budget": 32 * 2**30,
    "gpu_param_memory_budget": 2 * 2**30,
    "max_gpu_memory_mb": 8192,
    "max_cpu_memory_mb": 65536,
    "prefetch_buffer_size": 2,
    "async_prefetch": True,
    "overlap_computation": True,
    "pin_cpu_memory": True,
    "cpu_compression": CpuCompressionMethod.NONE,
    "auto_memory_management": AutoMemoryStrategy.BALANCED,
    "optimizer": OptimizerConfig(),
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "skip_nonfinite_steps": False,
    "max_consecutive_nonfinite": 10,
    "compute_dtype": torch.float32,
    "device": "cpu",
    "collective_timeout_s": 300.0,
    "heartbeat_timeout_s": 5.0,
    "divergence_check": True,
    "compression_block_size": 256,
    "gather_compression": GatherCompressionMethod.NONE,
    "reduce_dtype": ReduceDtype.FP32,
    "frozen_compression": CpuCompressionMethod.NONE,
    "frozen_decode_at_use": False,
    "trim_heap_after_forward": False,
    "cpu_worker_threads": 2,
    "prefetch_bucket_size": 0,
    "param_persistence_threshold": 0,
    "activation_checkpointing": False,
    "selective_checkpointing_units": 0,
    "offload_activations": OffloadActivations.NONE,
    "activation_read_ahead_bytes": 0,
    "mlp_chunk_tokens": 0,
    "sequence_parallel_size": 1,
    "loss_chunk_tokens": 256,
    "speculative_step": False,
    "keep_gathered_for_backward": True,
    "keep_gathered_bytes": 0,
    "shared_memory_collectives": True,
    "offload_optimizer_device": OffloadDevice.CPU,
    "offload_param_device": OffloadDevice.CPU,
    "nvme_path": None,
    "nvme_replace_stale": False,
}

BOOL_FIELDS = [k for k, v in EXPECTED_DEFAULTS.items() if isinstance(v, bool)]
INT_FIELDS = [
    k for k, v in EXPECTED_DEFAULTS.items() if isinstance(v, int) and not isinstance(v, bool)
]
FLOAT_FIELDS = ["gradient_clipping", "collective_timeout_s", "heartbeat_timeout_s"]
# Smallest valid value of each int field.
INT_MINIMUM = {
    "cpu_memory_budget": 1,
    "gpu_param_memory_budget": 1,
    "max_gpu_memory_mb": 1,
    "max_cpu_memory_mb": 1,
    "prefetch_buffer_size": 1,
    "gradient_accumulation_steps": 1,
    "max_consecutive_nonfinite": 1,
    "compression_block_size": 1,
    "cpu_worker_threads": 1,
    "prefetch_bucket_size": 0,
    "param_persistence_threshold": 0,
    "keep_gathered_bytes": 0,
    "selective_checkpointing_units": 0,
    "activation_read_ahead_bytes": 0,
    "mlp_chunk_tokens": 0,
    "sequence_parallel_size": 1,
    "loss_chunk_tokens": 0,
}

BAD_VALUES = (
    [(f, bad) for f in BOOL_FIELDS for bad in ("yes", 1, 0, None)]
    + [(f, bad) for f in INT_FIELDS for bad in (True, 1.5, 2.0, "3", None)]
    + [(f, INT_MINIMUM[f] - 1) for f in INT_FIELDS]
    + [(f, bad) for f in FLOAT_FIELDS for bad in (True, "1.0", math.nan, math.inf, -1.0)]
    + [
        ("collective_timeout_s", 0),
        ("heartbeat_timeout_s", 0),
        ("heartbeat_timeout_s", -1.0),
        ("cpu_compression", "zip"),
        ("cpu_compression", 3),
        ("gather_compression", "fp16"),
        ("reduce_dtype", "fp16"),
        ("auto_memory_management", "reckless"),
        ("compute_dtype", torch.float64),
        ("compute_dtype", torch.int8),
        ("compute_dtype", "fp64"),
        ("device", "tpu"),
        ("device", "meta"),
        ("device", torch.device("meta")),
        ("device", 0),
        ("optimizer", "adamw"),
    ]
)


def test_int_fields_table_is_complete():
    assert set(INT_FIELDS) == set(INT_MINIMUM)


def test_defaults_match_design():
    config = Zero3CpuOffloadConfig()
    for name, expected in EXPECTED_DEFAULTS.items():
        assert getattr(config, name) == expected, name
    assert set(config.to_dict()) == set(EXPECTED_DEFAULTS)
    config.validate()


@pytest.mark.parametrize(("field", "bad"), BAD_VALUES)
def test_invalid_value_names_field_and_value(field, bad):
    with pytest.raises(ConfigError) as info:
        Zero3CpuOffloadConfig(**{field: bad})
    message = str(info.value)
    assert field in message
    assert repr(bad) in message


@pytest.mark.parametrize(("field", "bad"), BAD_VALUES)
def test_evolve_rejects_the_same_values(field, bad):
    with pytest.raises(ConfigError, match=field):
        Zero3CpuOffloadConfig().evolve(**{field: bad})


def test_message_states_the_rule():
    with pytest.raises(ConfigError) as info:
        Zero3CpuOffloadConfig(gradient_accumulation_steps=0)
    assert str(info.value) == "gradient_accumulation_steps=0 is invalid: must be an integer >= 1"


def test_numbers_are_normalised():
    config = Zero3CpuOffloadConfig(gradient_clipping=1, collective_timeout_s=5)
    assert type(config.gradient_clipping) is float and config.gradient_clipping == 1.0
    assert type(config.collective_timeout_s) is float and config.collective_timeout_s == 5.0
    assert Zero3CpuOffloadConfig(prefetch_bucket_size=0).prefetch_bucket_size == 0


def test_gpu_budget_must_fit_max_gpu_memory():
    Zero3CpuOffloadConfig(gpu_param_memory_budget=1024 * 2**20, max_gpu_memory_mb=1024)
    with pytest.raises(ConfigError) as info:
        Zero3CpuOffloadConfig(gpu_param_memory_budget=1024 * 2**20 + 1, max_gpu_memory_mb=1024)
    assert "gpu_param_memory_budget" in str(info.value)
    assert "max_gpu_memory_mb=1024" in str(info.value)


def test_cpu_budget_must_fit_max_cpu_memory():
    Zero3CpuOffloadConfig(cpu_memory_budget=4 * 2**30, max_cpu_memory_mb=4096)
    with pytest.raises(ConfigError, match=r"cpu_memory_budget=.*max_cpu_memory_mb=4096"):
        Zero3CpuOffloadConfig(cpu_memory_budget=4 * 2**30 + 1, max_cpu_memory_mb=4096)
    with pytest.raises(ConfigError, match="max_cpu_memory_mb"):
        Zero3CpuOffloadConfig().evolve(max_cpu_memory_mb=1024)


def test_keep_limit_needs_keeping():
    config = Zero3CpuOffloadConfig(keep_gathered_bytes=2**20)
    assert config.keep_gathered_for_backward and config.keep_gathered_bytes == 2**20
    assert not Zero3CpuOffloadConfig(keep_gathered_for_backward=False).keep_gathered_bytes
    with pytest.raises(ConfigError, match=r"keep_gathered_bytes=1048576 .*=False"):
        Zero3CpuOffloadConfig(keep_gathered_bytes=2**20, keep_gathered_for_backward=False)
    with pytest.raises(ConfigError, match="keep_gathered_bytes"):
        config.evolve(keep_gathered_for_backward=False)


def test_selective_checkpointing_needs_checkpointing():
    config = Zero3CpuOffloadConfig(activation_checkpointing=True, selective_checkpointing_units=3)
    assert config.selective_checkpointing_units == 3
    with pytest.raises(ConfigError, match=r"selective_checkpointing_units=3 .*=False"):
        Zero3CpuOffloadConfig(selective_checkpointing_units=3)
    with pytest.raises(ConfigError, match="selective_checkpointing_units"):
        config.evolve(activation_checkpointing=False)


def test_activation_offload_needs_checkpointing_and_a_path_for_nvme(tmp_path):
    config = Zero3CpuOffloadConfig(activation_checkpointing=True, offload_activations="CPU")
    assert config.offload_activations is OffloadActivations.CPU
    with pytest.raises(ConfigError, match=r"offload_activations='cpu' .*=False"):
        Zero3CpuOffloadConfig(offload_activations="cpu")
    with pytest.raises(ConfigError, match="offload_activations='nvme' needs nvme_path"):
        Zero3CpuOffloadConfig(activation_checkpointing=True, offload_activations="nvme")
    with pytest.raises(ConfigError, match="offload_activations='disk' is invalid"):
        Zero3CpuOffloadConfig(activation_checkpointing=True, offload_activations="disk")
    on_disk = config.evolve(offload_activations="nvme", nvme_path=str(tmp_path))
    assert on_disk.offload_activations is OffloadActivations.NVME
    assert on_disk.evolve(activation_read_ahead_bytes=2**20).activation_read_ahead_bytes
    with pytest.raises(ConfigError, match=r"activation_read_ahead_bytes=1048576 .*'cpu'"):
        config.evolve(activation_read_ahead_bytes=2**20)


def test_config_is_frozen():
    config = Zero3CpuOffloadConfig()
    with pytest.raises(AttributeError):
        config.gradient_accumulation_steps = 0


def test_round_trip_through_json():
    config = Zero3CpuOffloadConfig(
        cpu_compression="INT8",
        auto_memory_management="extreme",
        optimizer={"kind": "sgd", "momentum": 0.9, "nesterov": True},
        compute_dtype="bf16",
        device=torch.device("cuda", 1),
        gradient_accumulation_steps=4,
        gradient_clipping=1.0,
    )
    data = config.to_dict()
    assert data["cpu_compression"] == "int8"
    assert data["auto_memory_management"] == "extreme"
    assert data["compute_dtype"] == "bfloat16"
    assert data["device"] == "cuda:1"
    assert data["optimizer"]["kind"] == "sgd"
    restored = Zero3CpuOffloadConfig.from_dict(json.loads(json.dumps(data)))
    assert restored == config
    assert Zero3CpuOffloadConfig.from_dict(Zero3CpuOffloadConfig().to_dict()) == (
        Zero3CpuOffloadConfig()
    )


def test_from_dict_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as info:
        Zero3CpuOffloadConfig.from_dict({"offload_parms": True})
    assert "offload_parms" in str(info.value)
    assert "offload_params" in str(info.value)
    with pytest.raises(ConfigError, match="optimizer: unknown OptimizerConfig key"):
        Zero3CpuOffloadConfig.from_dict({"optimizer": {"lr": 1e-3}})
    with pytest.raises(ConfigError, match="valid keys"):
        Zero3CpuOffloadConfig().evolve(nonsense=1)


def test_evolve_returns_validated_copy():
    base = Zero3CpuOffloadConfig()
    changed = base.evolve(gradient_accumulation_steps=8, cpu_compression="bf16")
    assert changed.gradient_accumulation_steps == 8
    assert changed.cpu_compression is CpuCompressionMethod.BF16
    assert base.gradient_accumulation_steps == 1


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (torch.float32, torch.float32),
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("torch.float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_compute_dtype_parsing(given, expected):
    assert Zero3CpuOffloadConfig(compute_dtype=given).compute_dtype is expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("cpu", "cpu"),
        ("CPU", "cpu"),
        (torch.device("cpu"), "cpu"),
        ("cuda", "cuda"),
        ("cuda:0", "cuda:0"),
        (torch.device("cuda", 3), "cuda:3"),
        (torch.device("cuda"), "cuda"),
    ],
)
def test_device_parsing(given, expected):
    assert Zero3CpuOffloadConfig(device=given).device == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("none", CpuCompressionMethod.NONE),
        ("FP16", CpuCompressionMethod.FP16),
        ("Bf16", CpuCompressionMethod.BF16),
        ("int8", CpuCompressionMethod.INT8),
        (CpuCompressionMethod.INT8, CpuCompressionMethod.INT8),
    ],
)
def test_compression_parsing(given, expected):
    assert Zero3CpuOffloadConfig(cpu_compression=given).cpu_compression is expected
    assert CpuCompressionMethod.parse(given) is expected


def test_enum_parse_error_lists_choices():
    with pytest.raises(ConfigError) as info:
        CpuCompressionMethod.parse("zstd")
    for choice in ("'none'", "'fp16'", "'bf16'", "'int8'"):
        assert choice in str(info.value)
    with pytest.raises(ConfigError, match=r"'conservative'.*'extreme'"):
        AutoMemoryStrategy.parse("wild")


def test_compression_methods():
    assert not CpuCompressionMethod.NONE.is_lossy()
    assert all(m.is_lossy() for m in CpuCompressionMethod if m is not CpuCompressionMethod.NONE)
    assert CpuCompressionMethod.NONE.storage_dtype(torch.bfloat16) is torch.bfloat16
    assert CpuCompressionMethod.NONE.storage_dtype(torch.float32) is torch.float32
    assert CpuCompressionMethod.FP16.storage_dtype(torch.float32) is torch.float16
    assert CpuCompressionMethod.BF16.storage_dtype(torch.float32) is torch.bfloat16
    assert CpuCompressionMethod.INT8.storage_dtype(torch.float32) is torch.int8
    assert len({m.description() for m in CpuCompressionMethod}) == 5


@pytest.mark.parametrize(
    ("strategy", "threshold", "aggressiveness"),
    [
        (AutoMemoryStrategy.CONSERVATIVE, 0.9, 0.2),
        (AutoMemoryStrategy.BALANCED, 0.75, 0.5),
        (AutoMemoryStrategy.AGGRESSIVE, 0.6, 0.8),
        (AutoMemoryStrategy.EXTREME, 0.4, 1.0),
    ],
)
def test_memory_strategy_table(strategy, threshold, aggressiveness):
    assert strategy.pressure_threshold() == threshold
    assert strategy.aggressiveness() == aggressiveness
    assert strategy.value == strategy.name.lower()
    assert strategy.description()
    assert AutoMemoryStrategy.parse(strategy.name) is strategy


def test_optimizer_defaults_and_round_trip():
    opt = OptimizerConfig()
    assert (opt.kind, opt.betas, opt.eps, opt.weight_decay) == ("adamw", (0.9, 0.999), 1e-8, 0.0)
    assert opt.fused is None and not opt.amsgrad and not opt.nesterov
    assert OptimizerConfig(betas=[0.8, 0.99]).betas == (0.8, 0.99)
    sgd = OptimizerConfig(kind="sgd", momentum=0.9, dampening=0.0, nesterov=True, fused=False)
    assert OptimizerConfig.from_dict(json.loads(json.dumps(sgd.to_dict()))) == sgd


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "lion"}, "kind"),
        ({"kind": "SGD"}, "kind"),
        ({"betas": (1.0, 0.999)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"betas": (0.9,)}, "betas"),
        ({"betas": (0.9, True)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"kind": "sgd", "momentum": -0.5}, "momentum"),
        ({"kind": "sgd", "dampening": 1.5}, "dampening"),
        ({"kind": "sgd", "nesterov": True}, "nesterov"),
        ({"kind": "sgd", "momentum": 0.9, "dampening": 0.1, "nesterov": True}, "nesterov"),
        ({"kind": "adamw", "momentum": 0.9}, "momentum"),
        ({"kind": "sgd", "amsgrad": True}, "amsgrad"),
        ({"fused": "yes"}, "fused"),
        ({"amsgrad": 1}, "amsgrad"),
    ],
)
def test_optimizer_rules(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        OptimizerConfig(**kwargs)


def test_nesterov_with_momentum_is_valid():
    opt = OptimizerConfig(kind="sgd", momentum=0.9, nesterov=True)
    assert opt.nesterov and opt.momentum == 0.9


def test_rank_mapping_validation():
    for rank, world in [(0, 0), (2, 2), (-1, 2), (True, 2), (0, 1.0)]:
        with pytest.raises(ConfigError):
            Zero3RankMapping(rank, world)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [0, 1, 5, 7, 8, 1001])
def test_shard_bounds_tile_padded_buffer(world_size, numel):
    mappings = [Zero3RankMapping(r, world_size) for r in range(world_size)]
    padded = mappings[0].padded_numel(numel)
    assert padded % world_size == 0
    assert numel <= padded < numel + world_size
    covered = []
    for mapping in mappings:
        start, end = mapping.shard_bounds(numel)
        assert end - start == mapping.shard_numel(numel) == padded // world_size
        covered.extend(range(start, end))
    assert covered == list(range(padded))


def test_padded_numel_values():
    assert Zero3RankMapping(0, 4).padded_numel(0) == 0
    assert Zero3RankMapping(0, 4).padded_numel(5) == 8
    assert Zero3RankMapping(2, 3).shard_bounds(7) == (6, 9)
