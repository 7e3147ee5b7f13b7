"""What the tiled-loss tests share: tiny causal LMs, their data, plain single-process
transformers training, and the rank functions ``run_ranks`` runs (module level, so that
rank processes can unpickle them by name).

Every model is built from a config (no download) with dropout 0. The sequences are 16
tokens and the tiled loss's chunks 5 tokens, so each rank's loss takes several chunks
and a ragged last one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs
import structlog
import torch
import torch.nn.functional as F
from hf_models import TINY_DECODER, make_config
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from zero3_offload import OptimizerConfig, Zero3CpuOffloadManager, tiled_causal_lm_loss
from zero3_offload.errors import Zero3Error
from zero3_offload.testing import RankContext

ROWS = 4  # rows of a step's whole batch: 2 per rank at 2 ranks
SEQ = 16
STEPS = 5  # AdamW steps, one micro-step each
LR = 1e-3
CHUNK = 5  # tokens per chunk: a rank's 32 positions are 6 chunks of 5 and one of 2
MASKED_KEEP = 0.6  # share of the label tokens kept by the masked (token-weighted) variant


# ------------------------------------------------------------------------------- models


def _llama() -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER))


def _qwen3_tied() -> nn.Module:
    return Qwen3ForCausalLM(Qwen3Config(**TINY_DECODER, head_dim=8, tie_word_embeddings=True))


def _gemma2() -> nn.Module:
    # Tied head, soft-capped logits (a cap of 2: most logits are bent by it).
    cfg = Gemma2Config(**TINY_DECODER, head_dim=8, final_logit_softcapping=2.0, sliding_window=8)
    return Gemma2ForCausalLM(cfg)


def _lora_head() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    base = _llama()
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "lm_head"])
    model = get_peft_model(base, lora)
    for name, param in model.named_parameters():  # B = 0 at init: start from a non-zero B
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model


def _mixtral() -> nn.Module:
    cfg = MixtralConfig(**TINY_DECODER, num_local_experts=2, num_experts_per_tok=1)
    return MixtralForCausalLM(cfg)


class FusedLossLlama(LlamaForCausalLM):
    """A Llama whose forward computes its loss from ``self.lm_head.weight`` without calling
    the head, inside ``self.gathered(lm_head)``: a chunked ``F.linear`` loop, or (``library``)
    ``tiled_causal_lm_loss``; with ``recompute`` under non-reentrant activation
    checkpointing, so that the block runs again in the backward."""

    gathered: Callable[..., Any] = staticmethod(lambda *_: contextlib.nullcontext())
    library = False
    recompute = False

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, use_cache=False).last_hidden_state
        if self.recompute:
            return checkpoint(self._loss, hidden, labels, use_reentrant=False)
        return self._loss(hidden, labels)

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.gathered(self.lm_head):
            if self.library:
                return tiled_causal_lm_loss(hidden, self.lm_head.weight, labels, chunk_tokens=CHUNK)
            targets = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
            flat = hidden.reshape(-1, hidden.shape[-1])
            total = hidden.new_zeros(())
            for start in range(0, flat.shape[0], CHUNK):
                logits = F.linear(flat[start : start + CHUNK], self.lm_head.weight)
                total = total + F.cross_entropy(
                    logits.float(), targets[start : start + CHUNK], reduction="sum"
                )
            return total / (targets != -100).sum()


def _fused() -> nn.Module:
    return FusedLossLlama(LlamaConfig(**TINY_DECODER))


def _fused_library() -> nn.Module:
    model = _fused()
    model.library = True
    return model


def _fused_recompute() -> nn.Module:
    model = _fused()
    model.recompute = True
    return model


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama,
    "qwen3_tied": _qwen3_tied,
    "gemma2": _gemma2,
    "lora_head": _lora_head,
    "masked": _llama,
    "frozen_head": _llama,
    "mixtral": _mixtral,
    "fused": _fused,
    "fused_library": _fused_library,
    "fused_recompute": _fused_recompute,
    "fused_ungathered": _fused,
}


def build(kind: str) -> nn.Module:
    """A fresh model of ``kind`` (same values every time), in training mode."""
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    if kind == "frozen_head":
        model.lm_head.weight.requires_grad_(False)
    model.train()
    return model


def batch(step: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch: ids and labels (-100 at random places when masked)."""
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, TINY_DECODER["vocab_size"], (ROWS, SEQ), generator=g)
    labels = ids.clone()
    if kind == "masked":
        keep = torch.rand(ROWS, SEQ, generator=g) < MASKED_KEEP
        keep[0, :8] = True  # the ranks hold very different numbers of valid tokens
        keep[2:, :] &= torch.rand(2, SEQ, generator=g) < 0.5
        labels = torch.where(keep, labels, torch.full_like(labels, -100))
    return ids, labels


