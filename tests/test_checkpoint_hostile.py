"""Hostile checkpoint directories are refused with CheckpointError before anything is
allocated from their metadata: impossible sizes, wrong types, paths outside the
directory, symlinks, truncated or mismatched tensors."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import make_batches, make_model, train_step

from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.checkpoint.consolidate import consolidate_checkpoint
from zero3_offload.checkpoint.format import METADATA, read_metadata, resolve_checkpoint
from zero3_offload.errors import CheckpointError
from zero3_offload.testing import RankContext, run_ranks

CONFIG = Zero3CpuOffloadConfig(cpu_memory_budget=2**30, gpu_param_memory_budget=2**28)


async def save_one(ctx: RankContext, root: str) -> str:
    model = make_model()
    async with Zero3CpuOffloadManager(CONFIG, ctx.group, model) as manager:
        await train_step(manager, ctx, make_batches(1, 4)[0], model.layer_names, 1e-3)
        return str(await manager.save_checkpoint(root))


async def load_one(ctx: RankContext, path: str) -> str:
    async with Zero3CpuOffloadManager(CONFIG, ctx.group, make_model(seed=3)) as manager:
        try:
            await manager.load_checkpoint(path)
        except CheckpointError as exc:
            return f"CheckpointError: {exc}"
        return "loaded"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    return Path(asyncio.run(run_ranks(save_one, 2, str(root)))[0])


def _meta(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads((directory / METADATA).read_text())
    change(meta)
    (directory / METADATA).write_text(json.dumps(meta))


def _first_param(meta: dict[str, Any]) -> dict[str, Any]:
    return next(layer for layer in meta["layers"] if layer["params"])["params"][0]


HOSTILE: dict[str, Callable[[dict[str, Any]], None]] = {
    "world size 10**9": lambda m: m.update(world_size=10**9),
    "world size a string": lambda m: m.update(world_size="2"),
    "layers not a list": lambda m: m.update(layers={"x": 1}),
    "negative offset": lambda m: _first_param(m).update(offset=-4),
    "shape of 2**60 elements": lambda m: _first_param(m).update(shape=[2**30, 2**30]),
    "numel not the shape's": lambda m: _first_param(m).update(numel=_first_param(m)["numel"] + 1),
    "parameter past its layer": lambda m: _first_param(m).update(offset=10**9),
    "layer numel 2**62": lambda m: m["layers"][0].update(numel=2**62),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_metadata_is_refused(saved: Path, tmp_path: Path, case: str) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    _meta(bad, HOSTILE[case])
    with pytest.raises(CheckpointError, match="refusing to load"):
        read_metadata(bad)
    with pytest.raises(CheckpointError):
        consolidate_checkpoint(bad, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_latest_naming_a_path_outside_the_root_is_refused(saved: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(saved, outside)
    root = tmp_path / "root"
    root.mkdir()
    for name in ("../outside", str(outside), "..", ""):
        (root / "latest").write_text(name)
        with pytest.raises(CheckpointError):
            resolve_checkpoint(root)


def test_symlinks_are_refused(saved: Path, tmp_path: Path) -> None:
    real = tmp_path / "real"
    shutil.copytree(saved, real)
    # A shard file that is a symlink (e.g. to a file elsewhere holding other data).
    linked = tmp_path / "linked"
    shutil.copytree(saved, linked)
    shard = next(p for p in linked.iterdir() if p.name.startswith("rank-00000"))
    shard.unlink()
    os.symlink(next(p for p in real.iterdir() if p.name.startswith("rank-00000")), shard)
    with pytest.raises(CheckpointError, match="symlink"):
        read_metadata(linked)
    # The metadata itself as a symlink.
    meta_link = tmp_path / "meta_link"
    shutil.copytree(saved, meta_link)
    (meta_link / METADATA).unlink()
    os.symlink(real / METADATA, meta_link / METADATA)
    with pytest.raises(CheckpointError, match="symlink"):
        read_metadata(meta_link)
    # A `latest` naming a symlinked checkpoint directory.
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(real, root / "step-00000001")
    (root / "latest").write_text("step-00000001")
    with pytest.raises(CheckpointError):
        resolve_checkpoint(root)


def test_tensor_bytes_not_matching_their_header_are_refused(saved: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    shard = next(p for p in bad.iterdir() if p.name.startswith("rank-00001"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 64])  # the header promises 64 more bytes
    results = asyncio.run(run_ranks(load_one, 2, str(bad)))
    assert all(r.startswith("CheckpointError") for r in results), results
    # A hostile metadata file fails the load on every rank too, nothing replaced.
    _meta(bad, HOSTILE["world size 10**9"])
    results = asyncio.run(run_ranks(load_one, 2, str(bad)))
    assert all("refusing to load" in r for r in results), results
