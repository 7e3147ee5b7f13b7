"""peft's LoRA ``Linear`` run by ``LoraLinearForward``: the adapter's branch before the
frozen base, bitwise peft's outputs, its gradients up to fp32 reassociation, and the
base's product left out of a checkpointed block's recomputation when it is the block's
last."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero3_offload.execution.lora_forward import LoraLinearForward


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 40, bias=False)
        self.down = nn.Linear(40, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _models(r: int, dropout: float) -> tuple[nn.Module, nn.Module]:
    """(peft's own, ours) from the same weights and adapters."""
    torch.manual_seed(0)
    config = LoraConfig(r=r, lora_alpha=8, lora_dropout=dropout, target_modules=["up", "down"])
    peft = get_peft_model(_Block(), config)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)  # peft starts lora_B at zero: the branch would add nothing
    ours = copy.deepcopy(peft)
    assert LoraLinearForward.install(ours) == 2
    assert LoraLinearForward.install(ours) == 0  # installed once
    return peft, ours


def _step(model: nn.Module, x: torch.Tensor, ckpt: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)  # dropout's masks
    x = x.detach().clone().requires_grad_()
    out = checkpoint(model, x, use_reentrant=False) if ckpt else model(x)
    out.square().sum().backward()
    grads = [x.grad] + [p.grad for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    return out.detach(), grads


@pytest.mark.parametrize("r", [2, 16])  # 16 * 4 >= 40: the sum is computed as peft does
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("ckpt", [False, True])
def test_outputs_are_bitwise_pefts_and_gradients_reassociated(
    r: int, dropout: float, ckpt: bool
) -> None:
    peft, ours = _models(r, dropout)
    x = torch.randn(3, 5, 16)
    want, want_grads = _step(peft, x, ckpt)
    got, got_grads = _step(ours, x, ckpt)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_disabled_adapters_run_pefts_forward() -> None:
    peft, ours = _models(2, 0.0)
    x = torch.randn(3, 5, 16)
    with peft.disable_adapter(), ours.disable_adapter():
        assert torch.equal(ours(x), peft(x))
        assert torch.equal(ours(x), peft.base_model.model(x))


def test_the_last_base_product_is_not_recomputed() -> None:
    # The block's last saved tensor is the down adapter's; the down base's product, run
    # after it, is left out of the recomputation (peft's order runs it first: recomputed).
    calls = {"peft": [], "ours": []}
    for name, model in zip(calls, _models(2, 0.0), strict=True):
        for layer in ("up", "down"):
            base = model.base_model.model.get_submodule(layer).base_layer
            base.register_forward_hook(lambda *_, n=name, k=layer: calls[n].append(k))
        _step(model, torch.randn(3, 5, 16), ckpt=True)
    assert calls["peft"] == ["up", "down", "up", "down"]
    assert calls["ours"] == ["up", "down", "up"]
