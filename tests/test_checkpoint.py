"""Checkpoints: exact resume, resharding, atomic saves, refusal of untrusted files."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TrainSpec, assert_bitwise, make_model, parameters, run_in_turn, run_named, train
from safetensors.torch import load_file

from zero3_offload import (
    CheckpointError,
    Zero3CpuOffloadConfig,
    Zero3CpuOffloadManager,
    consolidate_checkpoint,
)
from zero3_offload.checkpoint.atomic_save import prepare_save, write_shard
from zero3_offload.cli import main
from zero3_offload.testing import RankContext, RankFailedError, run_ranks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Checkpoints the tests only read, saved in one 2-rank run: ``good`` after 2 steps
    (returned with the state it holds) and ``foreign``, of a model with another layer."""
    root = tmp_path_factory.mktemp("checkpoints")
    runs = run_named(
        2,
        {
            "good": (train, TrainSpec(steps=2, save_dir=str(root / "good"))),
            "foreign": (
                train,
                TrainSpec(steps=1, save_dir=str(root / "foreign"), model={"n_blocks": 3}),
            ),
        },
    )
    return root, runs["good"][0]["state"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [{}, {"compute_dtype": "fp16"}],
    ids=["fp32", "fp16-loss-scaling"],
)
async def test_exact_resume_in_fresh_processes(tmp_path: Path, config: dict) -> None:
    # fp16: rank 1 injects an inf at step 2, so the saved loss scale is not the default.
    inject = (1, 2) if config else None
    straight, half = await run_in_turn(
        2,
        (train, TrainSpec(steps=10, config=config, inject_inf=inject)),
        (train, TrainSpec(steps=5, config=config, inject_inf=inject, save_dir=str(tmp_path))),
    )
    second = TrainSpec(steps=5, first_step=5, config=config, load_dir=str(tmp_path))
    resumed = await run_ranks(train, 2, second)
    assert_bitwise(straight[0]["state"], resumed[0]["state"])
    assert straight[0]["losses"][5:] == resumed[0]["losses"]
    if config:
        assert half[0]["loss_scales"][-1] == 2.0**15
        assert resumed[0]["loss_scales"] == straight[0]["loss_scales"][5:]
    # Named by updates made: the fp16 run skipped one step.
    expected = "step-00000004" if config else "step-00000005"
    assert (tmp_path / "latest").read_text().strip() == expected


@pytest.mark.slow
async def test_reshard_to_one_and_four_ranks(tmp_path: Path) -> None:
    more = {"steps": 3, "first_step": 3}
    saved, at_two = await run_in_turn(
        2,
        (train, TrainSpec(steps=3, save_dir=str(tmp_path))),
        (train, TrainSpec(load_dir=str(tmp_path), **more)),
    )
    for world in (1, 4):
        loaded, continued = await run_in_turn(
            world,
            # Zero steps: the loaded full state equals the saved one, bit for bit.
            (train, TrainSpec(steps=0, load_dir=str(tmp_path))),
            (train, TrainSpec(load_dir=str(tmp_path), **more)),
        )
        assert_bitwise(saved[0]["state"], loaded[0]["state"])
        for name, value in at_two[0]["state"].items():
            assert (continued[0]["state"][name] - value).abs().max().item() < 1e-4, name


async def crash_during_save(ctx: RankContext, root: str) -> None:
    config = Zero3CpuOffloadConfig(collective_timeout_s=20.0)
    async with Zero3CpuOffloadManager(config, ctx.group, make_model(seed=5)) as manager:
        engine = manager.engine
        tmp = await prepare_save(Path(root), "step-00000099", engine.comm)
        tensors = {f"{n}.master": engine.params.master(n) for n in engine.optimizer.layers()}
        write_shard(tmp, tensors, ctx.rank, ctx.world_size)
        if ctx.rank == 1:
            os._exit(17)  # killed between its shard write and the commit
        await manager.save_checkpoint(root)  # rank 0 goes on: must not commit


