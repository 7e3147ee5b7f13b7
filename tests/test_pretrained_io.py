"""Pretrained-model I/O with transformers: reading weight ranges, streamed writes, meta builds."""

from __future__ import annotations

import ast
import gc
import json
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from zero3_offload.errors import CheckpointError, ConfigError, InputError, StateError
from zero3_offload.integrations import pretrained_weights
from zero3_offload.integrations.meta_model import build_model_from_directory, parameters_on_meta
from zero3_offload.integrations.pretrained_weights import PretrainedWeights
from zero3_offload.integrations.pretrained_writer import write_pretrained
from zero3_offload.integrations.require import require_transformers

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def llama_config() -> transformers.PretrainedConfig:
    from hf_models import TINY_DECODER

    return transformers.LlamaConfig(**TINY_DECODER)


def gpt2_config() -> transformers.PretrainedConfig:
    # bos/eos inside the tiny vocabulary keep transformers from warning about them
    return transformers.GPT2Config(
        vocab_size=97,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )


CONFIGS = {"llama": llama_config, "gpt2": gpt2_config}


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    out = {}
    for kind, make_config in CONFIGS.items():
        torch.manual_seed(0)
        out[kind] = transformers.AutoModelForCausalLM.from_config(make_config()).eval()
    return out


@pytest.fixture(scope="module")
def saved(models: dict[str, nn.Module], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directories written by transformers' own ``save_pretrained``: ``<kind>`` with one
    file, ``<kind>-sharded`` with an index and several shards."""
    root = tmp_path_factory.mktemp("saved")
    for kind, model in models.items():
        model.save_pretrained(root / kind)
        model.save_pretrained(root / f"{kind}-sharded", max_shard_size="20KB")
    return root


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) * 7 % 89
    with torch.no_grad():
        return model(input_ids=ids).logits


# --- PretrainedWeights ------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["llama", "llama-sharded", "gpt2", "gpt2-sharded"])
def test_reads_every_parameter_fully_and_in_ranges(layout, models, saved):
    model = models[layout.split("-")[0]]
    if layout.endswith("sharded"):
        assert len(list((saved / layout).glob("model-*-of-*.safetensors"))) > 1
        assert not (saved / layout / "model.safetensors").exists()
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    with PretrainedWeights(saved / layout) as weights:
        # transformers saves a tied parameter once, under its named_parameters() name
        assert weights.names() == sorted(params)
        for name, param in params.items():
            assert name in weights
            assert weights.shape(name) == tuple(param.shape)
            assert weights.dtype(name) == torch.float32
            flat = param.detach().reshape(-1)
            assert torch.equal(weights.read_flat(name, 0, flat.numel()), flat)
            for _ in range(4):
                start, end = sorted(
                    torch.randint(0, flat.numel() + 1, (2,), generator=gen).tolist()
                )
                got = weights.read_flat(name, start, end)
                assert got.dtype == torch.float32 and got.is_contiguous()
                assert torch.equal(got, flat[start:end])
        assert "no.such.weight" not in weights


@pytest.mark.parametrize("read_elements", [None, 3], ids=["default-reads", "3-element-reads"])
def test_reads_ranges_of_every_shape(tmp_path, monkeypatch, read_elements):
    if read_elements is not None:  # whole rows read a few elements at a time
        monkeypatch.setattr(pretrained_weights, "READ_ELEMENTS", read_elements)
    gen = torch.Generator().manual_seed(2)
    tensors = {
        "scalar": torch.tensor(2.5),
        "vector": torch.randn(7, generator=gen),
        "matrix": torch.randn(3, 5, generator=gen),
        "cube": torch.randn(2, 3, 4, generator=gen),
        "four": torch.randn(2, 3, 4, 5, generator=gen),
        "bf16": torch.randn(4, 6, generator=gen).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "ints": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with PretrainedWeights(tmp_path) as weights:
        assert weights.dtype("bf16") == torch.bfloat16 and weights.shape("scalar") == ()
        for name, tensor in tensors.items():
            flat = tensor.reshape(-1).to(torch.float32)
            n = flat.numel()
            pairs = [(s, e) for s in range(n + 1) for e in range(s, n + 1)]
            if n > 30:  # every pair is ~7000 reads: a seeded sample of them
                picks = torch.randperm(len(pairs), generator=gen)[:300].tolist()
                pairs = [pairs[i] for i in picks]
            for start, end in pairs:
                got = weights.read_flat(name, start, end)
                assert got.dtype == torch.float32, name
                assert torch.equal(got, flat[start:end]), (name, start, end)
                # Into a view of a larger buffer: that view is written, nothing around it.
                into = torch.full((end - start + 2,), 7.0)
                view = into[1:-1]
                assert weights.read_flat(name, start, end, out=view) is view
                assert torch.equal(view, flat[start:end]), (name, start, end)
                assert into[0] == 7.0 and into[-1] == 7.0
        with pytest.raises(StateError, match="read_flat writes 4 float32 elements"):
            weights.read_flat("matrix", 0, 4, out=torch.empty(5))


def test_small_range_of_a_large_tensor_reads_only_that_range(tmp_path):
    rows, cols = 4096, 4096  # 32 MiB in bf16, 64 MiB once converted to float32

    def value(flat_index: torch.Tensor) -> torch.Tensor:  # small integers: exact in bf16
        return (flat_index // cols % 64 + flat_index % cols % 61 - 60).to(torch.float32)

    row_part = (torch.arange(rows) % 64).to(torch.bfloat16)
    col_part = (torch.arange(cols) % 61 - 60).to(torch.bfloat16)
    big = row_part[:, None] + col_part[None, :]
    small = torch.arange(6.0).reshape(2, 3)
    _one_file(tmp_path / "model.safetensors", big=big, small=small)
    del big
    gc.collect()
    process = psutil.Process()
    with PretrainedWeights(tmp_path) as weights:
        assert torch.equal(weights.read_flat("small", 1, 5), small.reshape(-1)[1:5])  # warm-up
        before = process.memory_info().rss
        for start, end in [(9_000_123, 9_012_345), (cols * 3000 + 5, cols * 3000 + 9)]:
            got = weights.read_flat("big", start, end)
            assert torch.equal(got, value(torch.arange(start, end)))
        grown = process.memory_info().rss - before
    # Reading the whole tensor would map 32 MiB of the file (and allocate 64 MiB); the
    # kernel maps the pages around a read in chunks of up to 2 MiB.
    assert grown < 12 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB"


def _one_file(path: Path, **tensors: torch.Tensor) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})


def _index(directory: Path, weight_map: object) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )


def _hostile(case: str, tmp_path: Path) -> Path:
    """A model directory that is broken or hostile in the way ``case`` says."""
    model = tmp_path / "model"
    model.mkdir()
    outside = tmp_path / "outside.safetensors"
    _one_file(outside, w=torch.ones(2))
    if case == "missing directory":
        return tmp_path / "nowhere"
    if case == "no weights":
        (model / "config.json").write_text("{}")
    elif case == "index not json":
        (model / "model.safetensors.index.json").write_text("{not json")
    elif case == "index deeply nested":
        (model / "model.safetensors.index.json").write_text("[" * 100_000)
    elif case == "weight_map not an object":
        _index(model, ["w"])
    elif case == "file name not a string":
        _index(model, {"w": 3})
    elif case == "absolute path":
        _index(model, {"w": str(outside)})
    elif case == "dot-dot":
        _index(model, {"w": "../outside.safetensors"})
    elif case == "symlink outside":
        (model / "shard.safetensors").symlink_to(outside)
        _index(model, {"w": "shard.safetensors"})
    elif case == "single file symlinked outside":
        (model / "model.safetensors").symlink_to(outside)
    elif case == "name absent from its file":
        _one_file(model / "shard.safetensors", w=torch.ones(2))
        _index(model, {"w": "shard.safetensors", "v": "shard.safetensors"})
    elif case == "missing shard":
        _index(model, {"w": "shard.safetensors"})
    elif case == "shard is a directory":
        (model / "shard.safetensors").mkdir()
        _index(model, {"w": "shard.safetensors"})
    elif case == "truncated file":
        _one_file(model / "model.safetensors", w=torch.ones(64))
        data = (model / "model.safetensors").read_bytes()
        (model / "model.safetensors").write_bytes(data[:-16])
    elif case == "garbage header":
        (model / "model.safetensors").write_bytes(b"\xff" * 64)
    else:
        raise AssertionError(case)
    return model


HOSTILE = [
    "missing directory",
    "no weights",
    "index not json",
    "index deeply nested",
    "weight_map not an object",
    "file name not a string",
    "absolute path",
    "dot-dot",
    "symlink outside",
    "single file symlinked outside",
    "name absent from its file",
    "missing shard",
    "shard is a directory",
    "truncated file",
    "garbage header",
]


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_directories_are_refused(case, tmp_path):
    with pytest.raises(CheckpointError):
        PretrainedWeights(_hostile(case, tmp_path))


def test_symlink_inside_the_directory_is_followed(tmp_path):
    (tmp_path / "real").mkdir()
    _one_file(tmp_path / "real" / "shard.safetensors", w=torch.arange(4.0))
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "real" / "shard.safetensors")
    _index(tmp_path, {"w": "link.safetensors"})
    with PretrainedWeights(tmp_path) as weights:
        assert torch.equal(weights.read_flat("w", 1, 3), torch.tensor([1.0, 2.0]))


def test_bad_reads_are_refused_before_reading(tmp_path):
    _one_file(tmp_path / "model.safetensors", w=torch.ones(3, 4))
    weights = PretrainedWeights(tmp_path)
    for start, end in [(-1, 2), (0, 13), (5, 4), (0.0, 2), (True, 2)]:
        with pytest.raises(CheckpointError, match="'w'"):
            weights.read_flat("w", start, end)
    with pytest.raises(CheckpointError, match="no tensor 'v'"):
        weights.read_flat("v", 0, 1)
    with pytest.raises(CheckpointError):
        weights.shape("v")
    assert weights.read_flat("w", 12, 12).shape == (0,)
    weights.close()
    with pytest.raises(StateError):
        weights.read_flat("w", 0, 1)


# --- write_pretrained -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 20_000])
def test_written_directory_loads_in_transformers(kind, max_shard_bytes, models, saved, tmp_path):
    model = models[kind]
    out = tmp_path / "out"
    files = write_pretrained(
        out, model.config, model.named_parameters(), max_shard_bytes=max_shard_bytes
    )
    names = [f.name for f in files]
    assert all(f.parent == out and f.is_file() for f in files)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    assert "config.json" in names
    assert not list(tmp_path.glob(".out.tmp-*"))
    if max_shard_bytes > 2**20:
        assert names[0] == "model.safetensors" and "model.safetensors.index.json" not in names
    else:
        shards = [n for n in names if n.startswith("model-")]
        assert len(shards) > 1
        assert shards == [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
        ours = json.loads((out / "model.safetensors.index.json").read_text())
        theirs = json.loads(
            (saved / f"{kind}-sharded" / "model.safetensors.index.json").read_text()
        )
        assert ours["metadata"] == theirs["metadata"]
        assert sorted(ours["weight_map"]) == sorted(theirs["weight_map"])
        assert set(ours["weight_map"].values()) == set(shards)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert next(loaded.parameters()).dtype == torch.float32
    torch.testing.assert_close(logits(loaded), logits(model), atol=1e-6, rtol=0)
    if kind == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
    with PretrainedWeights(out) as weights:
        assert weights.names() == sorted(n for n, _ in model.named_parameters())


def test_written_bf16_records_its_dtype(models, tmp_path):
    model = models["llama"]
    write_pretrained(tmp_path / "out", model.config, model.named_parameters(), dtype=torch.bfloat16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.config.dtype != torch.bfloat16  # the caller's config is not changed
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for (name, param), (_, back) in zip(
        model.named_parameters(), loaded.named_parameters(), strict=True
    ):
        assert back.dtype == torch.bfloat16
        assert torch.equal(back, param.detach().to(torch.bfloat16)), name


def test_shards_are_written_while_streaming(tmp_path):
    written_at_each_yield = []

    def stream():
        for i in range(6):
            temps = list(tmp_path.glob(".out.tmp-*"))
            written_at_each_yield.append(len(list(temps[0].iterdir())) if temps else 0)
            yield f"w{i}", torch.full((250,), float(i))  # 1000 bytes: 2 per shard

    files = write_pretrained(tmp_path / "out", gpt2_config(), stream(), max_shard_bytes=2500)
    assert written_at_each_yield == [0, 0, 0, 1, 1, 2]  # a shard is written when full
    assert [f.name for f in files][:3] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with PretrainedWeights(tmp_path / "out") as weights:
        assert torch.equal(weights.read_flat("w5", 0, 250), torch.full((250,), 5.0))


def test_views_and_tied_names_are_written_as_separate_tensors(tmp_path):
    flat = torch.arange(10.0)
    pairs = [("a", flat[:4].view(2, 2)), ("b", flat[4:]), ("c", flat[:4].view(2, 2))]
    write_pretrained(tmp_path / "out", gpt2_config(), iter(pairs))
    with PretrainedWeights(tmp_path / "out") as weights:
        assert weights.shape("a") == (2, 2)
        assert torch.equal(weights.read_flat("b", 0, 6), flat[4:])
        assert torch.equal(weights.read_flat("c", 0, 4), flat[:4])


def test_a_failed_write_leaves_nothing(tmp_path):
    def failing():
        yield "a", torch.ones(300)
        yield "b", torch.ones(300)
        raise RuntimeError("the producer failed")

    with pytest.raises(RuntimeError, match="the producer failed"):
        write_pretrained(tmp_path / "out", gpt2_config(), failing(), max_shard_bytes=1000)
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(InputError, match="given twice"):
        write_pretrained(tmp_path / "out", gpt2_config(), iter([("a", torch.ones(2))] * 2))
    with pytest.raises(InputError, match="meta"):
        write_pretrained(
            tmp_path / "out", gpt2_config(), iter([("a", torch.ones(2, device="meta"))])
        )
    with pytest.raises(InputError, match="nothing"):
        write_pretrained(tmp_path / "out", gpt2_config(), iter([]))
    with pytest.raises(InputError, match="max_shard_bytes"):
        write_pretrained(tmp_path / "out", gpt2_config(), iter([]), max_shard_bytes=0)
    assert list(tmp_path.iterdir()) == []


def test_existing_or_unwritable_targets_are_refused(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        write_pretrained(tmp_path / "full", gpt2_config(), iter([("a", torch.ones(2))]))
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]

    (tmp_path / "empty").mkdir()
    write_pretrained(tmp_path / "empty", gpt2_config(), iter([("a", torch.ones(2))]))
    assert (tmp_path / "empty" / "model.safetensors").is_file()

    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match="a-file"):
        write_pretrained(tmp_path / "a-file" / "out", gpt2_config(), iter([("a", torch.ones(2))]))


# --- meta builds ------------------------------------------------------------------------


def test_parameters_on_meta_keeps_buffers_real_and_restores_registration():
    original = nn.Module.register_parameter
    shared = nn.Parameter(torch.ones(3))
    with parameters_on_meta():
        linear = nn.Linear(3, 4)
        norm = nn.BatchNorm1d(4)
        holder = nn.Module()
        holder.a = shared
        holder.b = shared
        holder.register_parameter("none", None)
    assert nn.Module.register_parameter is original
    assert linear.weight.is_meta and linear.bias.is_meta and type(linear.weight) is nn.Parameter
    assert not norm.running_mean.is_meta and torch.equal(norm.running_var, torch.ones(4))
    assert holder.a.is_meta and holder.a is holder.b and holder.none is None
    assert not shared.is_meta

    with pytest.raises(RuntimeError, match="inside"), parameters_on_meta():
        raise RuntimeError("raised inside")
    assert nn.Module.register_parameter is original
    assert not nn.Linear(2, 2).weight.is_meta


def test_meta_build_of_llama_has_real_rotary_buffers(models, saved):
    meta = build_model_from_directory(saved / "llama", on_meta=True)
    eager = build_model_from_directory(saved / "llama", on_meta=False)
    assert all(p.is_meta for p in meta.parameters())
    assert not any(p.is_meta for p in eager.parameters())
    assert [(n, p.shape, p.dtype) for n, p in meta.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in eager.named_parameters()
    ]
    buffers = dict(meta.named_buffers())
    assert "model.rotary_emb.inv_freq" in buffers
    for name, buffer in eager.named_buffers():
        assert not buffers[name].is_meta, name
        assert torch.equal(buffers[name], buffer), name


def test_meta_build_keeps_gpt2_weights_tied(saved):
    for on_meta in (True, False):
        model = build_model_from_directory(saved / "gpt2", on_meta=on_meta)
        assert model.lm_head.weight is model.transformer.wte.weight
        assert model.lm_head.weight.is_meta == on_meta
        assert "lm_head.weight" not in dict(model.named_parameters())


def test_meta_build_dtype_and_bad_directories(saved, tmp_path):
    meta = build_model_from_directory(saved / "llama", on_meta=True, torch_dtype=torch.bfloat16)
    assert {p.dtype for p in meta.parameters()} == {torch.bfloat16}
    assert meta.model.rotary_emb.inv_freq.dtype == torch.float32
    with pytest.raises(CheckpointError, match=r"config\.json"):
        build_model_from_directory(tmp_path, on_meta=True)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        build_model_from_directory(tmp_path, on_meta=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(CheckpointError):
        build_model_from_directory(tmp_path, on_meta=True)
    with pytest.raises(InputError):
        build_model_from_directory(saved / "llama", on_meta=True, torch_dtype="float32")


# --- optional dependency ----------------------------------------------------------------


def test_require_transformers(monkeypatch):
    assert require_transformers().AutoConfig is transformers.AutoConfig
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ConfigError, match=r"pip install 'zero3_offload\[hf\]'"):
        require_transformers()


def _eager_imports(node: ast.AST) -> list[str]:
    """Modules that ``node`` imports when its module is imported: not inside functions,
    nor under ``if TYPE_CHECKING:``."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        return []
    if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
        return [m for child in node.orelse for m in _eager_imports(child)]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    return [m for child in ast.iter_child_nodes(node) for m in _eager_imports(child)]


def test_the_integrations_import_transformers_only_inside_functions():
    """So that ``zero3_offload`` works without transformers installed."""
    paths = sorted((ROOT / "zero3_offload" / "integrations").glob("*.py"))
    assert len(paths) >= 5
    for path in paths:
        eager = _eager_imports(ast.parse(path.read_text()))
        if path.name != "__init__.py":
            assert "__future__" in eager, path  # the walk sees module-level imports
        assert not [m for m in eager if m.split(".")[0] == "transformers"], path
