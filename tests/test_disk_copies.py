"""Compute copies on disk: gathers read each layer's copy from a file, bitwise the gathers
from memory.

See [Note: compute copies on disk]. The training runs use 2 gloo ranks and compare
with the same run in memory: final parameters, every loss and grad norm. The unit
tests drive the file and its read buffers directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TrainSpec, assert_bitwise, assert_same_training, run_named, train
from test_disk_tier import MODEL, STEPS, spec

from zero3_offload import (
    ConfigError,
    CpuCompressionMethod,
    DiskTierError,
    StateError,
    Zero3CpuOffloadConfig,
)
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.parameter.disk_copies import DiskComputeCopies
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline
from zero3_offload.storage.record_file import aligned
from zero3_offload.testing import RankContext, run_ranks


def params_on_disk(path: Path, **config: Any) -> dict[str, Any]:
    return {"offload_param_device": "nvme", "nvme_path": str(path), **config}


CASES = {
    # fp32 copies, the masters and optimizer state on disk too (both tiers, one directory).
    "both_tiers": {"config": {"offload_optimizer_device": "nvme"}},
    "adamw_lr_in_backward": {"early_lr": True},
    "accumulation_clipping": {
        "micro_steps": 2,
        "config": {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05},
    },
    # Decoded on the launcher thread before the all-gather.
    "bf16_compute_int8_copies": {
        "config": {"compute_dtype": torch.bfloat16, "cpu_compression": "int8"},
    },
    # The stored bytes themselves all-gathered, decoded after.
    "int8_gather": {"config": {"gather_compression": "int8"}},
    "no_prefetch": {"config": {"async_prefetch": False}},
    # Updates during backward undone and redone clipped: the copies are written again.
    "speculative_clipping": {
        "early_lr": True,
        "config": {"speculative_step": True, "gradient_clipping": 0.05},
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("nvme-params")
    calls = {}
    for name, case in CASES.items():
        in_memory = {k: v for k, v in case.get("config", {}).items() if "nvme" not in str(v)}
        calls[f"{name}/ram"] = (train, spec({**case, "config": in_memory}, {}))
        calls[f"{name}/disk"] = (train, spec(case, params_on_disk(root / name)))
    return {"root": root, **run_named(2, calls)}


@pytest.mark.parametrize("case", list(CASES))
def test_gathering_from_disk_is_bitwise_gathering_from_memory(
    runs: dict[str, Any], case: str
) -> None:
    assert_same_training(runs[f"{case}/ram"], runs[f"{case}/disk"])


def test_memory_holds_only_read_buffers_and_the_file_every_copy(runs: dict[str, Any]) -> None:
    codec = ShardCodec(CpuCompressionMethod.INT8, torch.bfloat16)
    for r, d in zip(
        runs["bf16_compute_int8_copies/ram"], runs["bf16_compute_int8_copies/disk"], strict=True
    ):
        shards = [shard for _, _, shard in d["layouts"].values() if shard]
        records = [aligned(codec.wire_nbytes(s)) for s in shards]
        assert r["memory"]["compute_copy_bytes"] == sum(codec.wire_nbytes(s) for s in shards)
        assert d["memory"]["compute_copy_bytes"] == 0
        assert d["memory"]["disk_tier_file_bytes"] == sum(records)
        # The read buffers (prefetch depth 2 + read-ahead 2 + 1) and at least one write's
        # scratch buffer, each the size of the largest record.
        assert d["memory"]["disk_tier_buffer_bytes"] >= 6 * max(records)
        assert d["memory"]["disk_tier_buffer_bytes"] % max(records) == 0
        transfers = d["performance"].transfers
        # Every copy written when made and after each update; a step makes every cached
        # read stale, so each step's forward reads every layer at least once.
        assert transfers["disk_write"].bytes == (STEPS + 1) * sum(records)
        assert transfers["disk_read"].bytes >= STEPS * sum(records)
        assert transfers["disk_read"].bytes % 4096 == 0
    assert not any((runs["root"] / "bf16_compute_int8_copies").iterdir())


def test_checkpoints_resume_with_both_tiers_on_disk(tmp_path: Path) -> None:
    saved = tmp_path / "ckpt"
    first = run_named(2, {"save": (train, TrainSpec(steps=2, model=MODEL, save_dir=str(saved)))})
    both = {"offload_optimizer_device": "nvme", **params_on_disk(tmp_path / "tier")}
    resumed = run_named(
        2,
        {
            name: (
                train,
                TrainSpec(steps=2, first_step=2, model=MODEL, config=config, load_dir=str(saved)),
            )
            for name, config in (("ram", {}), ("disk", both))
        },
    )
    assert first["save"][0]["losses"]
    assert_bitwise(resumed["ram"][0]["state"], resumed["disk"][0]["state"])
    assert [r["losses"] for r in resumed["ram"]] == [r["losses"] for r in resumed["disk"]]


# ------------------------------------------------------------ the file, driven directly


def copies(path: Path, codec: ShardCodec, layers: dict[str, int], buffers: int = 2):
    path.mkdir()
    return DiskComputeCopies(
        path, codec=codec, layers=layers, buffers=buffers, timeline=Timeline(rank=0)
    )


@pytest.mark.parametrize(
    ("method", "dtype"),
    [
        (CpuCompressionMethod.NONE, torch.float32),
        (CpuCompressionMethod.BF16, torch.float32),
        (CpuCompressionMethod.INT8, torch.bfloat16),
    ],
)
def test_a_staged_copy_holds_the_encoded_bytes(tmp_path: Path, method, dtype) -> None:
    codec = ShardCodec(method, dtype, block_size=64)
    layers = {"a": 1000, "b": 4099, "c": 1}
    disk = copies(tmp_path / "r", codec, layers)
    masters = {name: torch.randn(n) for name, n in layers.items()}
    for name, master in masters.items():
        disk.write(name, master)
    try:
        for name, master in masters.items():
            expected = codec.empty(master.numel(), device=torch.device("cpu"))
            codec.encode_(master, expected)
            staged = disk.stage(name, Phase.FORWARD)
            assert torch.equal(staged.wait().wire(), expected.wire())
            staged.release()
        assert disk.file.direct in (True, False)
        assert disk.file.reads[0] == 3 and disk.file.writes[0] == 3
    finally:
        disk.close()
    assert not (tmp_path / "r" / "params.bin").exists()


def test_a_copy_read_before_its_last_write_is_read_again(tmp_path: Path) -> None:
    codec = ShardCodec(CpuCompressionMethod.NONE, torch.float32)
    disk = copies(tmp_path / "r", codec, {"a": 2048, "b": 2048})
    try:
        disk.write("a", torch.zeros(2048))
        disk.write("b", torch.zeros(2048))
        disk.read_ahead(
            ["a", "b"], Phase.FORWARD
        )  # a read-ahead, then an update of "a" (an optimizer step)
        for entry in disk._entries.values():  # the reads landed (their futures)
            entry.read.result()
        disk.write("a", torch.ones(2048))
        staged = disk.stage("a", Phase.FORWARD)
        assert torch.equal(staged.wait().payload, torch.ones(2048))
        staged.release()
        staged = disk.stage(
            "b", Phase.FORWARD
        )  # not written since: the read-ahead is used as it is
        assert torch.equal(staged.wait().payload, torch.zeros(2048))
        staged.release()
        assert disk.file.reads[0] == 3
    finally:
        disk.close()


def test_read_buffers_are_reused_and_grow_only_for_gathers_in_flight(tmp_path: Path) -> None:
    codec = ShardCodec(CpuCompressionMethod.NONE, torch.float32)
    layers = {name: 1024 for name in "abcd"}
    disk = copies(tmp_path / "r", codec, layers, buffers=2)
    try:
        for name in layers:
            disk.write(name, torch.full((1024,), float(ord(name))))
        base = disk.buffer_bytes
        disk.read_ahead(list(layers), Phase.FORWARD)  # two buffers: only "a" and "b" are read ahead
        held = [
            disk.stage(name, Phase.FORWARD) for name in layers
        ]  # four gathers in flight at once
        for name, staged in zip(layers, held, strict=True):
            assert torch.equal(staged.wait().payload, torch.full((1024,), float(ord(name))))
        assert disk.buffer_bytes == base + 2 * 4096
        with pytest.raises(StateError, match="already being gathered"):
            disk.stage("a", Phase.FORWARD)
        for staged in held:
            staged.release()
        reads = disk.file.reads[0]
        for name in layers:  # cached: no read
            staged = disk.stage(name, Phase.FORWARD)
            staged.wait()
            staged.release()
        assert disk.file.reads[0] == reads
    finally:
        disk.close()


def test_config_rules_for_copies_on_disk() -> None:
    with pytest.raises(ConfigError, match="needs nvme_path"):
        Zero3CpuOffloadConfig(offload_param_device="nvme")
    with pytest.raises(ConfigError, match="offload_params"):
        Zero3CpuOffloadConfig(**params_on_disk(Path("x")), offload_params=False)
    config = Zero3CpuOffloadConfig(**params_on_disk(Path("x")))
    assert config.offload_param_device.value == "nvme"


async def truncated_body(ctx: RankContext, path: str) -> str:
    from helpers import make_batches, make_model

    from zero3_offload import Zero3CpuOffloadManager

    model = make_model(**MODEL)
    config = Zero3CpuOffloadConfig(**params_on_disk(Path(path)))
    manager = Zero3CpuOffloadManager(config, ctx.group, model)
    try:
        # The file loses its contents under the manager (a failing or replaced disk).
        os.truncate(Path(path) / f"rank{ctx.rank}" / "params.bin", 0)
        x, _ = make_batches(1, 4)[0]
        await manager.forward_pass(x, model.layer_names)
    except DiskTierError as exc:
        return str(exc)
    finally:
        await manager.close()
    return "no error"


async def test_a_failed_read_raises_a_disk_tier_error_naming_the_file(tmp_path: Path) -> None:
    [message] = await run_ranks(truncated_body, 1, str(tmp_path), timeout_s=120)
    assert "params.bin" in message and "read" in message, message
    assert not any(tmp_path.iterdir())  # close() removed the directory all the same


def test_module_mode_gathers_units_from_disk_bitwise(tmp_path: Path) -> None:
    """A transformers model run by its own code (units gathered by hooks), both tiers on
    disk: the same losses, updates and final parameters as in memory."""
    pytest.importorskip("transformers")
    from hf_models import HfSpec, train_hf

    disk = {"offload_optimizer_device": "nvme", **params_on_disk(tmp_path / "tier")}
    runs = run_named(
        2,
        {
            "ram": (train_hf, HfSpec(micro_steps=4)),
            "disk": (train_hf, HfSpec(micro_steps=4, config=disk)),
        },
    )
    for ram, on_disk in zip(runs["ram"], runs["disk"], strict=True):
        assert ram["losses"] == on_disk["losses"]
        assert ram["stepped"] == on_disk["stepped"]
    assert_bitwise(runs["ram"][0]["state"], runs["disk"][0]["state"])
    assert not any((tmp_path / "tier").iterdir())
