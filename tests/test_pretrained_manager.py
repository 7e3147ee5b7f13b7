"""The manager and transformers model directories at 2 ranks: ``from_pretrained`` (each rank
reads only its slices), training from it, ``save_pretrained``, ``generate`` and the ``export``
command, against plain transformers on the same weights.

Every rank run shares one 2-rank process start (``run_named`` in a module fixture); each
probe is ``guarded`` so that one failing probe does not hide the others' results.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from helpers import run_named
from hf_models import (
    LR,
    batch,
    build,
    call_kwargs,
    global_mean,
    guarded,
    local,
    make_config,
    max_diff,
    params,
    plain_train,
    unwrap,
)

from zero3_offload import CheckpointError, Zero3CpuOffloadManager
from zero3_offload.cli import main
from zero3_offload.errors import Zero3Error
from zero3_offload.testing import RankContext

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

WORLD = 2
KINDS = ("llama", "gpt2")
LAYOUTS = {"single": "5GB", "sharded": 20_000}  # max_shard_size: 1 file, or several
MICRO = 4  # micro-steps trained from the pretrained weights (2 AdamW steps)
TINY_SHARDS = 4096  # save_pretrained's max_shard_bytes: a file per tensor or two
ROOT = Path(__file__).resolve().parent.parent


def eval_ids(kind: str) -> torch.Tensor:
    """The batch whose logits are compared (the same on every rank)."""
    return batch(7, kind)[:2]


def prompt(rank: int) -> torch.Tensor:
    """Each rank's own prompt (ids 3.. are in both vocabularies; 0 is GPT-2's eos)."""
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randint(3, 97, (2, 5), generator=g)


def shard_bytes(manager: Zero3CpuOffloadManager) -> tuple[int, int]:
    """(fp32 bytes of the parameters' elements inside this rank's shards, of all parameters),
    from the layouts: padding holds no weights and is not read."""
    mine = everything = 0
    for lay in manager.engine.layouts.values():
        for slot in lay.slots:
            lo, hi = max(slot.offset, lay.shard_start), min(slot.offset + slot.numel, lay.shard_end)
            mine += max(0, hi - lo) * 4
            everything += slot.numel * 4
    return mine, everything


# ------------------------------------------------------------------------------- probes


async def load_probe(ctx: RankContext, path: str) -> dict[str, Any]:
    """from_pretrained: bytes read, the shard bytes expected, the full state."""
    with structlog.testing.capture_logs() as logs:
        manager = Zero3CpuOffloadManager.from_pretrained(make_config({}), ctx.group, path)
    loaded = [e for e in logs if e["event"] == "pretrained_loaded"]
    mine, everything = shard_bytes(manager)
    state = await manager.full_state_dict()
    await manager.close()
    return {
        "bytes_read": [e["bytes_read"] for e in loaded],
        "shard_bytes": mine,
        "model_bytes": everything,
        "state": state if ctx.rank == 0 else None,
    }


async def train_probe(ctx: RankContext, kind: str, src: str, out: str) -> dict[str, Any]:
    """From ``src``: greedy generation (units kept gathered and not), ``MICRO`` training
    micro-steps, a no_grad forward's logits, save_pretrained to ``out``/single and
    ``out``/sharded, and a save into ``out``/taken (not empty) that must fail."""
    manager = Zero3CpuOffloadManager.from_pretrained(make_config({}), ctx.group, src)
    tokens = {}
    for keep in (True, False):
        tokens[keep] = await manager.generate(
            prompt(ctx.rank), max_new_tokens=6, do_sample=False, keep_gathered=keep
        )
    losses = []
    for i in range(MICRO):
        x = local(batch(i, kind), ctx)
        result = await manager.forward(**call_kwargs(kind, x))
        await manager.backward(result.loss)
        losses.append(await global_mean(ctx, result.loss))
        await manager.optimizer_step(LR)
    with torch.no_grad():
        logits = (await manager.forward(input_ids=eval_ids(kind), use_cache=False)).logits
    await manager.save_pretrained(Path(out) / "single")
    await manager.save_pretrained(Path(out) / "sharded", max_shard_bytes=TINY_SHARDS)
    try:
        await manager.save_pretrained(Path(out) / "taken")
        refused = "saved"
    except CheckpointError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    state = await manager.full_state_dict()  # the ranks still agree after the failure
    await manager.close()
    return {
        "tokens": tokens,
        "losses": losses,
        "logits": logits,
        "refused": refused,
        "state": state if ctx.rank == 0 else None,
    }


async def checkpoint_probe(ctx: RankContext, src: str, module_ckpt: str, chain_ckpt: str) -> Any:
    """A module-mode checkpoint of GPT-2 from ``src`` after one step (and its no_grad
    logits); a chain-mode one of the seed-0 Llama as a mapping of its two children."""
    manager = Zero3CpuOffloadManager.from_pretrained(make_config({}), ctx.group, src)
    for i in range(2):
        x = local(batch(i, "gpt2"), ctx)
        result = await manager.forward(**call_kwargs("gpt2", x))
        await manager.backward(result.loss)
        await manager.optimizer_step(LR)
    await manager.save_checkpoint(module_ckpt)
    with torch.no_grad():
        logits = (await manager.forward(input_ids=eval_ids("gpt2"), use_cache=False)).logits
    await manager.close()
    llama = build("llama")
    chain = {"model": llama.model, "lm_head": llama.lm_head}  # names as the Llama's own
    async with Zero3CpuOffloadManager(make_config({}), ctx.group, chain) as manager:
        assert manager.model is None  # chain mode
        await manager.save_checkpoint(chain_ckpt)
    return logits


async def hostile_probe(ctx: RankContext, path: str) -> str:
    """What from_pretrained of ``path`` raises (on this rank)."""
    try:
        manager = Zero3CpuOffloadManager.from_pretrained(make_config({}), ctx.group, path)
    except Zero3Error as exc:
        return f"{type(exc).__name__}: {exc}"
    await manager.close()
    return "loaded"


# ----------------------------------------------------------------------------- fixtures


def _hostile_dirs(root: Path, llama_dir: Path) -> dict[str, Path]:
    """A Llama directory whose config.json says vocab 103 (the weights hold 101 rows), and one
    without its weight file."""
    wrong = root / "wrong-shape"
    wrong.mkdir()
    shutil.copy(llama_dir / "model.safetensors", wrong / "model.safetensors")
    config = json.loads((llama_dir / "config.json").read_text(encoding="utf-8"))
    config["vocab_size"] = 103
    (wrong / "config.json").write_text(json.dumps(config), encoding="utf-8")
    missing = root / "missing-weights"
    missing.mkdir()
    (missing / "config.json").write_text(
        (llama_dir / "config.json").read_text(encoding="utf-8"), encoding="utf-8"
    )
    return {"wrong_shape": wrong, "missing_weights": missing}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The saved source directories, and every probe's per-rank results, from one rank run."""
    root = tmp_path_factory.mktemp("pretrained")
    src: dict[str, Path] = {}
    for kind in KINDS:
        model = build(kind).eval()
        for layout, max_shard in LAYOUTS.items():
            src[f"{kind}-{layout}"] = root / "src" / f"{kind}-{layout}"
            model.save_pretrained(src[f"{kind}-{layout}"], max_shard_size=max_shard)
        taken = root / "out" / kind / "taken"
        taken.mkdir(parents=True)
        (taken / "keep.txt").write_text("not empty\n", encoding="utf-8")
    hostile = _hostile_dirs(root, src["llama-single"])
    calls: dict[str, tuple[Any, ...]] = {}
    for name, path in src.items():
        calls[f"load/{name}"] = (guarded, load_probe, str(path))
    for kind in KINDS:
        out = str(root / "out" / kind)
        calls[f"train/{kind}"] = (guarded, train_probe, kind, str(src[f"{kind}-sharded"]), out)
    ckpts = {"module": root / "ckpt-module", "chain": root / "ckpt-chain"}
    calls["checkpoints"] = (
        guarded,
        checkpoint_probe,
        str(src["gpt2-single"]),
        str(ckpts["module"]),
        str(ckpts["chain"]),
    )
    for name, path in hostile.items():
        calls[f"hostile/{name}"] = (guarded, hostile_probe, str(path))
    results = run_named(WORLD, calls)
    return {"root": root, "src": src, "ckpts": ckpts, "results": results}


