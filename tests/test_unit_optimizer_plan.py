"""Optimizer kinds, their probe and the parameter groups' plan, without ranks: what is
refused and why, the segments of a shard, the owners of whole parameters."""

from __future__ import annotations

import pytest
import torch
from helpers import NormalizedSGD
from torch import nn

from zero3_offload import ConfigError, InputError, OptimizerConfig
from zero3_offload.optimizer_state.optimizer_kind import probe_kind
from zero3_offload.optimizer_state.optimizer_plan import Segment, plan_optimizer
from zero3_offload.parameter.flat_layout import build_layouts
from zero3_offload.parameter.rank_mapping import Zero3RankMapping

CPU = torch.device("cpu")


def test_dotted_kind_takes_its_options_and_refuses_the_rest() -> None:
    cfg = OptimizerConfig(kind="torch.optim.RMSprop", options={"alpha": 0.9})
    assert cfg.class_name() == "torch.optim.RMSprop"
    assert cfg.torch_options() == {"alpha": 0.9}
    assert OptimizerConfig.from_dict(cfg.to_dict()) == cfg
    assert OptimizerConfig(kind="adamw").class_name() == "torch.optim.AdamW"
    for kwargs, words in [
        ({"kind": "torch.optim.Nope"}, "cannot import"),
        ({"kind": "os.path"}, "not a torch.optim.Optimizer"),
        ({"kind": "torch.optim.RMSprop", "options": {"lr": 1.0}}, "lr_scale"),
        ({"kind": "torch.optim.RMSprop", "options": {"alfa": 1.0}}, "takes alpha"),
        ({"kind": "torch.optim.RMSprop", "options": {"foreach": True}}, "fused"),
        ({"kind": "torch.optim.RMSprop", "weight_decay": 0.1}, "in options"),
        ({"kind": "adamw", "options": {"eps": 1.0}}, "dotted kind"),
        ({"kind": "torch.optim.RMSprop", "options": {"alpha": object()}}, "JSON"),
    ]:
        with pytest.raises(ConfigError, match=words):
            OptimizerConfig(**kwargs)


@pytest.mark.parametrize(
    ("cls", "shape_aware", "full"),
    [
        (torch.optim.AdamW, False, ("exp_avg", "exp_avg_sq")),
        (torch.optim.Adagrad, False, ("sum",)),
        (torch.optim.Rprop, False, ("prev", "step_size")),
        (torch.optim.Adafactor, True, ()),
        (torch.optim.Muon, True, ()),
    ],
)
def test_probe_classifies_optimizers(cls: type, shape_aware: bool, full: tuple) -> None:
    kind = probe_kind(cls, {}, device=CPU, fused=None)
    assert kind.shape_aware is shape_aware and kind.full_keys == full


def test_probe_refuses_what_reduces_over_a_tensor() -> None:
    with pytest.raises(ConfigError, match="not element-wise"):
        probe_kind(NormalizedSGD, {}, device=CPU, fused=None)
    with pytest.raises(ConfigError, match="closure"):
        probe_kind(torch.optim.LBFGS, {}, device=CPU, fused=None)


def test_shape_aware_state_bytes_follow_the_parameter_shape() -> None:
    adafactor = probe_kind(torch.optim.Adafactor, {}, device=CPU, fused=None)
    # Row and column factors and the step: (64 + 32 + 1) fp32; a vector keeps it whole.
    assert adafactor.state_bytes(torch.Size([64, 32])) == 4 * (64 + 32 + 1)
    assert adafactor.state_bytes(torch.Size([10])) == 4 * (10 + 1)
    muon = probe_kind(torch.optim.Muon, {}, device=CPU, fused=None)
    assert muon.state_bytes(torch.Size([64, 32])) == 4 * 64 * 32


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)  # weight 12, bias 3
        self.b = nn.Linear(3, 2)  # weight 6, bias 2


