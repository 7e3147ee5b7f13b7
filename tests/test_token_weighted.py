"""Token-weighted losses (``backward(loss, tokens=n)``, ``backward_pass(..., tokens=n)``) on
real ranks == plain single-process training on the whole batch with the global token mean.

Each micro-batch row keeps a different share of its label tokens (masked-LM style), so
ranks and micro-steps hold very different numbers of valid tokens: a rank's micro-batch
may hold none (its own mean loss is NaN), and one accumulation window holds none at all
on any rank (the defined behaviour: every rank skips that update). The plain reference
divides the window's summed per-token losses by its valid tokens over the whole batch,
then clips (1.0) and steps AdamW (lr 1e-3). A control run without ``tokens`` (the mean
of the ranks' means) is far from it, so the comparison can fail.

The rank runs are shared: one per world size and mode (module fixtures), each test
checks its own variant.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("transformers")

import structlog
import torch
import torch.nn.functional as F
from helpers import make_model, run_in_turn
from hf_models import guarded, make_config, unwrap
from torch import nn
from transformers import BertConfig, BertForMaskedLM

from zero3_offload import Zero3CpuOffloadManager
from zero3_offload.errors import CommunicationError, InputError, RankDivergenceError, Zero3Error
from zero3_offload.testing import RankContext

ROWS = 6  # rows of the whole batch of a micro-step: split evenly over 2 or 3 ranks
SEQ = 12
ACC = 2
CLIP = 1.0
LR = 1e-3
MICRO = 10  # 5 windows
ZERO_WINDOW = 1  # the window (micro-steps 2, 3) with no valid token on any rank
SAVE_AFTER = 5  # micro-steps before the mid-window checkpoint (2 ranks -> resumed on 3)
BERT_VOCAB = 61
CHAIN_VOCAB = 37
MASK_ID = 1
# Share of each row's label tokens kept, per (micro-step + row) % 6: very unequal.
KEEP = (0.9, 0.05, 0.5, 0.15, 1.0, 0.3)
OFFLOAD_MICRO = 6  # the zero window and two updates
OFFLOAD = [(p, g, o) for p in (True, False) for g in (True, False) for o in (True, False)]


# ---------------------------------------------------------------------------- model and data


def build_bert() -> nn.Module:
    """A tiny BERT masked LM (its decoder tied to the word embeddings), dropout 0."""
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=BERT_VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(cfg)
    model.train()
    return model


@attrs.frozen
class Data:
    """How the label masks are drawn."""

    zero_window: bool = True  # window ZERO_WINDOW holds no valid token
    empty: bool = True  # micro-step 1's rows 4, 5 (rank 2 of 3) hold none


def batch(i: int, vocab: int, data: Data) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-step ``i``'s whole batch: input ids and labels (-100 where not predicted)."""
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(2, vocab, (ROWS, SEQ), generator=g)
    targets = torch.randint(2, vocab, (ROWS, SEQ), generator=g)
    keep = torch.stack(
        [torch.rand(SEQ, generator=g) < KEEP[(i + row) % len(KEEP)] for row in range(ROWS)]
    )
    keep[:, 0] |= torch.tensor([True, False, True, False, True, False])  # rows 0, 2, 4: >= 1
    if data.empty and i == 1:
        keep[4:] = False
    if data.zero_window and i // ACC == ZERO_WINDOW:
        keep[:] = False
    labels = torch.where(keep, targets, torch.full_like(targets, -100))
    if vocab == BERT_VOCAB:  # masked LM: the predicted positions are masked in the input
        ids = torch.where(keep, torch.full_like(ids, MASK_ID), ids)
    return ids, labels


def rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def logits_of(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x).logits if kind == "bert" else model(x)


def vocab_of(kind: str) -> int:
    return BERT_VOCAB if kind == "bert" else CHAIN_VOCAB


def build(kind: str) -> nn.Module:
    return build_bert() if kind == "bert" else make_model()


