"""The disk tier: masters and optimizer state in a file, bitwise the training in memory.

See [Note: disk tier]. Every run here trains on 2 gloo ranks with the state
on disk and is compared with the same run in memory: the final parameters,
every loss, and the checkpoints, which keep their format whichever tier
wrote them.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from helpers import TrainSpec, assert_bitwise, assert_same_training, run_named, train

from zero3_offload import ConfigError, DiskTierError, Zero3CpuOffloadConfig
from zero3_offload.memory.budget import disk_record_bytes
from zero3_offload.storage.rank_directory import RankDirectory
from zero3_offload.testing import RankContext, run_ranks

MODEL = {"d": 64, "n_blocks": 2}
STEPS = 3


def on_disk(path: Path, **config: Any) -> dict[str, Any]:
    return {"offload_optimizer_device": "nvme", "nvme_path": str(path), **config}


CASES = {
    "adamw": {},
    "adamw_lr_in_backward": {"early_lr": True},
    "adamw_accumulation_clipping": {
        "micro_steps": 2,
        "config": {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05},
    },
    "sgd_momentum": {"optimizer": {"kind": "sgd", "momentum": 0.9}},
    "adam_amsgrad": {"optimizer": {"kind": "adam", "amsgrad": True}},
}


def spec(case: dict[str, Any], config: dict[str, Any]) -> TrainSpec:
    base = {k: v for k, v in case.items() if k != "config"}
    return TrainSpec(steps=STEPS, model=MODEL, config={**case.get("config", {}), **config}, **base)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("nvme")
    calls = {}
    for name, case in CASES.items():
        calls[f"{name}/ram"] = (train, spec(case, {}))
        calls[f"{name}/disk"] = (train, spec(case, on_disk(root / name)))
    return {"root": root, **run_named(2, calls)}


@pytest.mark.parametrize("case", list(CASES))
def test_training_on_disk_is_bitwise_training_in_memory(runs: dict[str, Any], case: str) -> None:
    assert_same_training(runs[f"{case}/ram"], runs[f"{case}/disk"])


def test_the_disk_holds_the_state_and_memory_only_the_buffers(runs: dict[str, Any]) -> None:
    for r, d in zip(runs["adamw/ram"], runs["adamw/disk"], strict=True):
        shards = [shard for _, _, shard in d["layouts"].values() if shard]
        mem_r, mem_d = r["memory"], d["memory"]
        assert mem_d["master_param_bytes"] == 0
        # In memory: AdamW's scalar step counter per layer only.
        assert mem_d["optimizer_state_bytes"] == 4 * len(shards)
        assert mem_r["optimizer_state_bytes"] == 4 * len(shards) + 8 * sum(shards)
        config = Zero3CpuOffloadConfig(**on_disk(Path("/")))
        records = [disk_record_bytes(config, s) for s in shards]
        assert mem_d["disk_tier_file_bytes"] == sum(records)
        assert mem_d["disk_tier_buffer_bytes"] == 3 * max(records)
        # The compute copy is a tensor of its own: the master it aliased in memory is on disk.
        assert mem_r["compute_copy_bytes"] == 0
        assert mem_d["compute_copy_bytes"] == 4 * sum(shards)
        transfers = d["performance"].transfers
        # Construction writes every record's master part once (AdamW's records are three
        # equal aligned tensors, the master first); every update reads its layer's record
        # and writes it back; full_state_dict reads each once more at the end.
        masters = [record // 3 for record in records]
        for kind in ("disk_read", "disk_write"):
            assert transfers[kind].operations == (STEPS + 1) * len(shards)
        assert transfers["disk_read"].bytes == (STEPS + 1) * sum(records)
        assert transfers["disk_write"].bytes == STEPS * sum(records) + sum(masters)
    # close() removed every rank's directory.
    assert not any((runs["root"] / "adamw").iterdir())


def test_checkpoints_move_between_the_tiers(tmp_path: Path) -> None:
    saved = {tier: tmp_path / f"ckpt-{tier}" for tier in ("ram", "disk")}
    config = {"ram": {}, "disk": on_disk(tmp_path / "tier")}
    first = run_named(
        2,
        {
            t: (train, TrainSpec(steps=2, model=MODEL, config=config[t], save_dir=str(saved[t])))
            for t in saved
        },
    )
    assert_bitwise(first["ram"][0]["state"], first["disk"][0]["state"])
    # Each checkpoint resumed in the other tier, and in the same one: all four equal.
    resumed = run_named(
        2,
        {
            f"{src}->{dst}": (
                train,
                TrainSpec(
                    steps=2,
                    first_step=2,
                    model=MODEL,
                    config=config[dst] if dst == "ram" else on_disk(tmp_path / f"t-{src}"),
                    load_dir=str(saved[src]),
                ),
            )
            for src in saved
            for dst in saved
        },
    )
    reference = resumed["ram->ram"]
    for name, result in resumed.items():
        assert_bitwise(reference[0]["state"], result[0]["state"])
        assert [r["losses"] for r in result] == [r["losses"] for r in reference], name


async def refused_body(ctx: RankContext, path: str, config: dict[str, Any] | None = None) -> str:
    from helpers import make_model

    from zero3_offload import Zero3CpuOffloadManager

    try:
        manager = Zero3CpuOffloadManager(
            Zero3CpuOffloadConfig(**on_disk(Path(path), **(config or {}))),
            ctx.group,
            make_model(**MODEL),
        )
    except DiskTierError as exc:
        return str(exc)
    await manager.close()
    return "built"


async def test_a_directory_left_behind_is_refused_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "rank1").mkdir()  # what a crashed run leaves
    (tmp_path / "rank1" / "state.bin").write_bytes(b"old")
    messages = await run_ranks(refused_body, 2, str(tmp_path), timeout_s=120)
    assert "rank1 exists" in messages[1] and "remove it" in messages[1]
    assert "another rank" in messages[0]
    # Rank 0's own directory was removed again; the one left behind is untouched.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1"]
    assert (tmp_path / "rank1" / "state.bin").read_bytes() == b"old"


REPLACE = {"nvme_replace_stale": True}


async def test_a_directory_left_behind_is_replaced_only_when_asked(tmp_path: Path) -> None:
    for rank in range(2):  # what a crashed run leaves: the tiers' files, its locks free
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "state.bin").write_bytes(b"old")
        (tmp_path / f"rank{rank}.lock").write_bytes(b"")
    (tmp_path / "rank1" / "params.bin").write_bytes(b"old")
    built = await run_ranks(refused_body, 2, str(tmp_path), REPLACE, timeout_s=120)
    assert built == ["built", "built"]
    assert not any(tmp_path.iterdir())  # replaced, used, and removed on close()
    # A file the tiers do not write is never deleted.
    (tmp_path / "rank1").mkdir()
    (tmp_path / "rank1" / "notes.txt").write_text("mine")
    messages = await run_ranks(refused_body, 2, str(tmp_path), REPLACE, timeout_s=120)
    assert "notes.txt" in messages[1] and "not replaced" in messages[1]
    assert (tmp_path / "rank1" / "notes.txt").read_text() == "mine"


async def test_a_directory_a_live_run_holds_is_never_replaced(tmp_path: Path) -> None:
    held = RankDirectory(tmp_path, 1)  # a live run's claim (this process holds the lock)
    try:
        messages = await run_ranks(refused_body, 2, str(tmp_path), REPLACE, timeout_s=120)
        assert "in use by another run" in messages[1], messages
        assert held.path.is_dir()
    finally:
        held.remove()
    assert not any(tmp_path.iterdir())


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs; skips where mounting is not permitted (needs root)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


async def test_a_full_disk_fails_at_construction_naming_path_and_bytes(small_fs: Path) -> None:
    messages = await run_ranks(refused_body, 2, str(small_fs), timeout_s=120)
    for rank, message in enumerate(messages):
        if "no room" in message:
            assert f"rank{rank}" in message and "bytes" in message and "free" in message
    assert any("no room" in m for m in messages)
    assert not any(small_fs.iterdir())  # nothing left behind


def test_config_rules() -> None:
    with pytest.raises(ConfigError, match="needs nvme_path"):
        Zero3CpuOffloadConfig(offload_optimizer_device="nvme")
    with pytest.raises(ConfigError, match="offload_optimizer_states"):
        Zero3CpuOffloadConfig(**on_disk(Path("x")), offload_optimizer_states=False)
    with pytest.raises(ConfigError, match="speculative_step"):
        Zero3CpuOffloadConfig(**on_disk(Path("x")), speculative_step=True)
    with pytest.raises(ConfigError, match="offload_optimizer_device"):
        Zero3CpuOffloadConfig(offload_optimizer_device="disk")
    assert os.fspath(Zero3CpuOffloadConfig(**on_disk(Path("x"))).nvme_path) == "x"


def test_deepspeed_nvme_keys_map_to_the_disk_tier(tmp_path: Path, capsys) -> None:
    from test_train import DEEPSPEED, run_cli

    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}
    zero = {"stage": 3, "offload_optimizer": nvme, "offload_param": {"device": "cpu"}}
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(DEEPSPEED | {"zero_optimization": zero}))
    code, out, err = run_cli(capsys, "--deepspeed-config", str(ds), "--print-config")
    assert code == 0, err
    zero3 = json.loads(out)["zero3"]
    assert zero3["offload_optimizer_device"] == "nvme" and zero3["nvme_path"] == str(tmp_path)
    assert zero3["offload_optimizer_states"] and zero3["offload_param_device"] == "cpu"
    # Parameters on disk too, under the same directory.
    zero["offload_param"] = nvme
    ds.write_text(json.dumps(DEEPSPEED | {"zero_optimization": zero}))
    code, out, err = run_cli(capsys, "--deepspeed-config", str(ds), "--print-config")
    assert code == 0, err
    zero3 = json.loads(out)["zero3"]
    assert zero3["offload_param_device"] == "nvme" and zero3["offload_params"]
    # One directory for both tiers.
    zero["offload_param"] = {"device": "cpu", "nvme_path": str(tmp_path / "other")}
    ds.write_text(json.dumps(DEEPSPEED | {"zero_optimization": zero}))
    code, _, err = run_cli(capsys, "--deepspeed-config", str(ds), "--print-config")
    assert code == 2 and "give them the same directory" in err, err


async def logged_body(ctx: RankContext, path: str) -> list[dict[str, Any]]:
    from helpers import lm_loss, local_slice, make_batches, make_model

    from zero3_offload import Zero3CpuOffloadManager

    model = make_model(**MODEL)
    names = model.layer_names
    config = Zero3CpuOffloadConfig(**on_disk(Path(path)))
    with structlog.testing.capture_logs() as logs:
        async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
            for x, y in make_batches(2, 8):
                out = await manager.forward_pass(local_slice(x, ctx), names)
                out.requires_grad_()
                lm_loss(out.float(), local_slice(y, ctx)).backward()
                await manager.backward_pass(out.grad, names)
                await manager.optimizer_step(1e-3)
            shards = [lay.shard_numel for lay in manager.engine.layouts.values() if lay.numel]
    steps = [e for e in logs if e["event"] == "step"]
    return [{"disk": e["disk"], "shards": shards} for e in steps]


async def test_step_events_carry_each_steps_disk_traffic(tmp_path: Path) -> None:
    results = await run_ranks(logged_body, 2, str(tmp_path), timeout_s=120)
    config = Zero3CpuOffloadConfig(**on_disk(tmp_path))
    for steps in results:
        assert len(steps) == 2
        for step in steps:
            records = sum(disk_record_bytes(config, s) for s in step["shards"])
            disk = step["disk"]
            # Each layer read for its update and written back once per step; the
            # construction's writes are not part of the first step's figures.
            assert disk["read_bytes"] == disk["write_bytes"] == records
            assert disk["read_seconds"] > 0 and disk["write_seconds"] > 0


async def load_body(ctx: RankContext, path: str, config: dict[str, Any]) -> dict[str, Any]:
    from helpers import make_model

    from zero3_offload import CheckpointError, Zero3CpuOffloadManager

    cfg = Zero3CpuOffloadConfig(**config)
    async with Zero3CpuOffloadManager(cfg, ctx.group, make_model(seed=3, **MODEL)) as manager:
        before = await manager.full_state_dict()
        try:
            await manager.load_checkpoint(path)
            outcome = "loaded"
        except CheckpointError as exc:
            outcome = f"CheckpointError: {exc}"
        return {"outcome": outcome, "before": before, "after": await manager.full_state_dict()}


def test_a_streamed_load_resharding_or_refusing_a_truncated_file(tmp_path: Path) -> None:
    saved = tmp_path / "ckpt"
    run_named(2, {"save": (train, TrainSpec(steps=2, model=MODEL, save_dir=str(saved)))})
    [directory] = [p for p in saved.iterdir() if p.is_dir()]
    # Loaded at another world size, into the disk tier (streamed) and into memory: equal.
    tier = on_disk(tmp_path / "tier")
    loads = run_named(
        1, {t: (load_body, str(directory), c) for t, c in (("ram", {}), ("disk", tier))}
    )
    assert loads["ram"][0]["outcome"] == loads["disk"][0]["outcome"] == "loaded"
    assert_bitwise(loads["ram"][0]["after"], loads["disk"][0]["after"])
    # A truncated file is refused before anything changes, on every rank.
    shard = next(p for p in directory.iterdir() if p.name.startswith("rank-00001"))
    shard.write_bytes(shard.read_bytes()[:-64])
    results = run_named(2, {"bad": (load_body, str(directory), tier)})["bad"]
    for result in results:
        assert result["outcome"].startswith("CheckpointError"), result["outcome"]
        assert_bitwise(result["before"], result["after"])
    assert not any((tmp_path / "tier").iterdir())