def _plan(groups: list | None, rank: int = 0, world: int = 2, kind: str = "adamw"):
    model = Pair()
    layers = {"block": model}
    layouts = build_layouts(layers, Zero3RankMapping(rank=rank, world_size=world))
    cfg = OptimizerConfig(kind=kind)
    plan = plan_optimizer(
        cfg, groups, layers=layers, layouts=layouts, rank=rank, world_size=world, device=CPU
    )
    return plan, model


def test_one_group_per_layer_is_the_fast_path() -> None:
    plan, _ = _plan(None)
    assert plan.layers["block"].fast == 0 and not plan.layers["block"].segments


def test_segments_are_the_shard_cut_by_group() -> None:
    # Flat order: a.weight [0, 12), a.bias [12, 15), b.weight [15, 21), b.bias [21, 23);
    # padded to 24, rank 0 owns [0, 12), rank 1 [12, 24).
    groups = [{"params": ["block.a.bias", "block.b.bias"], "weight_decay": 0.0}]
    plan0, _ = _plan(groups, rank=0)
    plan1, _ = _plan(groups, rank=1)
    assert plan0.layers["block"].segments == (Segment(1, 0, 12),)
    assert plan1.layers["block"].segments == (
        Segment(0, 0, 3),
        Segment(1, 3, 9),
        Segment(0, 9, 11),
    )


def test_whole_parameters_are_owned_balanced_by_size() -> None:
    groups = [{"params": ["block.a.weight", "block.b.weight"], "optimizer": "torch.optim.Muon"}]
    plan, _ = _plan(groups, world=2)
    owned = {o.name: o.owner for o in plan.layers["block"].owned}
    assert owned == {"block.a.weight": 0, "block.b.weight": 1}
    assert plan.layers["block"].block == 12  # the largest owner's block


def test_parameters_may_be_given_as_tensors() -> None:
    model = Pair()
    layers = {"block": model}
    layouts = build_layouts(layers, Zero3RankMapping(rank=0, world_size=1))
    groups = [{"params": [model.a.bias], "lr_scale": 4.0}]
    plan = plan_optimizer(
        OptimizerConfig(), groups, layers=layers, layouts=layouts, rank=0, world_size=1, device=CPU
    )
    assert plan.groups[0].names == ("block.a.bias",) and plan.groups[0].lr_scale == 4.0


@pytest.mark.parametrize(
    ("groups", "error", "words"),
    [
        ([{"params": ["block.a.bias"]}, {"params": ["block.a.bias"]}], InputError, "one group"),
        ([{"params": ["block.nope"]}], InputError, "not a parameter"),
        ([{"params": [torch.zeros(2)]}], InputError, "not a parameter"),
        ([{"params": ["block.a.bias"], "lr": 0.1}], ConfigError, "lr_scale"),
        ([{"params": ["block.a.bias"], "momentun": 0.1}], ConfigError, "takes"),
        ([{"params": ["block.a.bias"], "lr_scale": -1}], ConfigError, ">= 0"),
        ([{"params": ["block.a.bias"], "optimizer": "torch.optim.Muon"}], ConfigError, "2D"),
        ([{"params": ["block.a.bias"], "optimizer": "torch.optim.LBFGS"}], ConfigError, "LBFGS"),
        ([{"weight_decay": 0.1}], ConfigError, "'params'"),
    ],
)
def test_bad_groups_are_refused(groups: list, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        _plan(groups)


def test_train_command_splits_decay_only_when_there_is_one() -> None:
    from zero3_offload.train.decay_split import trainer_param_groups

    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    decay, no_decay = trainer_param_groups(model, OptimizerConfig(weight_decay=0.1))
    assert decay == {"params": ["0.weight"]}  # the config's weight decay applies
    assert no_decay == {"params": ["0.bias", "1.weight", "1.bias"], "weight_decay": 0.0}
    assert trainer_param_groups(model, OptimizerConfig(weight_decay=0.0)) is None
    assert trainer_param_groups(model, OptimizerConfig(kind="torch.optim.Rprop")) is None
    # A dotted kind's own default weight decay (AdamW: 0.01) is split too.
    assert trainer_param_groups(model, OptimizerConfig(kind="torch.optim.AdamW")) is not None
