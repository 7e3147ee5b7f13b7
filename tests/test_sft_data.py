"""Supervised fine-tuning data: every source format, the loss masks, the truncation rule,
the example order, and hostile inputs.

The same conversations saved as JSONL, JSON, JSON Lines named .json, Parquet, CSV and
``datasets`` directories (``Dataset`` and ``DatasetDict``) give the same examples.
Masks: every learned token lies inside an assistant turn's rendered content (and its
end-of-turn token), for a template with ``{% generation %}`` markers and one without
(masks found by rendering prefixes; both give the same mask); a template that is not
prefix-stable is refused. Hostile inputs: bad records are named with their file and
line or row, failing by default and counted with ``--bad-records skip``; files that
cannot be read as what their name says, and binary files given as text, are refused
with one line naming the file.
"""

from __future__ import annotations

import csv
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

import torch  # noqa: E402
from chat_data import (  # noqa: E402
    MARKED,
    UNMARKED,
    UNSTABLE,
    VOCAB,
    chat_tokenizer,
    conversations,
    write_jsonl,
)

from zero3_offload.data.bad_records import BadRecords  # noqa: E402
from zero3_offload.data.chat_render import Renderer  # noqa: E402
from zero3_offload.data.example import Example  # noqa: E402
from zero3_offload.data.example_loader import load_examples  # noqa: E402
from zero3_offload.data.order import ExampleOrder  # noqa: E402
from zero3_offload.data.sft_data import SftData  # noqa: E402
from zero3_offload.data.source import find_source  # noqa: E402
from zero3_offload.data.token_dataset import IGNORED, TokenDataset  # noqa: E402
from zero3_offload.errors import ConfigError, InputError  # noqa: E402
from zero3_offload.train.corpus import ByteCorpus  # noqa: E402

CONVERSATIONS = conversations(12, seed=4)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chat_tokenizer(MARKED)


def examples(path: Path, policy: str = "fail", **kw: Any) -> tuple[list[Example], BadRecords]:
    bad = BadRecords(policy)
    fields = {"data_format": "auto", "data_field": None, **kw}
    return load_examples(find_source(path), bad=bad, **fields), bad


# ------------------------------------------------------------------------- source formats


def write_all_formats(root: Path) -> dict[str, Path]:
    records = [{"messages": c, "id": i} for i, c in enumerate(CONVERSATIONS)]
    out = {"jsonl": write_jsonl(root / "a.jsonl", records)}
    out["json"] = root / "a.json"
    out["json"].write_text(json.dumps(records))
    out["json-lines"] = root / "lines.json"
    datasets.Dataset.from_list(records).to_json(out["json-lines"])  # JSON Lines
    out["parquet"] = root / "a.parquet"
    pq.write_table(pa.Table.from_pylist(records), out["parquet"])
    out["csv"] = root / "a.csv"
    with out["csv"].open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "messages"])
        for r in records:
            writer.writerow([r["id"], json.dumps(r["messages"])])
    out["dataset"] = root / "dataset"
    datasets.Dataset.from_list(records).save_to_disk(out["dataset"])
    out["dataset-dict"] = root / "dataset_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(
        out["dataset-dict"]
    )
    folder = root / "folder"
    folder.mkdir()
    write_jsonl(folder / "1.jsonl", records[:5])
    write_jsonl(folder / "2.jsonl", records[5:])
    out["folder"] = folder
    return out


def test_every_source_format_gives_the_same_examples(tmp_path: Path) -> None:
    expected = [tuple(c) for c in CONVERSATIONS]
    for name, path in write_all_formats(tmp_path).items():
        got, bad = examples(path)
        assert [e.messages for e in got] == expected, name
        assert bad.skipped == 0
        assert all(e.shape == "messages" for e in got)


