"""``--resume`` refuses a checkpoint trained with other adapters or other frozen weights.

A checkpoint of ``zero3-offload train`` records the options in its ``metadata.json``:
``training_state.adapters`` holds ``lora``, ``peft_config`` and ``freeze`` as given
(:func:`adapter_options`). Every checkpoint also records what they made of the model:
``peft`` holds the adapter config (rank, alpha, dropout, target modules, ...; null
without adapters) and ``layers`` the trainable parameters of every unit (``--freeze``
removes names from it). Before anything is loaded, both are compared with this run,
so a resume with another ``--lora``, ``--peft-config`` or ``--freeze`` fails naming
what differs, where a load would otherwise fail on a layout mismatch (or, for a new
dropout, not at all).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zero3_offload.checkpoint.format import layout_metadata, read_metadata, resolve_checkpoint
from zero3_offload.integrations.peft_metadata import peft_metadata
from zero3_offload.manager import Zero3CpuOffloadManager
from zero3_offload.train.options import TrainOptions

__all__ = ["adapter_mismatch", "adapter_options"]

# Adapter config fields that say nothing about the adapters trained.
_IGNORED = frozenset({"base_model_name_or_path", "revision", "inference_mode", "task_type"})


def _trainable(layers: list[dict[str, Any]]) -> set[str]:
    """The full names of the parameters of ``layers`` (a unit's name, then the parameter's;
    the model's own parameters outside units, such as a head, under their own)."""
    return {
        p["name"] if layer["name"].startswith("<") else f"{layer['name']}.{p['name']}"
        for layer in layers
        for p in layer["params"]
    }


def _describe(config: dict[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    return {k: v for k, v in config.items() if k not in _IGNORED}


def adapter_options(opts: TrainOptions) -> dict[str, Any]:
    """``--lora``, ``--peft-config`` and ``--freeze`` as a checkpoint records them."""
    return {
        "lora": None if opts.lora is None else opts.lora.describe(),
        "peft_config": opts.peft_config,
        "freeze": None if opts.freeze is None else ",".join(opts.freeze),
    }


def _flag(name: str, value: str | None) -> str:
    return f"--{name.replace('_', '-')} {value}" if value is not None else f"no --{name}"


def adapter_mismatch(root: Path, manager: Zero3CpuOffloadManager, opts: TrainOptions) -> str | None:
    """Why the checkpoint that ``root`` (or its ``latest``) names cannot continue this
    run: other adapter options, other adapters, or other trainable parameters; None
    when it can.

    Raises:
        CheckpointError: when there is no checkpoint or its metadata is unreadable.
    """
    directory = resolve_checkpoint(root)
    meta = read_metadata(directory)
    state = meta.get("training_state")
    recorded = state.get("adapters") if isinstance(state, dict) else None
    if isinstance(recorded, dict):
        ours = adapter_options(opts)
        differ = [k for k in ours if recorded.get(k) != ours[k]]
        if differ:
            there = ", ".join(_flag(k, recorded.get(k)) for k in differ)
            here = ", ".join(_flag(k, ours[k]) for k in differ)
            return (
                f"{directory} was trained with {there}, this run has {here}: give the "
                "options of that run, or another --out"
            )
    saved_peft, ours_peft = meta.get("peft"), peft_metadata(manager.model)
    if (saved_peft is None) != (ours_peft is None):
        had = "LoRA adapters" if saved_peft is not None else "no adapters"
        has = "LoRA adapters" if ours_peft is not None else "no adapters"
        return (
            f"{directory} was trained with {had} and this run has {has}: give the --lora "
            "(or --peft-config) of that run, or another --out"
        )
    if saved_peft is not None and ours_peft is not None:
        saved = _describe(saved_peft.get("adapter_config"))
        ours = _describe(ours_peft.get("adapter_config"))
        keys = sorted(k for k in saved.keys() | ours.keys() if saved.get(k) != ours.get(k))
        if keys:
            shown = "; ".join(f"{k}: {saved.get(k)!r} there, {ours.get(k)!r} here" for k in keys)
            return (
                f"{directory} was trained with other LoRA adapters ({shown}): give the "
                "--lora (or --peft-config) of that run, or another --out"
            )
    saved_names = _trainable(meta.get("layers", []))
    our_names = _trainable(layout_metadata(manager.engine.layouts))
    if saved_names != our_names:
        frozen, trained = sorted(saved_names - our_names), sorted(our_names - saved_names)
        parts = []
        if frozen:
            parts.append(f"{len(frozen)} trained there are frozen here: {frozen[0]}, ...")
        if trained:
            parts.append(f"{len(trained)} frozen there are trained here: {trained[0]}, ...")
        return (
            f"{directory} trained other parameters than this run: {'; '.join(parts)}; give "
            "the --freeze of that run, or another --out"
        )
    return None