def ranks(world: dict[str, Any], name: str) -> list[Any]:
    return [unwrap(r) for r in world["results"][name]]


def load_hf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


# -------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_holds_the_weights_reading_only_its_shard(world, kind, layout):
    src = world["src"][f"{kind}-{layout}"]
    if layout == "sharded":
        assert (src / "model.safetensors.index.json").is_file()
    expected = params(load_hf(src))  # tied weights once, as the manager names them
    results = ranks(world, f"load/{kind}-{layout}")
    state = results[0]["state"]
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    model_bytes = 4 * sum(v.numel() for v in expected.values())
    for r in results:
        assert r["model_bytes"] == model_bytes
        assert r["bytes_read"] == [r["shard_bytes"]]  # one event: exactly its slices
        assert r["shard_bytes"] <= 0.55 * model_bytes  # about half of the model, not all
    assert sum(r["shard_bytes"] for r in results) == model_bytes  # together: every byte once


@pytest.mark.parametrize("kind", KINDS)
def test_training_from_pretrained_matches_transformers(world, kind):
    ref = plain_train(kind, MICRO)  # the saved model's seed: the same initial weights
    assert max_diff(ref["state"], params(build(kind))) > 1e-3  # the steps changed the weights
    results = ranks(world, f"train/{kind}")
    losses = results[0]["losses"]
    assert max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)) < 1e-5
    state = results[0]["state"]
    assert state.keys() == ref["state"].keys()
    assert max((state[n] - v).abs().max().item() for n, v in ref["state"].items()) < 1e-4


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_loads_in_transformers(world, kind, layout):
    out = world["root"] / "out" / kind / layout
    files = sorted(p.name for p in out.iterdir())
    if layout == "single":
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    else:
        assert "model.safetensors.index.json" in files
        assert sum(f.endswith(".safetensors") for f in files) > 2
    back = load_hf(out)
    results = ranks(world, f"train/{kind}")
    for r in results:
        torch.testing.assert_close(hf_logits(back, eval_ids(kind)), r["logits"], atol=1e-5, rtol=0)
    state = params(back)
    assert state.keys() == results[0]["state"].keys()
    for name, value in state.items():
        assert torch.equal(value, results[0]["state"][name]), name
    if kind == "gpt2":
        assert back.lm_head.weight is back.transformer.wte.weight


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_into_a_non_empty_directory_fails_on_every_rank(world, kind):
    taken = world["root"] / "out" / kind / "taken"
    for r in ranks(world, f"train/{kind}"):
        assert r["refused"].startswith("CheckpointError: "), r["refused"]
        assert str(taken) in r["refused"]
    assert sorted(p.name for p in taken.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("kind", KINDS)
def test_generate_equals_the_unsharded_model(world, kind):
    model = load_hf(world["src"][f"{kind}-single"])
    for rank, r in enumerate(ranks(world, f"train/{kind}")):
        expected = model.generate(prompt(rank), max_new_tokens=6, do_sample=False)
        assert expected.shape[1] > prompt(rank).shape[1]
        for keep in (True, False):
            assert torch.equal(r["tokens"][keep], expected), (rank, keep)


def export(*args: Any) -> subprocess.CompletedProcess[str]:
    """``zero3-offload export`` in a new process."""
    cmd = [sys.executable, "-m", "zero3_offload", "export", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def export_here(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str]:
    """``zero3-offload export``'s main in this process: its exit status and stderr
    (``test_export_of_a_chain_mode_checkpoint_needs_a_config`` runs the real process)."""
    capsys.readouterr()
    code = main(["export", *map(str, args)])
    return code, capsys.readouterr().err


def test_export_of_a_module_mode_checkpoint_loads(world, capsys):
    out = world["root"] / "exported-module"
    code, err = export_here(capsys, world["ckpts"]["module"], out, "--max-shard-mib", "1")
    assert code == 0, err
    back = load_hf(out)
    logits = ranks(world, "checkpoints")[0]
    torch.testing.assert_close(hf_logits(back, eval_ids("gpt2")), logits, atol=1e-5, rtol=0)
    assert back.lm_head.weight is back.transformer.wte.weight


def test_export_of_a_chain_mode_checkpoint_needs_a_config(world, capsys):
    ranks(world, "checkpoints")  # the checkpoints were saved
    out = world["root"] / "exported-chain"
    refused = export(world["ckpts"]["chain"], out)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "--config" in lines[0], refused.stderr
    assert not out.exists()
    # The mapping's layers are the Llama's children: its own names, so its config fits.
    code, err = export_here(capsys, world["ckpts"]["chain"], out, "--config",
                            world["src"]["llama-single"])  # fmt: skip
    assert code == 0, err
    ids = eval_ids("llama")
    torch.testing.assert_close(
        hf_logits(load_hf(out), ids), hf_logits(build("llama").eval(), ids), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    ("case", "says"),
    [("wrong_shape", "shape"), ("missing_weights", "model.safetensors")],
)
def test_hostile_pretrained_directories_raise_checkpoint_error(world, case, says):
    for message in ranks(world, f"hostile/{case}"):
        assert message.startswith("CheckpointError: "), message
        assert says in message
