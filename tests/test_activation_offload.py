"""Checkpointed activations offloaded (``offload_activations``, see [Note: activation
offload]): bitwise the training of keeping them, at 2 ranks; the bytes counted are the
saved inputs' bytes; the file is gone after each backward and after close; failures
raise a library error and leave nothing; the refusals."""

from __future__ import annotations

import os
import resource
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import structlog
import torch
from helpers import assert_bitwise, run_named
from hf_models import (
    LR,
    batch,
    build,
    call_kwargs,
    global_mean,
    guarded,
    local,
    loss_of,
    make_config,
    max_diff,
    plain_train,
    unwrap,
    vocab_size,
)
from torch import nn

from zero3_offload import Zero3CpuOffloadManager
from zero3_offload.errors import ConfigError, DiskTierError, LayerExecutionError
from zero3_offload.testing import RankContext

MICRO_STEPS = 4  # 2 AdamW steps
CKPT = {"activation_checkpointing": True}
TILED = {**CKPT, "mlp_chunk_tokens": 7}
# name -> (config, the variant it must equal bitwise)
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "none": (CKPT, "none"),
    "cpu": ({**CKPT, "offload_activations": "cpu"}, "none"),
    "nvme": ({**CKPT, "offload_activations": "nvme"}, "none"),
    "tiled": (TILED, "tiled"),
    "tiled-nvme": ({**TILED, "offload_activations": "nvme"}, "tiled"),
}


def _files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else ["<no directory>"]


async def train_offload(ctx: RankContext, name: str, root: str) -> dict[str, Any]:
    """Train llama with variant ``name``; what the files and the counts were along the way."""
    fields, _ = VARIANTS[name]
    nvme = fields.get("offload_activations") == "nvme"
    if nvme:
        fields = {**fields, "nvme_path": str(Path(root) / name)}
    model = build("llama")
    with structlog.testing.capture_logs() as logs:
        out = await _train(ctx, name, root, fields, model, nvme)
    out["events"] = [e["activations"] for e in logs if e["event"] == "step" and "activations" in e]
    return out


async def _train(
    ctx: RankContext, name: str, root: str, fields: dict[str, Any], model: nn.Module, nvme: bool
) -> dict[str, Any]:
    manager = Zero3CpuOffloadManager(make_config(fields), ctx.group, model)
    rank_dir = Path(root) / name / f"rank{ctx.rank}"
    saved_bytes = []  # each checkpointed layer's hidden states, counted from the tensor
    hooks = [
        layer.register_forward_pre_hook(
            lambda _m, args: saved_bytes.append(args[0].numel() * args[0].element_size())
        )
        for layer in model.model.layers
    ]
    out: dict[str, Any] = {"losses": [], "after_forward": [], "after_backward": []}
    out["offloaded"] = []  # memory stats: (offloaded, activation_bytes) after each pass
    for i in range(MICRO_STEPS):
        x = local(batch(i, "llama"), ctx)
        loss = loss_of(await manager.forward(**call_kwargs("llama", x)))
        out["after_forward"].append(_files(rank_dir) if nvme else [])
        memory = manager.get_memory_stats()
        out["offloaded"].append((memory.offloaded_activation_bytes, memory.activation_bytes))
        await manager.backward(loss)
        out["after_backward"].append(_files(rank_dir) if nvme else [])
        out["offloaded"].append((manager.get_memory_stats().offloaded_activation_bytes, 0))
        out["losses"].append(await global_mean(ctx, loss))
        await manager.optimizer_step(LR)
    for hook in hooks:
        hook.remove()
    transfers = manager.get_performance_stats().transfers
    out["transfers"] = {
        key: (stats.operations, stats.bytes, stats.time)
        for key, stats in transfers.items()
        if key.startswith("activation")
    }
    out["saved_bytes"] = saved_bytes
    out["state"] = await manager.full_state_dict()
    await manager.close()
    out["after_close"] = (Path(root) / name).exists() and sorted(os.listdir(Path(root) / name))
    return out