def valid_tokens(labels: torch.Tensor) -> int:
    """Targets a causal LM scores: labels after the first position other than -100."""
    return int((labels[:, 1:] != -100).sum())


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _loss(kind: str, out: Any) -> torch.Tensor:
    return out if kind.startswith("fused") else out.loss


def plain_train(kind: str) -> dict[str, Any]:
    """Plain single-process transformers training on whole batches (AdamW, no clipping);
    the model's own loss (the masked variant: summed over the batch's valid tokens)."""
    model = build(kind)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        ids, labels = batch(step, kind)
        kwargs: dict[str, Any] = {"input_ids": ids, "labels": labels}
        if kind == "masked":
            kwargs["num_items_in_batch"] = valid_tokens(labels)
        loss = _loss(kind, model(**kwargs))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": params(model), "start": params(build(kind))}


# ----------------------------------------------------------------------------- rank runs


@attrs.frozen
class Spec:
    kind: str
    chunk: int = CHUNK
    return_logits: bool = False  # the model's own loss and logits
    config: dict[str, Any] = attrs.Factory(dict)  # more config fields


async def train(ctx: RankContext, spec: Spec) -> dict[str, Any]:
    """``STEPS`` steps of ``spec.kind`` under the manager on this rank's rows.

    Returns the global loss of every step (token-weighted for the masked variant), what
    the outputs held, the final full state and the log events.
    """
    model = build(spec.kind)
    fields = {"gradient_accumulation_steps": 1, "gradient_clipping": 0.0}
    fields.update(loss_chunk_tokens=spec.chunk, **spec.config)
    config = make_config(fields, OptimizerConfig(kind="adamw"))
    out: dict[str, Any] = {"losses": [], "logits": []}
    with structlog.testing.capture_logs() as logs:
        manager = Zero3CpuOffloadManager(config, ctx.group, model)
        if spec.kind.startswith("fused") and spec.kind != "fused_ungathered":
            model.gathered = manager.gathered
        per = ROWS // ctx.world_size
        for step in range(STEPS):
            ids, labels = (t[ctx.rank * per : (ctx.rank + 1) * per] for t in batch(step, spec.kind))
            kwargs: dict[str, Any] = {"input_ids": ids, "labels": labels}
            if spec.return_logits:
                kwargs["return_logits"] = True
            try:
                result = await manager.forward(**kwargs)
            except Zero3Error as exc:
                out["error"] = (type(exc).__name__, str(exc))
                break
            if step == 0:  # what the training forward keeps for its backward
                out["saved_bytes"] = manager.get_memory_stats().activation_bytes
            if not spec.kind.startswith("fused"):
                logits = result.logits
                out["logits"].append(None if logits is None else tuple(logits.shape))
            loss = _loss(spec.kind, result)
            tokens = valid_tokens(labels) if spec.kind == "masked" else None
            await manager.backward(loss, tokens=tokens)
            out["losses"].append(await _global(ctx, loss, tokens))
            await manager.optimizer_step(LR)
        out["state"] = await manager.full_state_dict()
        await manager.close()
    out["fallbacks"] = [dict(e) for e in logs if e["event"] == "tiled_loss_fallback"]
    return out


async def _global(ctx: RankContext, loss: torch.Tensor, tokens: int | None) -> float:
    """The step's loss over all ranks: the mean of the ranks' means, or (``tokens``) the
    token-weighted mean."""
    weight = 1.0 if tokens is None else float(tokens)
    t = torch.tensor([loss.item() * weight if weight else 0.0, weight], dtype=torch.float64)
    torch.distributed.all_reduce(t, group=ctx.group)
    return (t[0] / t[1]).item()
