"""What the module-mode tests share: tiny transformers models and custom modules, their
data, plain single-process reference training, and the rank functions ``run_ranks`` runs.

Every model is built from a config (no download) with dropout 0, so plain training and
the manager's training of the same model compute the same numbers. Rank functions live
at module level so that rank processes can unpickle them by name.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import attrs
import structlog
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.errors import Zero3Error
from zero3_offload.testing import RankContext

ARCHS = ("llama", "qwen2", "gpt2")
BATCH = 6  # split evenly over 1, 2 or 3 ranks
SEQ = 16
ACC = 2  # micro-steps per optimizer step
CLIP = 1.0
LR = 1e-3
MICRO_STEPS = 12  # 6 AdamW steps

# ------------------------------------------------------------------------------- models


TINY_DECODER = dict(  # a 2-layer decoder config (Llama, Qwen2, Mistral ...)
    vocab_size=101,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
)


def _llama() -> nn.Module:
    # GQA (4 query heads, 2 key/value heads) with rotary positions.
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER))


def _qwen2() -> nn.Module:
    # q, k and v projections with bias.
    return Qwen2ForCausalLM(Qwen2Config(**TINY_DECODER))


def _gpt2() -> nn.Module:
    # Embedding tied to the LM head, learned positions; 97 rows: not divisible by 2 or 3.
    cfg = GPT2Config(
        vocab_size=97,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


class KwBlock(nn.Module):
    """A residual MLP block taking and returning keyword arguments / a tuple."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d + 1)
        self.fc2 = nn.Linear(2 * d + 1, d)

    def forward(self, h: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        delta = self.fc2(F.gelu(self.fc1(self.norm(h))))
        return h + scale * delta, delta.pow(2).mean()


class KwModel(nn.Module):
    """Keyword-argument forward, a tuple ``(loss, logits)`` out; blocks in a ModuleList."""

    vocab = 53

    def __init__(self, d: int = 24, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, d)
        self.blocks = nn.ModuleList(KwBlock(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.vocab)

    def forward(
        self, *, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        h = self.embed(input_ids)
        penalty = h.new_zeros(())
        for block in self.blocks:
            h, extra = block(h, scale=0.5)
            penalty = penalty + extra
        logits = self.head(self.norm(h))
        loss = None
        if labels is not None:
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), labels[:, 1:].reshape(-1))
            loss = ce + 0.01 * penalty
        return loss, logits


class SharedBlock(KwBlock):
    """KwBlock that also applies ``shared``, an nn.Linear registered in another block too."""

    def __init__(self, d: int, shared: nn.Linear) -> None:
        super().__init__(d)
        self.shared = shared

    def forward(self, h: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        delta = self.fc2(F.gelu(self.fc1(self.norm(h)))) + self.shared(h)
        return h + scale * delta, delta.pow(2).mean()


class SharedModel(KwModel):
    """KwModel whose two blocks both use one nn.Linear (registered in each block only)."""

    def __init__(self, d: int = 24) -> None:
        super().__init__(d, n_blocks=2)
        shared = nn.Linear(d, d)
        self.blocks = nn.ModuleList(SharedBlock(d, shared) for _ in range(2))


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "gpt2": _gpt2,
    "kw": KwModel,
    "shared": SharedModel,
}


def build(kind: str, *, seed: int = 0) -> nn.Module:
    """A fresh model of ``kind`` (same values for the same seed), in training mode."""
    torch.manual_seed(seed)
    model = BUILDERS[kind]()
    model.train()
    return model


def enable_model_checkpointing(model: nn.Module, *, reentrant: bool = False) -> None:
    """The model's own activation checkpointing of its decoder layers (transformers).

    transformers 5 calls it ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
    is its deprecated name); both default to non-reentrant checkpointing.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    kwargs = {"use_reentrant": True} if reentrant else None
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_hf(kind: str) -> bool:
    return kind in ARCHS


def vocab_size(kind: str) -> int:
    return {"llama": 101, "qwen2": 101, "gpt2": 97}.get(kind, KwModel.vocab)


def batch(index: int, kind: str) -> torch.Tensor:
    """The whole batch (BATCH x SEQ token ids) of micro-step ``index``."""
    g = torch.Generator().manual_seed(100 + index)
    return torch.randint(0, vocab_size(kind), (BATCH, SEQ), generator=g)


def local(x: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    per = x.shape[0] // ctx.world_size
    return x[ctx.rank * per : (ctx.rank + 1) * per]


def call_kwargs(kind: str, x: torch.Tensor) -> dict[str, Any]:
    """The training forward's keyword arguments (no KV cache in training)."""
    kw: dict[str, Any] = {"input_ids": x, "labels": x}
    if is_hf(kind):
        kw["use_cache"] = False
    return kw


def loss_of(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.loss


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name as in ``named_parameters()`` (tied ones once), detached copies."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -------------------------------------------------------------------- plain reference


def plain_train(
    kind: str, micro_steps: int = MICRO_STEPS, *, model_ckpt: str | None = None
) -> dict[str, Any]:
    """Plain single-process training on whole batches: AdamW, clipping 1.0, accumulation 2.

    With ``model_ckpt`` ("reentrant" or "non-reentrant") the model's own activation
    checkpointing is on. Returns the loss of every micro-step, the final parameters and
    the model.
    """
    model = build(kind)
    if model_ckpt is not None:
        enable_model_checkpointing(model, reentrant=model_ckpt == "reentrant")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for i in range(micro_steps):
        x = batch(i, kind)
        loss = loss_of(model(**call_kwargs(kind, x)))
        (loss / ACC).backward()
        losses.append(loss.item())
        if (i + 1) % ACC == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "state": params(model), "model": model}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


# -------------------------------------------------------------------------- rank runs


def make_config(
    config: dict[str, Any], optimizer: OptimizerConfig | None = None
) -> Zero3CpuOffloadConfig:
    """The manager config of the module-mode tests, with ``config``'s fields on top (and
    ``optimizer``, else AdamW without weight decay)."""
    fields = {
        "gradient_accumulation_steps": ACC,
        "gradient_clipping": CLIP,
        "cpu_memory_budget": 2**30,
        "gpu_param_memory_budget": 2**28,
        "collective_timeout_s": 120.0,
        **config,
    }
    optimizer = optimizer or OptimizerConfig(kind="adamw", weight_decay=0.0)
    return Zero3CpuOffloadConfig(optimizer=optimizer, **fields)


async def global_mean(ctx: RankContext, value: torch.Tensor) -> float:
    """The mean over ranks of a scalar (each rank's loss is its equal slice's mean)."""
    t = value.detach().float().reshape(1).clone()
    torch.distributed.all_reduce(t, group=ctx.group)
    return t.item() / ctx.world_size


@attrs.frozen
class HfSpec:
    """One module-mode training run on the ranks."""

    kind: str = "llama"
    micro_steps: int = MICRO_STEPS
    first_micro: int = 0  # index of the first micro-batch (to continue a run)
    config: dict[str, Any] = attrs.Factory(dict)  # Zero3CpuOffloadConfig fields
    units: tuple[Any, ...] | None = None
    model_ckpt: str | None = None  # the model's own checkpointing: "reentrant" or "non-reentrant"
    load_dir: str | None = None
    save_dir: str | None = None  # saved after the last micro-step
    fail_first: bool = False  # a forward that raises (ids out of range) before training
    stats: bool = False  # also return stats, memory figures and log events
    # Called without use_cache (the model's config has it on) and with eager attention,
    # which attends to every key it is given.
    model_cache: bool = False


async def train_hf(ctx: RankContext, spec: HfSpec) -> dict[str, Any]:
    """Train ``spec.kind`` with the manager in module mode on this rank's slice of each batch.

    Returns the global (rank-averaged) loss of every micro-step, what each
    ``optimizer_step`` returned, the full state dict, the unit names and the loss scale.
    """
    model = build(spec.kind)
    if spec.model_ckpt is not None:
        enable_model_checkpointing(model, reentrant=spec.model_ckpt == "reentrant")
    if spec.model_cache:
        assert model.config.use_cache
        model.set_attn_implementation("eager")
    out: dict[str, Any] = {"numel": sum(p.numel() for p in model.parameters())}
    with structlog.testing.capture_logs() as logs:
        manager = Zero3CpuOffloadManager(
            make_config(spec.config), ctx.group, model, units=spec.units
        )
        if spec.load_dir is not None:
            await manager.load_checkpoint(spec.load_dir)
        if spec.fail_first:
            bad = local(batch(0, spec.kind), ctx) + vocab_size(spec.kind)
            try:
                await manager.forward(**call_kwargs(spec.kind, bad))
            except Zero3Error as exc:
                out["failure"] = (type(exc).__name__, type(exc.__cause__).__name__)
            status = manager.get_prefetch_status()
            out["after_failure"] = {
                "gathered_bytes": status.gathered_bytes,
                "inflight_bytes": status.inflight_bytes,
                "persistent": list(status.persistent_layers),
            }
        losses, stepped, scales = [], [], []
        for i in range(spec.first_micro, spec.first_micro + spec.micro_steps):
            x = local(batch(i, spec.kind), ctx)
            kwargs = call_kwargs(spec.kind, x)
            if spec.model_cache:
                del kwargs["use_cache"]
            result = await manager.forward(**kwargs)
            loss = loss_of(result)
            await manager.backward(loss)
            losses.append(await global_mean(ctx, loss))
            stepped.append(await manager.optimizer_step(LR))
            scales.append(manager.loss_scale)
        if spec.save_dir is not None:
            await manager.save_checkpoint(spec.save_dir)
        if spec.stats:
            out["performance"] = attrs.asdict(manager.get_performance_stats(), recurse=True)
            out["memory"] = attrs.asdict(manager.get_memory_stats())
        out["state"] = await manager.full_state_dict()
        out["layer_names"] = manager.layer_names
        # Per-unit flat layouts (no public figure): {unit: (shard_numel, {param: (offset, numel)})}.
        out["layouts"] = {
            n: (lay.shard_numel, {s.name: (s.offset, s.numel) for s in lay.slots})
            for n, lay in manager.engine.layouts.items()
        }
        await manager.close()
    out["events"] = [dict(e) for e in logs if e["event"] == "step"]
    out.update(kind=spec.kind, losses=losses, stepped=stepped, loss_scales=scales)
    return out


async def guarded(ctx: RankContext, fn: Callable[..., Any], *args: Any) -> Any:
    """``await fn(ctx, *args)``, or ``{"error": traceback}`` when it raised on this rank.

    For rank functions that fail the same way on every rank, so that one failing run
    does not take the other runs of a shared rank run with it.
    """
    try:
        return await fn(ctx, *args)
    except Exception:
        return {"error": traceback.format_exc()}


def unwrap(result: Any) -> Any:
    """A ``guarded`` result, or the rank's failure as an AssertionError."""
    if isinstance(result, dict) and set(result) == {"error"}:
        raise AssertionError(f"the rank run failed:\n{result['error']}")
    return result


# ------------------------------------------------------------------------- probes


async def probe_errors(ctx: RankContext) -> dict[str, Any]:
    """Misuses of module mode: each call's error class (or "ok"), then a step that must train
    exactly like a fresh one (the first 2 micro-steps of the llama run)."""
    model = build("llama")
    out: dict[str, Any] = {}

    async def outcome(key: str, coro: Any) -> Any:
        try:
            value = await coro
        except Zero3Error as exc:
            out[key] = type(exc).__name__
            return None
        out[key] = "ok"
        return value

    manager = Zero3CpuOffloadManager(make_config({}), ctx.group, model)
    x = local(batch(0, "llama"), ctx)
    await outcome("backward_without_forward", manager.backward(torch.ones((), requires_grad=True)))
    await outcome("forward_pass", manager.forward_pass(x, list(manager.layer_names)))
    with torch.no_grad():
        evaluated = await outcome("eval_forward", manager.forward(input_ids=x, labels=x))
    out["eval_loss_has_grad_fn"] = evaluated.loss.grad_fn is not None
    await outcome("backward_after_eval", manager.backward(evaluated.loss * 1.0))
    # The model's own logits (a tiled loss keeps none): a loss that is not a scalar.
    trained = await manager.forward(**call_kwargs("llama", x), return_logits=True)
    await outcome("non_scalar_loss", manager.backward(trained.logits))
    await outcome("loss_not_a_tensor", manager.backward(1.0))  # type: ignore[arg-type]
    # The forward is still pending after refused backwards: this one completes it.
    await outcome("backward", manager.backward(trained.loss))
    await outcome("second_backward", manager.backward(trained.loss))
    out["losses"] = [await global_mean(ctx, trained.loss)]
    await manager.optimizer_step(LR)
    x1 = local(batch(1, "llama"), ctx)
    # Two training forwards, one backward: the second forward is the one used.
    await manager.forward(**call_kwargs("llama", x))
    again = await manager.forward(**call_kwargs("llama", x1))
    await outcome("backward_of_second_forward", manager.backward(again.loss))
    out["losses"].append(await global_mean(ctx, again.loss))
    out["stepped"] = await manager.optimizer_step(LR)
    out["state"] = await manager.full_state_dict()
    await manager.close()

    # A model without units (a chain of children): module mode is not available.
    chain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    chain_manager = Zero3CpuOffloadManager(make_config({}), ctx.group, chain)
    await outcome("chain_forward", chain_manager.forward(torch.ones(2, 4)))
    await outcome("chain_generate", chain_manager.generate(torch.ones(2, 4)))
    await chain_manager.close()

    for key, units in {
        "unknown_unit": ["nonexistent"],
        "nested_units": ["blocks", "blocks.0"],
        "empty_units": [],
        "no_match": [nn.Conv2d],
    }.items():
        try:
            built = Zero3CpuOffloadManager(make_config({}), ctx.group, KwModel(), units=units)
        except Zero3Error as exc:
            out[key] = type(exc).__name__
        else:
            await built.close()
            out[key] = "ok"
    return out


async def one_step(ctx: RankContext, manager: Zero3CpuOffloadManager) -> None:
    """One optimizer step of the Llama (``ACC`` micro-steps) on this rank's slices."""
    for i in range(ACC):
        x = local(batch(i, "llama"), ctx)
        result = await manager.forward(**call_kwargs("llama", x))
        await manager.backward(result.loss)
        await manager.optimizer_step(LR)


async def probe_eval(ctx: RankContext) -> dict[str, Any]:
    """After one optimizer step: logits of a no_grad forward, and the parameters they used."""
    model = build("llama")
    async with Zero3CpuOffloadManager(make_config({}), ctx.group, model) as manager:
        await one_step(ctx, manager)
        x = local(batch(7, "llama"), ctx)
        with torch.no_grad():
            evaluated = await manager.forward(input_ids=x, use_cache=False)
        kept = manager.get_memory_stats().activation_bytes
        status = manager.get_prefetch_status()
        state = await manager.full_state_dict()
        # What a training forward keeps for its backward, by comparison.
        trained = await manager.forward(**call_kwargs("llama", x))
        kept_for_backward = manager.get_memory_stats().activation_bytes
        await manager.backward(trained.loss)
        kept_after_backward = manager.get_memory_stats().activation_bytes
    return {
        "logits": evaluated.logits,
        "requires_grad": evaluated.logits.requires_grad,
        "activation_bytes": kept,
        "training_activation_bytes": kept_for_backward,
        "activation_bytes_after_backward": kept_after_backward,
        "gathered_bytes": status.gathered_bytes,
        "state": state,
    }


async def probe_saved_products(ctx: RankContext) -> list[int]:
    """Activation bytes after a training forward of the Llama with checkpointing, when
    0, 1 and 2 of its units save their products (each forward then backpropagated)."""
    saved = []
    for units in range(3):
        config = {"activation_checkpointing": True, "selective_checkpointing_units": units}
        model = build("llama")
        async with Zero3CpuOffloadManager(make_config(config), ctx.group, model) as manager:
            result = await manager.forward(**call_kwargs("llama", local(batch(0, "llama"), ctx)))
            saved.append(manager.get_memory_stats().activation_bytes)
            await manager.backward(result.loss)
    return saved


def prompt(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randint(3, vocab_size("llama"), (2, 5), generator=g)


async def probe_generate(ctx: RankContext) -> dict[str, Any]:
    """After one optimizer step: greedy generation of each rank's own prompt, with units
    kept gathered between decoding steps and without."""
    model = build("llama")
    async with Zero3CpuOffloadManager(make_config({}), ctx.group, model) as manager:
        await one_step(ctx, manager)
        before = await manager.full_state_dict()
        tokens = {}
        for keep in (True, False):
            tokens[keep] = await manager.generate(
                prompt(ctx.rank), max_new_tokens=6, do_sample=False, keep_gathered=keep
            )
        gathered_after = manager.get_prefetch_status().gathered_bytes
        # Training goes on after generating: the same numbers as without it.
        for i in range(ACC, 2 * ACC):
            x = local(batch(i, "llama"), ctx)
            result = await manager.forward(**call_kwargs("llama", x))
            await manager.backward(result.loss)
            await manager.optimizer_step(LR)
        state = await manager.full_state_dict()
    return {"tokens": tokens, "gathered_after": gathered_after, "before": before, "state": state}


# ------------------------------------------------------------ directories for the CLI


def save_tiny_llama(directory: Any, text: str, *, vocab: int = 300) -> None:
    """Save a tiny Llama (``TINY_DECODER``, ``vocab`` rows, seed 1) with its weights and a
    byte-level BPE tokenizer of ``vocab`` ids trained on ``text`` (no download): the
    model directory ``zero3-offload train --model`` fine-tunes."""
    import tokenizers
    import transformers

    config = LlamaConfig(**{**TINY_DECODER, "vocab_size": vocab})
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        [text], tokenizers.trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet)
    )
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)