@pytest.fixture(scope="module")
def runs2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    root = str(tmp_path_factory.mktemp("activations"))
    return run_named(2, {name: (guarded, train_offload, name, root) for name in VARIANTS})


def results(runs2: dict[str, list[Any]], name: str) -> list[dict[str, Any]]:
    return [unwrap(r) for r in runs2[name]]


def test_checkpointing_trains_like_plain_transformers(runs2: dict[str, list[Any]]) -> None:
    """The reference of the bitwise checks trains like plain transformers."""
    ref = plain_train("llama", MICRO_STEPS)
    for r in results(runs2, "none"):
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True)) < 1e-5
        assert max_diff(r["state"], ref["state"]) < 1e-4


@pytest.mark.parametrize("name", [n for n, (_, same) in VARIANTS.items() if n != same])
def test_offloaded_activations_train_bitwise_as_kept(
    runs2: dict[str, list[Any]], name: str
) -> None:
    kept = results(runs2, VARIANTS[name][1])
    for a, b in zip(results(runs2, name), kept, strict=True):
        assert a["losses"] == b["losses"]
        assert_bitwise(a["state"], b["state"])


@pytest.mark.parametrize("name", ["cpu", "nvme", "tiled-nvme"])
def test_the_bytes_counted_are_the_saved_inputs_bytes(
    runs2: dict[str, list[Any]], name: str
) -> None:
    for r in results(runs2, name):
        units = len(r["saved_bytes"])
        assert units == 2 * MICRO_STEPS  # 2 decoder layers per forward
        total = sum(r["saved_bytes"])
        assert total == MICRO_STEPS * 2 * (6 // 2) * 16 * 32 * 4  # rows x seq x hidden x fp32
        out_ops, out_bytes, out_s = r["transfers"]["activation_offload"]
        in_ops, in_bytes, in_s = r["transfers"]["activation_restore"]
        assert (out_ops, out_bytes) == (units, total)
        assert (in_ops, in_bytes) == (units, total)
        assert out_s > 0
        assert in_s > 0 or name == "cpu"  # on the CPU device "cpu" hands its copy back
        # Memory stats: each forward's inputs offloaded until its backward, and no longer
        # among the activations kept on the device.
        per_forward = total // MICRO_STEPS
        kept = results(runs2, VARIANTS[name][1])[0]["offloaded"]
        assert r["offloaded"][::2] == [(per_forward, a - per_forward) for _, a in kept[::2]]
        assert r["offloaded"][1::2] == [(0, 0)] * MICRO_STEPS
        # The step events' figures add up to the totals, step by step.
        events = r["events"]
        assert len(events) == MICRO_STEPS // 2
        assert {e["place"] for e in events} == {"cpu" if name == "cpu" else "nvme"}
        assert [e["offload_bytes"] for e in events] == [total // len(events)] * len(events)
        assert sum(e["restore_bytes"] for e in events) == total
        assert sum(e["offload_seconds"] for e in events) == pytest.approx(out_s)
    assert "activation_offload" not in results(runs2, "none")[0]["transfers"]


@pytest.mark.parametrize("name", ["nvme", "tiled-nvme"])
def test_the_file_lives_from_forward_to_backward_and_nothing_outlives_close(
    runs2: dict[str, list[Any]], name: str
) -> None:
    for r in results(runs2, name):
        # one file per forward, the two names in turn (forwards 1, 2, ...)
        names = [[f"activations-{(i + 1) % 2}.bin"] for i in range(MICRO_STEPS)]
        assert r["after_forward"] == names
        assert r["after_backward"] == [[]] * MICRO_STEPS
        assert r["after_close"] == []  # the rank directories and their lock files


# ------------------------------------------------------------ failures, refusals


async def failures(ctx: RankContext, root: str) -> dict[str, Any]:
    """A missing directory and a full disk (the file size limit) fail the forward with
    DiskTierError and leave no file; the manager trains on after each; a failed forward
    leaves the pending forward's file to its backward; close deletes the file of a
    forward without its backward. Chain mode refuses the tiled MLP."""
    out: dict[str, Any] = {}
    config = make_config({**CKPT, "offload_activations": "nvme", "nvme_path": root})
    manager = Zero3CpuOffloadManager(config, ctx.group, build("llama"))
    rank_dir = Path(root) / f"rank{ctx.rank}"
    x = local(batch(0, "llama"), ctx)

    async def step() -> float:
        loss = loss_of(await manager.forward(**call_kwargs("llama", x)))
        await manager.backward(loss)
        await manager.optimizer_step(LR)
        return loss.item()

    shutil.rmtree(rank_dir)
    try:
        await step()
    except DiskTierError as exc:
        out["missing"] = str(exc)
    out["missing_left"] = sorted(os.listdir(root))
    rank_dir.mkdir()
    out["after_missing"] = await step()

    # The first record (6 x 16 x 32 fp32: 12 KiB) fits, the second passes the limit.
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, previous[1]))
    try:
        await step()
    except DiskTierError as exc:
        out["full"] = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, handler)
    out["full_left"] = sorted(os.listdir(rank_dir))
    out["after_full"] = await step()

    # A forward that fails leaves the pending forward's offloaded inputs to its backward.
    loss = loss_of(await manager.forward(**call_kwargs("llama", x)))
    pending = sorted(os.listdir(rank_dir))
    try:
        await manager.forward(**call_kwargs("llama", x + vocab_size("llama")))
    except LayerExecutionError as exc:
        out["failed_forward"] = type(exc.__cause__).__name__
    out["pending_kept"] = pending == sorted(os.listdir(rank_dir)) and len(pending) == 1
    await manager.backward(loss)
    await manager.optimizer_step(LR)
    out["after_pending"] = sorted(os.listdir(rank_dir))
    await manager.forward(**call_kwargs("llama", x))  # no backward: close deletes its file
    out["before_close"] = sorted(os.listdir(rank_dir))
    await manager.close()
    out["closed_left"] = sorted(os.listdir(root))

    for field in ({**CKPT, "offload_activations": "cpu"}, {"mlp_chunk_tokens": 4}):
        chain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        try:
            Zero3CpuOffloadManager(make_config(field), ctx.group, chain)
        except ConfigError as exc:
            out.setdefault("chain", []).append(str(exc))
    return out