def test_shapes_detected_and_named_fields(tmp_path: Path) -> None:
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello fox"}, {"text": "dog says"}])
    assert [e.text for e in examples(text)[0]] == ["hello fox", "dog says"]
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"question": "what is one", "answer": "one"}])
    with pytest.raises(InputError, match=r"p\.jsonl:1: no recognisable shape.*'question'"):
        examples(pairs)
    (got,) = examples(pairs, data_field="prompt=question,completion=answer")[0]
    assert (got.prompt, got.completion, got.shape) == ("what is one", "one", "prompt")
    share = [
        {"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "x"}]}
    ]
    path = write_jsonl(tmp_path / "s.jsonl", share)
    (got,) = examples(path, data_field="messages=conversations,role=from,content=value")[0]
    assert got.messages == (
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x"},
    )
    with pytest.raises(InputError, match="--data-field"):
        examples(path, data_field="speaker=from")


# ----------------------------------------------------------------------------------- masks


def learned_text(tok: Any, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded spans of learned tokens."""
    spans, current = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            current.append(i)
        elif current:
            spans.append(tok.decode(current))
            current = []
    if current:
        spans.append(tok.decode(current))
    return spans


@pytest.mark.parametrize("template", ["marked", "unmarked"])
def test_every_learned_token_belongs_to_an_assistant_turn(template: str) -> None:
    tok = chat_tokenizer(MARKED if template == "marked" else UNMARKED)
    renderer = Renderer(tok, "assistant")
    for i, conversation in enumerate(CONVERSATIONS):
        ids, mask = renderer.render(Example(f"x:{i}", messages=tuple(conversation)))
        assert ids == tok.apply_chat_template(conversation, tokenize=True)["input_ids"]
        answers = [m["content"] + "<|end|>" for m in conversation if m["role"] == "assistant"]
        # Every learned span is exactly one assistant turn, in order, and nothing else.
        assert learned_text(tok, ids, mask) == answers
        user = sum(len(m["content"]) for m in conversation if m["role"] != "assistant")
        assert user > 0 and sum(mask) < len(ids)


def test_marked_and_prefix_masks_agree_and_completion_and_all() -> None:
    marked, unmarked = Renderer(chat_tokenizer(MARKED), "assistant"), None
    unmarked = Renderer(chat_tokenizer(UNMARKED), "assistant")
    two_turns = next(c for c in CONVERSATIONS if sum(m["role"] == "assistant" for m in c) == 2)
    example = Example("x:1", messages=tuple(two_turns))
    assert marked.render(example)[1] == unmarked.render(example)[1]
    tok = chat_tokenizer(MARKED)
    ids, last = Renderer(tok, "completion").render(example)
    assert learned_text(tok, ids, last) == [two_turns[-1]["content"] + "<|end|>"]
    _, every = Renderer(tok, "all").render(example)
    assert every == [1] * len(ids)
    prompt = Example("x:2", prompt="what is one plus one", completion=" two")
    ids, mask = Renderer(tok, "assistant").render(prompt)
    assert learned_text(tok, ids, mask) == [" two</s>"]


def test_a_template_that_is_not_prefix_stable_is_refused() -> None:
    renderer = Renderer(chat_tokenizer(UNSTABLE), "assistant")
    with pytest.raises(ConfigError, match=r"x:3: .*not prefix-stable.*generation"):
        renderer.render(Example("x:3", messages=tuple(CONVERSATIONS[0])))
    # Without masks to find, the same template renders.
    ids, mask = Renderer(chat_tokenizer(UNSTABLE), "all").render(
        Example("x:3", messages=tuple(CONVERSATIONS[0]))
    )
    assert len(ids) == len(mask) > 0


def test_conversations_need_a_chat_template(tmp_path: Path) -> None:
    tok = chat_tokenizer(MARKED)
    tok.chat_template = None
    with pytest.raises(ConfigError, match="x:1: a conversation, but the tokenizer has no chat"):
        Renderer(tok, "assistant").render(Example("x:1", messages=tuple(CONVERSATIONS[0])))


def test_truncation_rule(tokenizer: Any) -> None:
    renderer = Renderer(tokenizer, "assistant")
    long_prompt = Example("x:1", prompt="what is one plus one " * 20, completion=" two")
    long_answer = Example("x:2", prompt="what is", completion=" one plus one" * 20)
    fits = Example("x:3", prompt="what is", completion=" two")
    data = TokenDataset.build(
        [long_prompt, long_answer, fits], renderer, max_len=16, vocab=VOCAB, bad=BadRecords("fail")
    )
    assert (len(data), data.truncated, data.dropped) == (2, 1, 0 + 1)
    assert [x.numel() for x in data.ids] == [16, len(renderer.render(fits)[0])]
    for y in data.labels:
        assert y[0] == IGNORED  # the first token is never a target


# ----------------------------------------------------------------------------------- order


def test_order_depends_on_seed_epoch_and_position_only() -> None:
    a, b = ExampleOrder(10, seed=3), ExampleOrder(10, seed=3)
    first = [a.example(p) for p in range(30)]
    assert first == [b.example(p) for p in reversed(range(30))][::-1]
    assert sorted(first[:10]) == sorted(first[10:20]) == list(range(10))  # epochs
    assert first[:10] != first[10:20]
    assert first != [ExampleOrder(10, seed=4).example(p) for p in range(30)]
    # The same global batch and micro-step split at 2 x 3 and 3 x 2 ranks.
    for micro in (0, 1):
        two = [
            p
            for r in range(2)
            for p in a.micro_batch(24, micro=micro, rank=r, world_size=2, batch_size=3)
        ]
        three = [
            p
            for r in range(3)
            for p in a.micro_batch(24, micro=micro, rank=r, world_size=3, batch_size=2)
        ]
        assert two == three == list(range(24 + 6 * micro, 30 + 6 * micro))


def test_unpacked_batches_pad_to_the_longest_example(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in conversations(40)])
    data = SftData.load(path, tokenizer=tokenizer, vocab=VOCAB, max_len=128, seed=0)
    batch = data.train_batch(0, micro=0, rank=0, world_size=1, batch_size=4)
    order = [data.order.example(p) for p in range(4)]
    assert batch.input_ids.shape == (4, max(data.train.ids[i].numel() for i in order))
    assert batch.input_ids.shape[1] < 128
    assert batch.real_tokens == sum(data.train.ids[i].numel() for i in order)
    packed = SftData.load(path, tokenizer=tokenizer, vocab=VOCAB, max_len=128, seed=0, pack=True)
    rows = packed.train_batch(0, micro=0, rank=0, world_size=1, batch_size=4)
    assert rows.input_ids.shape[0] < 4 and rows.input_ids.shape[1] <= 128
    assert rows.real_tokens == batch.real_tokens
    assert rows.padding_tokens < batch.padding_tokens
    assert rows.valid_tokens == batch.valid_tokens
    learned = [b.labels[b.labels != IGNORED].sort().values for b in (rows, batch)]
    assert torch.equal(*learned)


# --------------------------------------------------------------------------------- hostile


def test_bad_records_are_named_and_the_policy_decides(tmp_path: Path) -> None:
    good = {"messages": CONVERSATIONS[0]}
    lines = [
        json.dumps(good),
        '{"messages": [{"role": "user", "content": "hi"}',  # line 2: not JSON
        json.dumps({"messages": []}),  # 3: empty conversation
        json.dumps({"messages": [{"role": "user"}]}),  # 4: no content
        json.dumps({"messages": "hello"}),  # 5: a string, not a list
        json.dumps({"other": 1}),  # 6: the field is missing
        json.dumps([1, 2]),  # 7: not an object
        "",
        json.dumps(good),  # 9
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"bad\.jsonl:2: not JSON .*--bad-records skip"):
        examples(path)
    got, bad = examples(path, policy="skip")
    assert [e.where for e in got] == [f"{path}:1", f"{path}:9"]
    assert bad.skipped == 6 and bad.first is not None and bad.first.startswith(f"{path}:2:")
    reasons = {}
    for number in (3, 4, 5, 6, 7):
        one = tmp_path / f"one{number}.jsonl"
        one.write_text(json.dumps(good) + "\n" + lines[number - 1] + "\n")
        with pytest.raises(InputError) as err:
            examples(one)
        assert str(err.value).startswith(f"{one}:2: ")
        reasons[number] = str(err.value)
    assert "empty conversation" in reasons[3] and "'content'" in reasons[4]
    assert "not a JSON list" in reasons[5] and "'messages' is missing" in reasons[6]
    assert "not an object" in reasons[7]
    # Rows of Parquet and CSV are named too.
    table = pa.Table.from_pylist([{"text": "hello"}, {"text": None}, {"text": "dog"}])
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(InputError, match=r"t\.parquet row 2: field 'text' is missing"):
        examples(tmp_path / "t.parquet")
    (tmp_path / "t.csv").write_text("prompt,completion\nwhat is,one\nhello,\n")
    with pytest.raises(InputError, match=r"t\.csv:3: field 'completion' is empty"):
        examples(tmp_path / "t.csv")


def test_an_assistant_less_conversation_is_a_bad_record(tmp_path: Path, tokenizer: Any) -> None:
    records = [{"messages": c} for c in CONVERSATIONS] + [
        {"messages": [{"role": "user", "content": "hello"}]}
    ]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(InputError, match=r"c\.jsonl:13: no assistant message"):
        SftData.load(path, tokenizer=tokenizer, vocab=VOCAB, max_len=64, seed=0, eval_fraction=0.1)
    with pytest.raises(InputError, match=r"no eval example of .*c\.jsonl left .*1 bad record"):
        SftData.load(path, tokenizer=tokenizer, vocab=VOCAB, max_len=64, seed=0, bad_records="skip")
    data = SftData.load(
        path,
        tokenizer=tokenizer,
        vocab=VOCAB,
        max_len=64,
        seed=0,
        bad_records="skip",
        eval_fraction=0.2,
    )
    assert data.eval.skipped == 1 and (len(data.train), len(data.eval)) == (11, 1)


def test_files_that_are_not_what_they_say_are_refused(tmp_path: Path) -> None:
    rng = random.Random(0)
    binary = bytes(rng.randrange(256) for _ in range(4096))
    table = pa.Table.from_pylist([{"text": "hello fox"}])
    pq.write_table(table, tmp_path / "data.parquet")
    parquet_bytes = (tmp_path / "data.parquet").read_bytes()
    cases = {
        "parquet.txt": (parquet_bytes, r"parquet\.txt: not text: it is a Parquet file"),
        "blob.bin": (binary, r"blob\.bin: not (UTF-8 )?text"),
        "latin1.txt": ("caf\xe9 au lait\n".encode("latin-1") * 10, r"latin1\.txt: not UTF-8 text"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(InputError, match=message):
            ByteCorpus.load(data=tmp_path / name, max_bytes=10**6)
    # A directory of text with one binary file among them names that file.
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("hello fox\n" * 50)
    (folder / "b.dat").write_bytes(parquet_bytes)
    with pytest.raises(InputError, match=r"b\.dat: not text"):
        ByteCorpus.load(data=folder, max_bytes=10**6)
    records = {
        "binary.jsonl": (binary, r"binary\.jsonl: not (UTF-8 )?text"),
        "fake.parquet": (b'{"text": "hello"}\n', r"fake\.parquet: not a readable Parquet file"),
        "parquet.jsonl": (parquet_bytes, r"parquet\.jsonl: not text: it is a Parquet file"),
        "scalar.json": (b"42", r"scalar\.json: holds a JSON int, not an array"),
        "broken.json": (b'[{"text": "a"},', r"broken\.json: not JSON"),
        "shape.json": (b'[{"body": "a"}]', r"shape\.json row 1: no recognisable shape"),
        "shape.csv": (b"a,b\n1,2\n", r"shape\.csv:2: no recognisable shape: its fields"),
    }
    for name, (data, message) in records.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(InputError, match=message):
            examples(tmp_path / name)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", [{"text": "hello"}])
    (mixed / "b.txt").write_text("hello")
    with pytest.raises(InputError, match="mixes record files"):
        find_source(mixed)
    shapeless = tmp_path / "shapeless"
    datasets.Dataset.from_list([{"body": "hello"}]).save_to_disk(shapeless)
    with pytest.raises(InputError, match=r"shapeless row 1: no recognisable shape"):
        examples(shapeless)
    two_splits = tmp_path / "splits"
    one = datasets.Dataset.from_list([{"text": "hello"}])
    datasets.DatasetDict({"a": one, "b": one}).save_to_disk(two_splits)
    with pytest.raises(InputError, match="no 'train' split"):
        examples(two_splits)
    assert not os.access(tmp_path / "missing.jsonl", os.F_OK)
    with pytest.raises(InputError, match="no such file"):
        find_source(tmp_path / "missing.jsonl")
