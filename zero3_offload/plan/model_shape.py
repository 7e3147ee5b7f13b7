"""``ModelShape``: what one rank of a run holds of a model, counted on the meta device.

The model is built from its ``config.json`` on the meta device (no weights read), with
the run's LoRA adapters or frozen globs applied as ``zero3-offload train`` applies them.
Its units, their flat layouts and this rank's CPU bytes come from the functions the
engine itself uses (``split_units``, ``build_layouts``, ``cpu_memory_need``), so the
planner and the engine cannot disagree on a shard's size.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import attrs
import torch
from torch import nn

from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.engine.model_units import default_unit_classes, split_units
from zero3_offload.errors import ConfigError
from zero3_offload.integrations.meta_model import build_model_from_directory
from zero3_offload.memory.budget import CpuMemoryNeed, cpu_memory_need
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.parameter.flat_layout import ROOT_UNIT, LayerLayout, build_layouts
from zero3_offload.parameter.rank_mapping import Zero3RankMapping
from zero3_offload.train.freeze import freeze_parameters

__all__ = ["ModelShape", "meta_model"]

# The engine's reused buffers of the optimizer's disk tier (see engine.build_engine).
_DISK_TIER_BUFFERS = 3
_PARAM_READ_AHEAD = 2


def meta_model(
    directory: str | os.PathLike[str],
    *,
    peft_config: Any = None,
    freeze: tuple[str, ...] | None = None,
) -> nn.Module:
    """The causal LM of ``directory`` on the meta device, with the run's LoRA adapters
    (``peft_config``) or frozen globs applied as ``zero3-offload train`` applies them.

    Raises:
        ConfigError: transformers (or peft) missing, a config it cannot build, a LoRA
            target or freeze glob that names nothing.
        CheckpointError: no readable ``config.json``.
    """
    model = build_model_from_directory(directory, on_meta=True)
    if peft_config is not None:
        from peft import get_peft_model

        try:
            model = get_peft_model(model, copy.deepcopy(peft_config))
        except ValueError as exc:
            raise ConfigError(f"the LoRA adapters of --lora/--peft-config: {exc}") from exc
    if freeze is not None:
        freeze_parameters(model, freeze)
    return model


def _cpu_need(zero3: Zero3CpuOffloadConfig, layouts: dict[str, LayerLayout]) -> CpuMemoryNeed:
    """This rank's CPU bytes of shards, as the engine counts them (``engine.build_engine``)."""
    on_disk_copies = zero3.offload_param_device.value == "nvme"
    return cpu_memory_need(
        zero3,
        [lay.shard_numel for lay in layouts.values() if lay.numel],
        torch.device(zero3.device),
        disk_tier_buffers=_DISK_TIER_BUFFERS,
        disk_copy_buffers=zero3.prefetch_buffer_size + _PARAM_READ_AHEAD + 1
        if on_disk_copies
        else 0,
        frozen_numels=[lay.frozen.shard_numel for lay in layouts.values() if lay.frozen],
    )


@attrs.frozen(kw_only=True)
class ModelShape:
    """The units of a model and what one rank of ``world_size`` holds of them."""

    model_type: str
    config: dict[str, Any]  # the transformers config, as a dict
    layouts: dict[str, LayerLayout]  # unit name -> flat layout, the root unit first
    decoder_units: tuple[str, ...]  # the units of the model's decoder layer class, in order
    other_units: tuple[str, ...]  # the other non-root units (input and output embeddings)
    cpu_need: CpuMemoryNeed  # this rank's shards, by kind (the engine's own count)
    device_state_bytes: int  # the shards an accelerator holds (those not offloaded)
    params: int  # every parameter's elements
    trainable: int  # the trainable ones
    world_size: int

    @classmethod
    def build(
        cls,
        directory: str | os.PathLike[str],
        zero3: Zero3CpuOffloadConfig,
        *,
        world_size: int,
        peft_config: Any = None,
        freeze: tuple[str, ...] | None = None,
    ) -> ModelShape:
        """The shape of the causal LM of ``directory`` trained on ``world_size`` ranks.

        Raises:
            ConfigError: transformers (or peft) missing, a config it cannot build, a LoRA
                target or freeze glob that names nothing.
            CheckpointError: no readable ``config.json``.
        """
        model = meta_model(directory, peft_config=peft_config, freeze=freeze)
        config = model.config.to_dict()
        kind = str(config.get("model_type", type(model).__name__))
        return cls.of_model(model, zero3, world_size=world_size, config=config, kind=kind)

    @classmethod
    def of_model(
        cls,
        model: nn.Module,
        zero3: Zero3CpuOffloadConfig,
        *,
        world_size: int,
        config: dict[str, Any],
        kind: str,
    ) -> ModelShape:
        """The shape of ``model`` (on the meta device, adapters and freezing applied)."""
        frozen_codec = ShardCodec(
            zero3.frozen_compression, zero3.compute_dtype, block_size=zero3.compression_block_size
        )
        unit_params, unit_modules = split_units(model)
        classes = set(default_unit_classes(model))
        decoder = tuple(n for n, m in unit_modules.items() if type(m).__name__ in classes)
        mapping = Zero3RankMapping(rank=0, world_size=world_size)
        layouts = build_layouts(dict(unit_params), mapping, frozen_align=frozen_codec.align)
        need = _cpu_need(zero3, layouts)
        # What is not offloaded lives on the device: the difference from offloading it all.
        offloaded = zero3.evolve(
            offload_params=True,
            offload_grads=True,
            offload_optimizer_states=True,
            offload_param_device="cpu",
            offload_optimizer_device="cpu",
        )
        on_device = (
            _cpu_need(offloaded, layouts).total
            - _cpu_need(
                zero3.evolve(offload_param_device="cpu", offload_optimizer_device="cpu"), layouts
            ).total
        )
        params = sum(lay.param_numel for lay in layouts.values())
        trainable = sum(lay.numel for lay in layouts.values())
        return cls(
            model_type=kind,
            config=config,
            layouts=layouts,
            decoder_units=decoder,
            other_units=tuple(n for n in unit_modules if n not in decoder),
            cpu_need=need,
            device_state_bytes=on_device if torch.device(zero3.device).type != "cpu" else 0,
            params=params,
            trainable=trainable,
            world_size=world_size,
        )

    @property
    def root(self) -> LayerLayout | None:
        """The root unit (embeddings, final norm, head), gathered for the whole step."""
        return self.layouts.get(ROOT_UNIT)

    def gather_bytes(self, name: str, zero3: Zero3CpuOffloadConfig) -> int:
        """Bytes of unit ``name``'s gathered buffer: every element in the compute dtype,
        or with ``frozen_decode_at_use`` its frozen part as stored."""
        lay = self.layouts[name]
        item = torch.empty((), dtype=zero3.compute_dtype).element_size()
        out = lay.padded_numel * item
        if lay.frozen is not None:
            stored = ShardCodec(
                zero3.frozen_compression,
                zero3.compute_dtype,
                block_size=zero3.compression_block_size,
            )
            wire = stored.wire_nbytes(lay.frozen.padded_numel)
            decoded = lay.frozen.padded_numel * item
            lossy = stored.storage_dtype != zero3.compute_dtype
            if lossy and zero3.frozen_decode_at_use:
                out += wire
            else:
                out += decoded + (wire if lossy else 0)
        return out

    def dim(self, *names: str, default: int = 0) -> int:
        """The first of the config's fields ``names`` that is set."""
        for name in names:
            value = self.config.get(name)
            if isinstance(value, int):
                return value
        return default