# -------------------------------------------------------------------------- plain reference


@functools.cache
def plain(
    kind: str,
    data: Data = Data(),
    *,
    clip: float = CLIP,
    weighted: bool = True,
    world: int = 1,
    skip: tuple[int, ...] = (),
    micro: int = MICRO,
) -> dict[str, Any]:
    """Plain training on whole batches, one AdamW step per window of ACC micro-steps.

    ``weighted``: the loss is the window's summed per-token losses over its valid tokens
    (a window without any is skipped). Otherwise (the control) each micro-step's loss is
    the mean over ``world`` equal row slices of their own token means, divided by ACC.
    The windows in ``skip`` are skipped too (as fp16 loss scaling skips its first step).
    Returns each window's valid tokens and whether it updated, each updating window's loss
    and gradient norm, and the parameters.
    """
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    vocab = vocab_of(kind)
    losses, tokens, norms, updated = [], [], [], []
    for w in range(micro // ACC):
        window = [batch(i, vocab, data) for i in range(w * ACC, (w + 1) * ACC)]
        n = sum(int((labels != -100).sum()) for _, labels in window)
        tokens.append(n)
        # No loss to follow (the defined behaviour skips the update), or skipped as asked.
        updated.append(not (weighted and n == 0) and w not in skip)
        if not updated[-1]:
            continue
        summed = 0.0
        for x, labels in window:
            flat = logits_of(kind, model, x).reshape(-1, vocab)
            if weighted:
                loss = F.cross_entropy(flat, labels.reshape(-1), reduction="sum")
                (loss / n).backward()
                summed += loss.item()
                continue
            parts = [
                F.cross_entropy(
                    rows(flat.view(ROWS, SEQ, vocab), r, world).reshape(-1, vocab),
                    rows(labels, r, world).reshape(-1),
                )
                for r in range(world)
            ]
            (sum(parts) / world / ACC).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(summed / n if weighted else float("nan"))
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "tokens": tokens, "norms": norms, "updated": updated, "state": state}


def weighting_gap() -> float:
    """How far the mean of 2 ranks' means trains from the global token mean (parameters),
    on masks where no rank's micro-batch is empty (the mean of means is then defined)."""
    data = Data(zero_window=False, empty=False)
    control = plain("bert", data, weighted=False, world=2)
    return max_diff(control["state"], plain("bert", data)["state"])


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


# ------------------------------------------------------------------------------ rank runs


@attrs.frozen
class Spec:
    """One training run on the ranks."""

    kind: str = "bert"  # "bert" (module mode) or "chain" (TinyGPT, forward_pass)
    data: Data = Data()
    tokens: bool = True  # pass tokens= (False: the control, the mean of means)
    early: bool = False  # chain mode: learning_rate= to backward_pass (early updates)
    clip: float = CLIP
    config: dict[str, Any] = attrs.Factory(dict)
    first: int = 0  # the first micro-step (a resumed run)
    stop: int = MICRO  # micro-steps end here
    load_dir: str | None = None
    save_dir: str | None = None  # saved after the last micro-step


async def _sums(ctx: RankContext, *values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, group=ctx.group)
    return t.tolist()