async def test_crash_during_save_keeps_previous_checkpoint(
    tmp_path: Path, checkpoints: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    root, saved = checkpoints
    shutil.copytree(root / "good", tmp_path, dirs_exist_ok=True)
    with pytest.raises(RankFailedError):
        await run_ranks(crash_during_save, 2, str(tmp_path), timeout_s=60)
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    assert not (tmp_path / "step-00000099").exists()
    loaded = await run_ranks(train, 2, TrainSpec(steps=0, load_dir=str(tmp_path)))
    assert_bitwise(saved, loaded[0]["state"])


async def bad_loads(ctx: RankContext, cases: dict[str, str]) -> dict[str, Any]:
    manager = Zero3CpuOffloadManager(Zero3CpuOffloadConfig(), ctx.group, make_model(seed=3))
    before = await manager.full_state_dict()
    out = {}
    for key, path in cases.items():
        try:
            await manager.load_checkpoint(path)
        except CheckpointError as exc:
            out[key] = str(exc)
    after = await manager.full_state_dict()
    out["unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    return out


async def test_untrusted_corrupt_and_foreign_checkpoints_are_refused(
    tmp_path: Path, checkpoints: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    root, _ = checkpoints
    ckpt = root / "good" / "step-00000002"

    def variant(name: str) -> Path:
        target = tmp_path / name / "step-00000002"
        target.mkdir(parents=True)
        for f in ckpt.iterdir():
            (target / f.name).write_bytes(f.read_bytes())
        return target

    pickled = variant("pickled")
    with (pickled / "extra.pt").open("wb") as fh:
        pickle.dump({"arbitrary": Path("/")}, fh)  # an arbitrary object, not tensors
    truncated = variant("truncated")
    shard = truncated / "rank-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    missing = variant("missing")
    (missing / "rank-00000-of-00002.safetensors").unlink()
    cases = {
        "pickle": str(pickled),
        "truncated": str(truncated),
        "missing": str(missing),
        "foreign": str(root / "foreign"),
        "nothing": str(tmp_path / "nowhere"),
    }
    results = await run_ranks(bad_loads, 2, cases)
    for r in results:
        assert "extra.pt" in r["pickle"] and "never pickles" in r["pickle"]
        assert "rank-00000-of-00002.safetensors" in r["missing"]
        assert "layers differ" in r["foreign"] and "block2" in r["foreign"]
        assert "no checkpoint" in r["nothing"]
        assert r["unchanged"]
    # The truncated file is rank 1's: rank 1 names it, rank 0 reports the other rank.
    assert "rank-00001-of-00002.safetensors" in results[1]["truncated"]
    assert "another rank" in results[0]["truncated"]


def test_consolidated_file_loads_strict_into_plain_model(
    tmp_path: Path, checkpoints: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    root, saved = checkpoints
    out = consolidate_checkpoint(root / "good", tmp_path / "model.safetensors")
    model = make_model(seed=123)
    model.load_state_dict(load_file(str(out)), strict=True)
    assert_bitwise(parameters(model), saved)
    pt = consolidate_checkpoint(root / "good", tmp_path / "model.pt", fmt="pt")
    state = torch.load(pt, weights_only=True)
    assert_bitwise(state, saved)
    x = torch.randint(0, 37, (2, 12))
    reference = make_model(seed=9)
    reference.load_state_dict(state, strict=True)
    assert torch.equal(model(x), reference(x))


@pytest.mark.slow
def test_consolidate_command(
    tmp_path: Path, checkpoints: tuple[Path, dict[str, torch.Tensor]], capsys
) -> None:
    root, saved = checkpoints
    out = tmp_path / "full.safetensors"
    # The command's main in this process; the refusal below runs the real process.
    assert main(["consolidate", str(root / "good"), str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert_bitwise(load_file(str(out)), saved)
    bad = subprocess.run(
        [sys.executable, "-m", "zero3_offload", "consolidate", str(tmp_path / "nope"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "no checkpoint" in bad.stderr and "Traceback" not in bad.stderr
