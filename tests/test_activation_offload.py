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
from helpers import assert_bitwise, lm_loss, make_batches, make_model, run_named
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


def _own_entries(root: Path, rank: int) -> list[str]:
    """This rank's entries under ``root``: its directory and its lock file (the other
    rank may not have closed yet)."""
    if not root.exists():
        return []
    return sorted(p for p in os.listdir(root) if p in (f"rank{rank}", f"rank{rank}.lock"))


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
    out["after_close"] = _own_entries(Path(root) / name, ctx.rank)
    return out


# chain mode (forward_pass/backward_pass on the tests' TinyGPT): name -> offload_activations
CHAIN = {"chain-none": "none", "chain-cpu": "cpu", "chain-nvme": "nvme"}


async def train_chain(ctx: RankContext, name: str, root: str) -> dict[str, Any]:
    """Train the chain-mode TinyGPT with variant ``name``; the files and counts on the way."""
    where = CHAIN[name]
    fields: dict[str, Any] = {**CKPT, "offload_activations": where}
    if where == "nvme":
        fields["nvme_path"] = str(Path(root) / name)
    model = make_model()
    names = model.layer_names
    saved_bytes: list[int] = []
    forwarding = [False]

    def count(_module: nn.Module, args: tuple[Any, ...]) -> None:
        if forwarding[0]:  # the forward's inputs, not the recomputations'
            saved_bytes.append(args[0].numel() * args[0].element_size())

    for layer in names:
        model.get_submodule(layer).register_forward_pre_hook(count)
    out: dict[str, Any] = {"losses": [], "offloaded": [], "files": []}
    rank_dir = Path(root) / name / f"rank{ctx.rank}"
    manager = Zero3CpuOffloadManager(make_config(fields), ctx.group, model)
    for x, y in make_batches(MICRO_STEPS, 8):
        forwarding[0] = True
        h = await manager.forward_pass(local(x, ctx), names)
        forwarding[0] = False
        out["offloaded"].append(manager.get_memory_stats().offloaded_activation_bytes)
        out["files"].append(_files(rank_dir) if where == "nvme" else [])
        h.requires_grad_()
        loss = lm_loss(h.float(), local(y, ctx))
        loss.backward()
        await manager.backward_pass(h.grad, names)
        out["files"].append(_files(rank_dir) if where == "nvme" else [])
        out["losses"].append(loss.item())
        await manager.optimizer_step(LR)
    out["saved_bytes"] = saved_bytes
    out["transfers"] = {
        key: (stats.operations, stats.bytes)
        for key, stats in manager.get_performance_stats().transfers.items()
        if key.startswith("activation")
    }
    out["state"] = await manager.full_state_dict()
    await manager.close()
    out["after_close"] = _own_entries(Path(root) / name, ctx.rank)
    return out


@pytest.fixture(scope="module")
def runs2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    root = str(tmp_path_factory.mktemp("activations"))
    calls = {name: (guarded, train_offload, name, root) for name in VARIANTS}
    calls.update({name: (guarded, train_chain, name, root) for name in CHAIN})
    return run_named(2, calls)


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
        assert r["after_close"] == []  # the rank's directory and its lock file


@pytest.mark.parametrize("name", ["chain-cpu", "chain-nvme"])
def test_chain_mode_offloads_bitwise_and_counts_the_layer_inputs(
    runs2: dict[str, list[Any]], name: str
) -> None:
    kept = results(runs2, "chain-none")
    for r, k in zip(results(runs2, name), kept, strict=True):
        assert r["losses"] == k["losses"]
        assert_bitwise(r["state"], k["state"])
        per_forward = sum(r["saved_bytes"]) // MICRO_STEPS
        assert per_forward > 0 and len(r["saved_bytes"]) == MICRO_STEPS * 5  # 5 layers
        assert r["offloaded"] == [per_forward] * MICRO_STEPS
        assert r["transfers"]["activation_offload"] == (5 * MICRO_STEPS, sum(r["saved_bytes"]))
        assert r["transfers"]["activation_restore"][1] == sum(r["saved_bytes"])
        if name == "chain-nvme":
            assert r["files"][1::2] == [[]] * MICRO_STEPS
            assert all(len(f) == 1 and f[0].startswith("activations-") for f in r["files"][::2])
            assert r["after_close"] == []
    assert kept[0]["transfers"] == {}


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

    chain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    try:
        Zero3CpuOffloadManager(make_config({"mlp_chunk_tokens": 4}), ctx.group, chain)
    except ConfigError as exc:
        out["chain"] = str(exc)
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
    assert "mlp_chunk_tokens=4 applies to module mode" in r["chain"]


def test_offload_needs_checkpointing_and_nvme_a_path() -> None:
    with pytest.raises(ConfigError, match="activation_checkpointing=False"):
        make_config({"offload_activations": "nvme", "nvme_path": "x"})
    with pytest.raises(ConfigError, match="needs nvme_path"):
        make_config({**CKPT, "offload_activations": "nvme"})


def test_a_hook_around_a_checkpoint_sees_its_positional_inputs_only() -> None:
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