def test_disk_failures_raise_and_leave_nothing(tmp_path: Path) -> None:
    (r,) = run_named(1, {"failures": (failures, str(tmp_path))})["failures"]
    assert "activations-1.bin" in r["missing"]
    assert r["missing_left"] == ["rank0.lock"]  # the lock is the manager's until close
    assert "failed" in r["full"] and "activations-" in r["full"]
    assert r["full_left"] == []
    assert r["after_missing"] > 0 and r["after_full"] > 0
    assert r["failed_forward"] == "IndexError"
    assert r["pending_kept"] and r["after_pending"] == []
    assert len(r["before_close"]) == 1 and r["before_close"][0].startswith("activations-")
    assert r["closed_left"] == []
    assert len(r["chain"]) == 2
    assert "offload_activations='cpu' applies to module mode" in r["chain"][0]
    assert "mlp_chunk_tokens=4 applies to module mode" in r["chain"][1]


def test_offload_needs_checkpointing_and_nvme_a_path() -> None:
    with pytest.raises(ConfigError, match="activation_checkpointing=False"):
        make_config({"offload_activations": "nvme", "nvme_path": "x"})
    with pytest.raises(ConfigError, match="needs nvme_path"):
        make_config({**CKPT, "offload_activations": "nvme"})


def test_torch_rejects_nothing_we_rely_on() -> None:
    """A saved-tensor hook around a non-reentrant checkpoint sees its positional inputs
    (the hidden states), and only those: what the offload moves."""
    seen: list[torch.Tensor] = []
    h = torch.randn(3, 4, requires_grad=True) * 2
    lin = nn.Linear(4, 4)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        y = torch.utils.checkpoint.checkpoint(
            lambda a, k: lin(a).relu() * k, h, use_reentrant=False, k=torch.ones(4)
        )
    y.sum().backward()
    assert len(seen) == 1 and seen[0] is h
