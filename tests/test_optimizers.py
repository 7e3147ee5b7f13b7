"""Any torch optimizer, and parameter groups in torch's format, on real ranks == plain
single-process torch with the same optimizers and groups (``optim_cases``).

One rank run per world size trains every case in turn (module fixtures); each test
checks the numbers of its case. Element-wise optimizers run on the flat shards, the
shape-aware ones (Adafactor, Muon) on whole parameters at their owners; refused ones
name the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from helpers import run_named
from hf_models import build, guarded, unwrap
from optim_cases import (
    KIND,
    OptimCase,
    chain_reference,
    hidden_matrices,
    loss_diff,
    max_diff,
    plain_train,
    refusal,
    train_case,
    train_chain,
)

from zero3_offload import decay_param_groups
from zero3_offload.optimizer_state.decay_groups import decay_parameter_names

pytestmark = pytest.mark.slow

MICRO = 4  # two optimizer steps (accumulation 2)
CHAIN_STEPS = 4
MUON = {"groups": "muon", "micro_steps": MICRO}
# name: (case, parameter tolerance). Muon orthogonalises in bf16 (torch's own kernel), so
# the last-bit differences of a gradient mean over ranks move its update by a few percent
# of a step; plain torch Muon moves as much when its gradients change by 1e-7 relative
# (test_muon_is_as_sensitive_in_plain_torch).
TABLE: dict[str, tuple[OptimCase, float]] = {
    "Adam": (OptimCase("torch.optim.Adam", {"weight_decay": 0.01}, micro_steps=MICRO), 1e-4),
    "AdamW": (OptimCase("torch.optim.AdamW", {"weight_decay": 0.01}, micro_steps=MICRO), 1e-4),
    "SGD-momentum": (
        OptimCase("torch.optim.SGD", {"momentum": 0.9}, micro_steps=MICRO, lr=0.1),
        1e-4,
    ),
    "SGD-nesterov": (
        OptimCase(
            "torch.optim.SGD", {"momentum": 0.9, "nesterov": True}, micro_steps=MICRO, lr=0.1
        ),
        1e-4,
    ),
    "RMSprop": (OptimCase("torch.optim.RMSprop", {"alpha": 0.9}, micro_steps=MICRO), 1e-4),
    "Adagrad": (OptimCase("torch.optim.Adagrad", micro_steps=MICRO), 1e-4),
    "Adamax": (OptimCase("torch.optim.Adamax", micro_steps=MICRO), 1e-4),
    "NAdam": (OptimCase("torch.optim.NAdam", micro_steps=MICRO), 1e-4),
    "RAdam": (OptimCase("torch.optim.RAdam", micro_steps=MICRO, lr=1e-2), 1e-4),
    "Adadelta": (OptimCase("torch.optim.Adadelta", micro_steps=MICRO, lr=1.0), 1e-4),
    "Adafactor": (OptimCase("torch.optim.Adafactor", micro_steps=MICRO, lr=1e-2), 1e-4),
    "Muon+AdamW": (OptimCase(**MUON), 1e-4),
}
GROUPS: dict[str, tuple[OptimCase, float]] = {
    "hf-decay-split": (OptimCase(groups="decay", micro_steps=MICRO), 1e-4),
    "lora-plus": (OptimCase(groups="lora_plus", micro_steps=MICRO), 1e-4),
    "sgd-and-adamw-in-one-unit": (OptimCase(groups="mixed", micro_steps=MICRO), 1e-4),
    # Every tier on the device (here the CPU): masters and state not offloaded.
    "muon-not-offloaded": (
        OptimCase(
            **MUON,
            config={
                "offload_params": False,
                "offload_grads": False,
                "offload_optimizer_states": False,
            },
        ),
        1e-4,
    ),
}
REFUSED: dict[str, tuple[OptimCase, tuple[str, ...]]] = {
    "LBFGS": (OptimCase("torch.optim.LBFGS"), ("ConfigError", "LBFGS", "closure")),
    "SparseAdam": (OptimCase("torch.optim.SparseAdam"), ("ConfigError", "sparse gradients")),
    "not element-wise": (
        OptimCase("helpers.NormalizedSGD"),
        ("ConfigError", "NormalizedSGD", "not element-wise"),
    ),
    "Muon on a vector": (
        OptimCase("torch.optim.Muon"),
        ("ConfigError", "model.norm.weight", "Muon", "2D"),
    ),
    "NAdam scalars of one unit differ": (
        OptimCase("torch.optim.NAdam", groups="nadam-conflict"),
        ("ConfigError", "mu_product", "param_groups[0]", "the default group"),
    ),
    "Muon on the disk tier": (
        OptimCase(**MUON, config={"offload_optimizer_device": "nvme", "nvme_path": "/nonexistent"}),
        ("ConfigError", "nvme", "torch.optim.Muon"),
    ),
}


def _calls(extra: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
    cases = {**TABLE, **GROUPS}
    return {**{name: (guarded, train_case, c) for name, (c, _) in cases.items()}, **extra}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("optimizer-checkpoints") / "muon"


def _resume(saved: Path) -> OptimCase:
    return OptimCase(groups="muon", first_micro=MICRO, micro_steps=MICRO, load_dir=str(saved))


def _on_disk(root: Path) -> OptimCase:
    """HF's decay split with the masters and state in the disk tier's files."""
    root.mkdir(parents=True, exist_ok=True)
    config = {"offload_optimizer_device": "nvme", "nvme_path": str(root)}
    return OptimCase(groups="decay", micro_steps=MICRO, config=config)


@pytest.fixture(scope="module")
def runs2(saved: Path) -> dict[str, list[Any]]:
    extra: dict[str, tuple[Any, ...]] = {
        f"refused:{name}": (refusal, case) for name, (case, _) in REFUSED.items()
    }
    extra["save"] = (guarded, train_case, OptimCase(**MUON, save_dir=str(saved)))
    extra["decay-on-disk"] = (guarded, train_case, _on_disk(saved.parent / "nvme"))
    extra["chain"] = (guarded, train_chain, CHAIN_STEPS, 8)
    extra["resume"] = (guarded, train_case, _resume(saved))
    return run_named(2, _calls(extra))


@pytest.fixture(scope="module")
def runs3(runs2: dict[str, list[Any]], saved: Path) -> dict[str, list[Any]]:
    # The optimizer table and the checkpoint's reshard; the groups run at 2 ranks.
    calls = {name: (guarded, train_case, case) for name, (case, _) in TABLE.items()}
    calls["resume"] = (guarded, train_case, _resume(saved))
    return run_named(3, calls)


@pytest.fixture
def runs(request: pytest.FixtureRequest, world: int) -> dict[str, list[Any]]:
    return request.getfixturevalue(f"runs{world}")


_PLAIN: dict[str, dict[str, Any]] = {}


def plain(case: OptimCase) -> dict[str, Any]:
    """``plain_train(case)``, once per case (both world sizes compare against it)."""
    key = repr(case)
    if key not in _PLAIN:
        _PLAIN[key] = plain_train(case)
    return _PLAIN[key]


def assert_trains_like_torch(results: list[dict[str, Any]], case: OptimCase, tol: float) -> None:
    ref = plain(case)
    assert loss_diff(results[0]["losses"], ref["losses"][case.first_micro :]) < 1e-5
    for r in results:
        assert max_diff(r["state"], ref["state"]) < tol
        # The state's bytes are the construction-time figure (checked against the budget).
        assert r["state_bytes"] == r["need_state_bytes"]
    # The parameters really moved, so the comparison is not trivially met.
    start = {n: p.detach() for n, p in build(KIND).named_parameters()}
    assert max_diff(ref["state"], start) > 5 * tol


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(TABLE))
def test_torch_optimizer_trains_like_plain_torch(
    runs: dict[str, list[Any]], name: str, world: int
) -> None:
    case, tol = TABLE[name]
    assert_trains_like_torch([unwrap(r) for r in runs[name]], case, tol)


@pytest.mark.parametrize("name", list(GROUPS))
def test_parameter_groups_train_like_plain_torch(runs2: dict[str, list[Any]], name: str) -> None:
    case, tol = GROUPS[name]
    assert_trains_like_torch([unwrap(r) for r in runs2[name]], case, tol)


def test_parameter_groups_on_the_disk_tier(runs2: dict[str, list[Any]], saved: Path) -> None:
    # Segmented shards whose state the disk tier streams through its buffers.
    results = [unwrap(r) for r in runs2["decay-on-disk"]]
    assert_trains_like_torch(results, _on_disk(saved.parent / "nvme"), 1e-4)


@pytest.mark.parametrize("name", list(REFUSED))
def test_optimizer_that_cannot_run_on_shards_is_refused_with_the_reason(
    runs2: dict[str, list[Any]], name: str
) -> None:
    _, words = REFUSED[name]
    for message in runs2[f"refused:{name}"]:
        assert all(w in message for w in words), message


@pytest.mark.parametrize("world", [2, 3])
def test_muon_checkpoint_resumes_at_any_world_size(runs: dict[str, list[Any]], world: int) -> None:
    # Saved at 2 ranks after two steps; the whole parameters' state lives in the owners'
    # files, and the owners differ at 3 ranks.
    resumed = [unwrap(r) for r in runs["resume"]]
    assert_trains_like_torch(resumed, OptimCase(**MUON, first_micro=MICRO), 1e-4)


def test_early_and_speculative_updates_with_whole_parameters(
    runs2: dict[str, list[Any]],
) -> None:
    # Chain mode, updates started during backward (speculatively, clipping at 0.5): the
    # units without Muon matrices (embedding, final norm, head) start early and are
    # redone when clipping fires; the blocks, which hold Muon matrices, wait for
    # optimizer_step.
    results = [unwrap(r) for r in runs2["chain"]]
    ref = chain_reference(CHAIN_STEPS, 8)
    losses = [sum(r["losses"][i] for r in results) / 2 for i in range(CHAIN_STEPS)]
    assert loss_diff(losses, ref["losses"]) < 1e-5
    assert max_diff(results[0]["state"], ref["state"]) < 1e-4
    assert results[0]["rollbacks"] > 0


def test_muon_is_as_sensitive_in_plain_torch() -> None:
    """The Muon tolerance: plain torch Muon moves by about as much when its gradients
    change in their last bits (the orthogonalisation runs in bf16)."""
    import torch
    from hf_models import ACC, CLIP, batch, call_kwargs, loss_of
    from optim_cases import torch_optimizers

    def run(noise: float) -> dict[str, torch.Tensor]:
        case, model = OptimCase(**MUON), build(KIND)
        opts, gen = torch_optimizers(case, model), torch.Generator().manual_seed(5)
        for i in range(case.micro_steps):
            (loss_of(model(**call_kwargs(KIND, batch(i, KIND)))) / ACC).backward()
            if (i + 1) % ACC == 0:
                for p in model.parameters():
                    p.grad.mul_(1 + noise * torch.randn(p.shape, generator=gen))
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
        return {n: p.detach() for n, p in model.named_parameters() if n in hidden}

    hidden = set(hidden_matrices(build(KIND)))
    # A few ulps of fp32 (1e-7 alone rounds to no change on some CPUs' kernels).
    assert max_diff(run(0.0), run(1e-6)) > 1e-5


def test_decay_split_is_hf_trainers() -> None:
    transformers = pytest.importorskip("transformers")
    try:
        transformers.Trainer  # noqa: B018 - its import needs accelerate to match deepspeed
    except ImportError as exc:  # an installed deepspeed newer than accelerate supports
        pytest.skip(f"transformers.Trainer cannot be imported here: {exc}")
    for kind in ("llama", "qwen2", "gpt2"):
        model = build(kind)
        named = dict(model.named_parameters())
        theirs = transformers.Trainer.get_decay_parameter_names(None, model)
        assert decay_parameter_names(model) == [n for n in theirs if n in named]
    model = build("llama")
    decay, no_decay = decay_param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert set(decay["params"]) | set(no_decay["params"]) == set(dict(model.named_parameters()))
    assert "model.norm.weight" in no_decay["params"] and "lm_head.weight" in decay["params"]
