"""Supervised fine-tuning on real ranks == plain single-process training.

A tiny chat Llama (hidden 32, 2 layers) is trained on chat conversations with the
loss on assistant tokens only, through the pieces ``zero3-offload train`` runs on
examples (``SftData``, ``SftSteps``), AdamW, clipping 1.0, accumulation 2, a global
batch of 12 examples per step (6 per micro-step: 6 x 1, 3 x 2 or 2 x 3 ranks) over 31
examples, so the run crosses epochs. Checked:

* the global token-mean loss of every step and the parameters after 5 steps equal
  plain training on the same micro-batches at 1, 2 and 3 ranks;
* packed rows (``--pack``) give the same losses (1e-5) and parameters (1e-4) as
  padded ones at 2 ranks, and each example's logits in a packed row equal the
  example run alone (sdpa and eager attention): no attention crosses examples;
* a run interrupted after 2 steps and resumed from its checkpoint (the data position
  in ``training_state``) sees the same examples and ends bitwise equal at 2 ranks,
  and within 1e-5 resumed at 3 ranks.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import transformers
from chat_data import conversations, tiny_llama_config, write_jsonl
from helpers import run_named
from hf_models import max_diff
from sft_ranks import SftSpec, load_data, plain_sft, sft_train, write_model_dir

STEPS = 5
SAVE_AT = 2
BATCH = {1: 6, 2: 3, 3: 2}  # examples per rank per micro-step: 6 per micro-step at any size


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sft")
    data = write_jsonl(root / "chat.jsonl", [{"messages": c} for c in conversations(32)])
    return {"model": str(write_model_dir(root)), "data": str(data), "root": str(root)}


def spec(files: dict[str, str], world: int, **kw: Any) -> SftSpec:
    fields: dict[str, Any] = {"steps": STEPS, "batch_size": BATCH[world], **kw}
    return SftSpec(model_dir=files["model"], data=files["data"], **fields)


@pytest.fixture(scope="module")
def runs(files: dict[str, str]) -> dict[str, list[Any]]:
    ckpt = str(Path(files["root"]) / "ckpt")
    out: dict[str, list[Any]] = {}
    out.update(run_named(1, {"w1": (sft_train, spec(files, 1))}))
    out.update(
        run_named(
            2,
            {
                "w2": (sft_train, spec(files, 2)),
                "w2-packed": (sft_train, spec(files, 2, pack=True)),
                "w2-first": (sft_train, spec(files, 2, steps=SAVE_AT, save_dir=ckpt)),
                "w2-resumed": (sft_train, spec(files, 2, steps=STEPS - SAVE_AT, load_dir=ckpt)),
            },
        )
    )
    out.update(
        run_named(
            3,
            {
                "w3": (sft_train, spec(files, 3)),
                "w3-resumed": (sft_train, spec(files, 3, steps=STEPS - SAVE_AT, load_dir=ckpt)),
            },
        )
    )
    return out


@functools.cache
def _plain(model: str, data: str, world: int) -> dict[str, Any]:
    files = {"model": model, "data": data}
    return plain_sft(spec(files, world), world)


def plain(files: dict[str, str], world: int) -> dict[str, Any]:
    return _plain(files["model"], files["data"], world)


def _seen(run: list[dict[str, Any]]) -> list[list[int]]:
    """The examples of each step over all ranks, sorted."""
    return [sorted(i for r in run for i in r["seen"][s]) for s in range(len(run[0]["seen"]))]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_token_mean_equals_plain_training(runs: dict, files: dict, world: int) -> None:
    ref = plain(files, world)
    result = runs[f"w{world}"][0]
    assert max(abs(a - b) for a, b in zip(result["losses"], ref["losses"], strict=True)) < 1e-5
    assert max_diff(result["state"], ref["state"]) < 1e-4
    # Training changed the parameters far beyond the tolerance (the check can fail).
    assert max_diff(ref["state"], dict(plain_sft_initial())) > 1e-3


def plain_sft_initial() -> dict[str, torch.Tensor]:
    from sft_ranks import build_model

    return {n: p.detach().clone() for n, p in build_model().named_parameters()}


@pytest.mark.slow
def test_every_world_size_sees_the_same_examples(runs: dict) -> None:
    assert _seen(runs["w1"]) == _seen(runs["w2"]) == _seen(runs["w3"])
    # 5 steps of 12 examples over 31: the second and third epochs are reached.
    assert runs["w2"][0]["position"] == STEPS * 12


@pytest.mark.slow
def test_packed_equals_unpacked(runs: dict) -> None:
    padded, packed = runs["w2"][0], runs["w2-packed"][0]
    assert max(abs(a - b) for a, b in zip(padded["losses"], packed["losses"], strict=True)) < 1e-5
    assert max_diff(padded["state"], packed["state"]) < 1e-4
    assert _seen(runs["w2"]) == _seen(runs["w2-packed"])
    # Packing removed padding: the same tokens in fewer padded positions.
    assert sum(packed["padding"]) < sum(padded["padding"])


@pytest.mark.slow
def test_resume_sees_the_same_examples_and_ends_equal(runs: dict) -> None:
    full = runs["w2"][0]
    resumed2, resumed3 = runs["w2-resumed"][0], runs["w3-resumed"][0]
    assert resumed2["position"] == resumed3["position"] == full["position"]
    assert _seen(runs["w2-first"]) + _seen(runs["w2-resumed"]) == _seen(runs["w2"])
    assert _seen(runs["w3-resumed"]) == _seen(runs["w2"])[SAVE_AT:]
    for name in full["state"]:
        assert torch.equal(resumed2["state"][name], full["state"][name]), name
    assert resumed2["losses"] == full["losses"][SAVE_AT:]
    assert max_diff(resumed3["state"], full["state"]) < 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_no_attention_crosses_examples_in_a_packed_row(files: dict, attention: str) -> None:
    data = load_data(files["model"], files["data"], pack=True, max_len=96)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(attn_implementation=attention))
    model.eval()
    batch = data.train_batch(0, micro=0, rank=0, world_size=1, batch_size=8)
    assert batch.input_ids.shape[0] < 8  # rows hold several examples
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.model_kwargs().items() if k != "labels"}).logits
        compared = 0
        for row in range(batch.input_ids.shape[0]):
            pos = batch.position_ids[row]
            starts = [i for i in range(len(pos)) if pos[i] == 0]
            for start, end in zip(starts, [*starts[1:], len(pos)], strict=True):
                ids = batch.input_ids[row, start:end]
                if (ids == data.pad_id).all():
                    continue  # the row's padding
                alone = model(input_ids=ids[None], use_cache=False).logits[0]
                assert (packed[row, start:end] - alone).abs().max() < 1e-5
                compared += 1
        assert compared == 8
        # Control: the same rows without position_ids attend across examples.
        plain_rows = model(input_ids=batch.input_ids, use_cache=False).logits
        assert (plain_rows - packed).abs().max() > 1e-3