async def _micro_step(
    manager: Zero3CpuOffloadManager, spec: Spec, x: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Forward and backward of this rank's micro-batch; its mean loss and valid tokens."""
    n = int((labels != -100).sum())
    tokens = torch.tensor(n) if spec.tokens else None  # a tensor is accepted too
    if spec.kind == "bert":
        out = await manager.forward(input_ids=x, labels=labels)
        await manager.backward(out.loss, tokens=tokens)
        return out.loss.detach(), n
    names = list(manager.layer_names)
    out = await manager.forward_pass(x, names)
    out.requires_grad_()
    loss = F.cross_entropy(out.reshape(-1, CHAIN_VOCAB), labels.reshape(-1))
    loss.backward()
    lr = LR if spec.early else None
    await manager.backward_pass(out.grad, names, learning_rate=lr, tokens=tokens)
    return loss.detach(), n


async def train(ctx: RankContext, spec: Spec) -> dict[str, Any]:
    """Train on this rank's rows of every micro-batch; the global token-mean loss per window."""
    config = make_config({"gradient_clipping": spec.clip, **spec.config})
    model = build(spec.kind)
    vocab = vocab_of(spec.kind)
    out: dict[str, Any] = {}
    with structlog.testing.capture_logs() as logs:
        manager = Zero3CpuOffloadManager(config, ctx.group, model)
        async with manager:
            if spec.load_dir is not None:
                await manager.load_checkpoint(spec.load_dir)
            losses, stepped, norms, summed, count = [], [], [], 0.0, 0.0
            for i in range(spec.first, spec.stop):
                x, labels = (rows(t, ctx.rank, ctx.world_size) for t in batch(i, vocab, spec.data))
                loss, n = await _micro_step(manager, spec, x, labels)
                summed, count = summed + (loss.item() * n if n else 0.0), count + n
                stepped.append(await manager.optimizer_step(LR))
                if (i + 1) % ACC == 0:
                    total, tokens = await _sums(ctx, summed, count)
                    if stepped[-1]:
                        losses.append(total / tokens)
                        norms.append(manager.last_grad_norm)
                    summed, count = 0.0, 0.0
            if spec.save_dir is not None:
                await manager.save_checkpoint(spec.save_dir)
            out["state"] = await manager.full_state_dict()
    out["events"] = [dict(e) for e in logs if e["event"] in ("step", "step_skipped")]
    out.update(losses=losses, stepped=stepped, norms=norms)
    return out


async def probe_refusals(ctx: RankContext) -> dict[str, Any]:
    """Misuses of tokens=, each call's error (or "ok"); last, one rank passing tokens where
    the other does not (the group refuses further collectives after that)."""
    model = build_bert()
    out: dict[str, Any] = {}
    manager = Zero3CpuOffloadManager(make_config({}), ctx.group, model)
    x, labels = (rows(t, ctx.rank, ctx.world_size) for t in batch(0, BERT_VOCAB, Data()))

    async def outcome(key: str, tokens: Any) -> None:
        try:
            await manager.backward(pending.loss, tokens=tokens)
        except Zero3Error as exc:
            out[key] = (type(exc).__name__, str(exc))
            return
        out[key] = "ok"

    pending = await manager.forward(input_ids=x, labels=labels)
    for key, bad in {
        "negative": -1,
        "float": 3.5,
        "bool": True,
        "float_tensor": torch.tensor(3.0),
        "vector": torch.tensor([1, 2]),
    }.items():
        await outcome(key, bad)
    await outcome("first", 5)  # the pending forward is still there after the refusals
    await manager.optimizer_step(LR)
    pending = await manager.forward(input_ids=x, labels=labels)
    await outcome("mixed_in_window", None)  # refused: the window's first had tokens
    await outcome("second", 7)  # the forward is still pending: this completes the window
    out["stepped"] = await manager.optimizer_step(LR)
    pending = await manager.forward(input_ids=x, labels=labels)
    await outcome("across_ranks", 3 if ctx.rank == 0 else None)
    await manager.close()
    return out


def run(world: int, calls: dict[str, tuple[Any, ...]]) -> dict[str, list[Any]]:
    """Every call guarded and in turn on ``world`` ranks; by name, the ranks' results."""
    guarded_calls = [(guarded, *call) for call in calls.values()]
    results = asyncio.run(run_in_turn(world, *guarded_calls))
    return dict(zip(calls, results, strict=True))


def get(runs: dict[str, list[Any]], name: str) -> list[dict[str, Any]]:
    return [unwrap(r) for r in runs[name]]


def offload_name(combo: tuple[bool, bool, bool]) -> str:
    return "offload-" + "".join("1" if c else "0" for c in combo)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("token-weighted") / "mid-window"


@pytest.fixture(scope="module")
def runs2(checkpoint_dir: Path) -> dict[str, list[Any]]:
    """Every 2-rank variant, module and chain mode, in one rank run."""
    calls: dict[str, tuple[Any, ...]] = {
        "bert": (train, Spec()),
        "bert-control": (train, Spec(data=Data(False, False), tokens=False)),
        "bert-fp16": (
            train,
            Spec(data=Data(False, False), config={"compute_dtype": torch.float16}),
        ),
        "bert-save": (train, Spec(stop=SAVE_AFTER, save_dir=str(checkpoint_dir))),
        "chain": (train, Spec(kind="chain")),
        "chain-early-speculative": (
            train,
            Spec(kind="chain", early=True, config={"speculative_step": True}),
        ),
        "chain-early-no-clip": (train, Spec(kind="chain", early=True, clip=0.0)),
    }
    for combo in OFFLOAD:
        config = dict(
            zip(("offload_params", "offload_grads", "offload_optimizer_states"), combo, strict=True)
        )
        calls[offload_name(combo)] = (train, Spec(config=config, stop=OFFLOAD_MICRO))
    calls["refusals"] = (probe_refusals,)  # last: it leaves the group refusing collectives
    return run(2, calls)


@pytest.fixture(scope="module")
def runs3(runs2: dict[str, list[Any]], checkpoint_dir: Path) -> dict[str, list[Any]]:
    """The 3-rank variants; one resumes the 2-rank run's mid-window checkpoint."""
    assert all(unwrap(r) for r in runs2["bert-save"])  # the checkpoint exists
    calls: dict[str, tuple[Any, ...]] = {
        "bert": (train, Spec()),
        "bert-resume": (train, Spec(first=SAVE_AFTER, load_dir=str(checkpoint_dir))),
        "chain": (train, Spec(kind="chain")),
        "chain-early-speculative": (
            train,
            Spec(kind="chain", early=True, config={"speculative_step": True}),
        ),
    }
    return run(3, calls)


def _check_exact(results: list[dict[str, Any]], ref: dict[str, Any]) -> tuple[float, float]:
    """Losses and parameters against the plain token-mean reference; (loss, param) diffs."""
    micro = len(ref["updated"]) * ACC
    for r in results:
        expected = [(i + 1) % ACC == 0 and ref["updated"][i // ACC] for i in range(micro)]
        assert r["stepped"] == expected
    loss_diff = max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"], strict=True))
    param_diff = max_diff(results[0]["state"], ref["state"])
    for r in results[1:]:
        assert r["losses"] == results[0]["losses"]  # all-reduced: the same on every rank
    return loss_diff, param_diff


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["bert", "chain"])
def test_token_weighted_training_equals_plain_global_token_mean(
    runs2: dict, runs3: dict, world: int, kind: str
) -> None:
    runs = runs2 if world == 2 else runs3
    results = get(runs, kind)
    ref = plain(kind)
    loss_diff, param_diff = _check_exact(results, ref)
    print(f"{kind} at {world} ranks: loss {loss_diff:.2e}, params {param_diff:.2e}")
    assert loss_diff < 1e-5
    assert param_diff < 1e-5  # the contract: 1e-4
    for r in results:
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)  # clip_grad_norm_'s norm
        steps = [e for e in r["events"] if e["event"] == "step"]
        assert [e["tokens"] for e in steps] == ref["tokens"]  # valid tokens per step, global
        assert [e["stepped"] for e in steps] == ref["updated"]
        assert not ref["updated"][ZERO_WINDOW]
        skips = [e for e in r["events"] if e["event"] == "step_skipped"]
        assert [e["reason"] for e in skips] == ["no valid tokens on any rank"]
    assert all(torch.isfinite(v).all() for v in results[0]["state"].values())


@pytest.mark.slow
def test_the_mean_of_rank_means_differs_and_the_check_sees_it(runs2: dict) -> None:
    # Without tokens= the manager trains the mean of the ranks' means (as it should), which
    # is far from the global token mean: the exactness test above can fail.
    results = get(runs2, "bert-control")
    control = plain("bert", Data(False, False), weighted=False, world=2)
    assert max_diff(results[0]["state"], control["state"]) < 1e-5
    gap = weighting_gap()
    print(f"mean of rank means vs global token mean: params {gap:.2e}")
    assert gap > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("combo", OFFLOAD, ids=offload_name)
def test_token_weighting_holds_for_every_offload_combination(
    runs2: dict, combo: tuple[bool, bool, bool]
) -> None:
    ref = plain("bert", micro=OFFLOAD_MICRO)
    loss_diff, param_diff = _check_exact(get(runs2, offload_name(combo)), ref)
    assert loss_diff < 1e-5
    assert param_diff < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_early_updates_use_the_window_total_agreed_before_them(
    runs2: dict, runs3: dict, world: int
) -> None:
    runs = runs2 if world == 2 else runs3
    loss_diff, param_diff = _check_exact(get(runs, "chain-early-speculative"), plain("chain"))
    print(f"chain, speculative early updates, {world} ranks: params {param_diff:.2e}")
    assert loss_diff < 1e-5
    assert param_diff < 1e-5
    if world == 2:
        results = get(runs2, "chain-early-no-clip")
        loss_diff, param_diff = _check_exact(results, plain("chain", clip=0.0))
        assert loss_diff < 1e-5
        assert param_diff < 1e-5


@pytest.mark.slow
def test_fp16_loss_scaling_unscales_the_token_weighted_gradient(runs2: dict) -> None:
    # fp16 compute tracks fp32 as without tokens (test_mixed_precision.py: within 5e-3), and
    # the global token mean, not the mean of the ranks' means. The first step overflows at
    # the initial scale 2^16 (without tokens= too) and is skipped, as GradScaler skips it.
    results = get(runs2, "bert-fp16")
    data = Data(zero_window=False, empty=False)
    _, param_diff = _check_exact(results, plain("bert", data, skip=(0,)))
    control = plain("bert", data, weighted=False, world=2, skip=(0,))
    to_control = max_diff(results[0]["state"], control["state"])
    print(f"fp16: params {param_diff:.2e} (to the mean of means: {to_control:.2e})")
    assert param_diff < 5e-3
    assert param_diff < to_control / 2
    assert results[0]["events"][0]["reason"] == "inf/nan gradient"


@pytest.mark.slow
def test_a_mid_window_checkpoint_resumes_at_another_world_size(runs3: dict) -> None:
    # Saved on 2 ranks after the first micro-step of a window, resumed on 3.
    results = get(runs3, "bert-resume")
    ref = plain("bert")
    assert max_diff(results[0]["state"], ref["state"]) < 1e-5
    # Its first window's loss has only the resumed half; the last two are whole.
    assert results[0]["losses"][-2:] == pytest.approx(ref["losses"][-2:], abs=1e-5)


@pytest.mark.slow
def test_tokens_misuse_is_refused_on_every_rank(runs2: dict) -> None:
    results = get(runs2, "refusals")
    for r in results:
        for key in ("negative", "float", "bool", "float_tensor", "vector"):
            assert r[key][0] == InputError.__name__, (key, r[key])
        assert "tokens" in r["float"][1]
        assert r["first"] == "ok"
        name, message = r["mixed_in_window"]
        assert name == InputError.__name__
        assert "without tokens=" in message and "nothing changed" in message
        assert r["second"] == "ok"
        assert r["stepped"] is True
        # The divergence check names both calls (a rank whose later collective found the
        # group closed first says so, with the same cause).
        name, message = r["across_ranks"]
        assert name in (RankDivergenceError.__name__, CommunicationError.__name__)
        assert "ranks diverged" in message
        assert "backward(tensor, tokens=given)" in message and "backward(tensor)" in message
