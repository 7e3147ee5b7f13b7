"""What every training suite trains: the library's ``GPT`` (its children are the layers) or
transformers' ``LlamaForCausalLM``, on ``ByteCorpus`` windows (bytes as token ids)."""

from __future__ import annotations

import functools
import hashlib
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from zero3_offload.integrations.peft_pretrained import reset_adapters
from zero3_offload.train.corpus import VOCAB_SIZE, ByteCorpus
from zero3_offload.train.model import GPT, GPTShape

MODEL = "`zero3_offload.train.model.GPT`"
LLAMA = "transformers' `LlamaForCausalLM`"
DIMS = ("d", "heads", "n_layers", "seq", "global_batch", "model", "ffn", "kv_heads", "vocab")
DIMS += ("lora",)  # LoRA rank of the Llama (peft), 0 or absent: a full fine-tune


def build(dims: dict[str, Any]) -> torch.nn.Module:
    """The GPT (a vocabulary above 256 leaves rows unused) or the Llama of ``dims``."""
    if r := dims.get("lora"):  # the Llama with LoRA of rank r on every projection, peft's way
        from peft import get_peft_model

        return get_peft_model(build({**dims, "lora": 0}), lora_config(r))
    if dims.get("model") == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(llama_config(dims, max_position_embeddings=dims.get("seq", 2048)))
    shape = dict(vocab_size=dims.get("vocab") or VOCAB_SIZE, seq_len=dims["seq"], d_model=dims["d"])
    return GPT(GPTShape(**shape, layers=dims["n_layers"], heads=dims["heads"]))


def lora_config(r: int) -> Any:
    """peft's ``LoraConfig`` of rank ``r`` on every attention and MLP projection."""
    from peft import LoraConfig

    proj = [f"{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down")]
    return LoraConfig(r=r, target_modules=proj)


def save(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Launcher target: the Llama of ``spec["dims"]`` (no LoRA) built from ``spec["seed"]``
    and saved as one fp32 ``model.safetensors`` in ``spec["model_dir"]``."""
    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    model = build({**spec["dims"], "model": "llama", "lora": 0})
    built = time.perf_counter()
    model.save_pretrained(spec["model_dir"], max_shard_size="100GB")
    files = {p.name: p.stat().st_size for p in sorted(Path(spec["model_dir"]).iterdir())}
    return {"build_s": built - t0, "save_s": time.perf_counter() - built, "files": files}


def load(dims: dict[str, Any], directory: str, seed: int) -> torch.nn.Module:
    """The Llama saved in ``directory``, loaded in full by transformers; with LoRA, adapters
    drawn from ``seed`` as ``from_pretrained(..., peft_config=...)`` of the library draws them."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if r := dims.get("lora"):
        reset_adapters(model := get_peft_model(model, lora_config(r)), seed)
    return model


def llama_config(dims: dict[str, Any], **extra: Any) -> Any:
    """A ``LlamaConfig`` of ``dims`` (untied head, no KV cache unless ``extra`` says otherwise)."""
    from transformers import LlamaConfig

    sizes = dict(vocab_size=dims["vocab"], hidden_size=dims["d"], intermediate_size=dims["ffn"])
    sizes.update(num_hidden_layers=dims["n_layers"], num_attention_heads=dims["heads"])
    sizes["num_key_value_heads"] = dims["kv_heads"]
    return LlamaConfig(**sizes, **{"tie_word_embeddings": False, "use_cache": False, **extra})


def layer_params(dims: dict[str, Any]) -> dict[str, int]:
    """Parameters per layer (the Llama: per decoder layer, the rest ``root``), counted on meta."""
    with torch.device("meta"):
        model = build(dims)
    llama = dims.get("model") == "llama"
    hf = getattr(model, "get_base_model", lambda: model)()  # inside a peft wrapper
    units = hf.model.layers.named_children() if llama else model.named_children()
    out = {n: sum(p.numel() for p in m.parameters()) for n, m in units}
    root = sum(p.numel() for p in model.parameters()) - sum(out.values())
    return {**out, "root": root} if llama else out


@functools.cache
def corpus() -> ByteCorpus:
    return ByteCorpus.load(max_bytes=4 << 20)


def corpus_info() -> dict[str, Any]:
    sha256 = hashlib.sha256(corpus().train.numpy().tobytes()).hexdigest()
    return {"description": f"windows of the first 4 MiB of the {corpus().source}", "sha256": sha256}


def batches(steps: int, dims: dict[str, int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (bytes, next bytes), each ``[global_batch, seq]`` int64."""
    size, seq = dims["global_batch"], dims["seq"]
    batch = functools.partial(corpus().batch, split="train", seed=seed, first=0)
    return [batch(step=i, batch_size=size, seq_len=seq) for i in range(steps)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
