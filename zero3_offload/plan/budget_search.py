"""``choose_config()``: the fastest planned configuration whose peak fits a budget.

The search goes over the options that trade memory for time (see docs/planning.md):
activation checkpointing (off, full, selective over half or all of the layers, and for
the fastest candidate that checkpoints, as many selective layers as fit), a tiled MLP,
the loss's chunk (as given, or a quarter of it), the format of frozen weights
(``bf16``, ``nf4``) and decoding them at use, how many layers stay gathered
(``prefetch_buffer_size``, ``keep_gathered_bytes``), offloading checkpointed inputs to
disk (only with an ``nvme_path``), sequence parallelism, and the micro-batch against
gradient accumulation at the same global batch. Every candidate trims the C heap
(``trim_heap_after_forward``, 2-3 ms a trim): the plan counts tensors, and without the
trims the freed small blocks stay resident into the loss's and the backward's peaks.
Options the user set on the command line or in
the config are kept as given (``fixed``). Each candidate is planned with
:func:`~zero3_offload.plan.planner.plan_run`; the fastest whose host peak (and device
peak, with ``device_memory``) fits wins, ties to the loss chunk as given, then to the
smaller peak. A host peak fits when
it leaves ``HEADROOM`` (5%) of the budget free, for the plan's own error.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator
from typing import Any

import attrs

from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.errors import ConfigError
from zero3_offload.plan.calibrate import load_or_measure
from zero3_offload.plan.calibration import Calibration
from zero3_offload.plan.planner import local_ranks, plan_run
from zero3_offload.plan.run_plan import RunPlan
from zero3_offload.train.options import TrainOptions, format_size

__all__ = ["HEADROOM", "BudgetChoice", "NothingFitsError", "choose_config"]

HEADROOM = 0.05
"""The share of a host budget a plan leaves free: a candidate fits when its planned peak
is at most 95% of the budget. Measured peaks ran up to 10% off their plans (the
plan-accuracy suite), 5-7% above them in a training loop of the user's own."""


_SMALLEST_LOSS_CHUNK = 32  # tokens: the smallest loss chunk the search proposes


class NothingFitsError(ConfigError):
    """No configuration fits the budget; the message names the smallest peak reachable
    and what holds it."""

    def __init__(self, message: str, smallest: RunPlan) -> None:
        super().__init__(message)
        self.smallest = smallest


@attrs.frozen
class Candidate:
    """One configuration planned."""

    opts: TrainOptions
    zero3: Zero3CpuOffloadConfig
    plan: RunPlan
    changes: dict[str, Any]  # what differs from the user's configuration
    fits: bool
    why: str  # why it lost, or "chosen"


@attrs.frozen
class BudgetChoice:
    """The chosen configuration and the runners-up."""

    chosen: Candidate
    runners_up: tuple[Candidate, ...]
    considered: int
    budget: int
    device_budget: int | None
    start: Zero3CpuOffloadConfig  # the configuration the search started from

    def config_file(self) -> dict[str, Any]:
        """The choice as a ``train --config`` file: the micro-batch and accumulation,
        and the options the search changed from the configuration it started from."""
        out: dict[str, Any] = {
            "batch_size": self.chosen.opts.batch_size,
            "gradient_accumulation_steps": self.chosen.zero3.gradient_accumulation_steps,
        }
        start = self.start.to_dict()
        out.update({k: v for k, v in self.chosen.changes.items() if start.get(k) != v})
        return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _size(n: int) -> str:
    """``n`` bytes as the user would write it: ``6GiB`` when a unit divides it, else MiB."""
    text = format_size(n)
    return text if not text.isdigit() else _mib(n)


def _splits(opts: TrainOptions, zero3: Zero3CpuOffloadConfig) -> Iterator[tuple[int, int, int]]:
    """``(sequence parallel, micro-batch, accumulation)`` that keep the global batch."""
    world = opts.world_size
    global_batch = opts.batch_size * zero3.gradient_accumulation_steps * world
    global_batch //= zero3.sequence_parallel_size  # a sequence group shares its batch
    for sequence in (s for s in (1, 2, 4, 8) if world % s == 0 and s <= world):
        data = world // sequence
        if global_batch % data:
            continue
        per_rank = global_batch // data
        for micro in (m for m in range(1, per_rank + 1) if per_rank % m == 0):
            yield sequence, micro, per_rank // micro


def _candidates(
    opts: TrainOptions,
    zero3: Zero3CpuOffloadConfig,
    layers: int,
    fixed: Collection[str],
    has_peft: bool,
) -> Iterator[tuple[TrainOptions, dict[str, Any]]]:
    adapters = opts.lora is not None or opts.peft_config is not None or opts.freeze is not None
    adapters = adapters or has_peft
    checkpointing: list[dict[str, Any]] = [
        {"activation_checkpointing": False, "selective_checkpointing_units": 0},
        {"activation_checkpointing": True, "selective_checkpointing_units": 0},
    ]
    for units in sorted({max(1, layers // 2), layers}):
        checkpointing.append(
            {"activation_checkpointing": True, "selective_checkpointing_units": units}
        )
    frozen: list[dict[str, Any]] = [{}]
    if adapters:
        frozen = [
            {"frozen_compression": "none", "frozen_decode_at_use": False},
            {"frozen_compression": "bf16", "frozen_decode_at_use": False},
            {"frozen_compression": "bf16", "frozen_decode_at_use": True},
            {"frozen_compression": "nf4", "frozen_decode_at_use": False},
            {"frozen_compression": "nf4", "frozen_decode_at_use": True},
        ]
    tiled = [{"mlp_chunk_tokens": 0}]
    if opts.seq_len * opts.batch_size >= 2048:
        tiled.append({"mlp_chunk_tokens": 1024})
    # The loss's chunk (its fp32 logits held at once): as given, and a quarter of it.
    chunk = zero3.loss_chunk_tokens
    if chunk >= 4 * _SMALLEST_LOSS_CHUNK and opts.seq_len * opts.batch_size > chunk // 4:
        tiled = [{**t, **c} for t in tiled for c in ({}, {"loss_chunk_tokens": chunk // 4})]
    gathered = [
        {"prefetch_buffer_size": 2, "keep_gathered_bytes": 0},
        {"prefetch_buffer_size": 1, "keep_gathered_bytes": 0},
    ]
    offload = [{"offload_activations": "none"}]
    if zero3.nvme_path is not None:
        offload.append({"offload_activations": "nvme"})
    splits = list(_splits(opts, zero3))
    if "batch_split" in fixed:
        given = zero3.gradient_accumulation_steps
        splits = [(zero3.sequence_parallel_size, opts.batch_size, given)]
    for sequence, micro, accumulation in splits:
        for parts in itertools.product(checkpointing, frozen, tiled, gathered, offload):
            changes: dict[str, Any] = {}
            for part in parts:
                changes.update(part)
            if (
                not changes.get("activation_checkpointing")
                and changes.get("offload_activations", "none") != "none"
            ):
                continue
            changes["sequence_parallel_size"] = sequence
            changes["gradient_accumulation_steps"] = accumulation
            changes["trim_heap_after_forward"] = True  # the peak is the tensors counted
            changes = {k: v for k, v in changes.items() if k not in fixed}
            yield attrs.evolve(opts, batch_size=micro), changes


def choose_config(
    opts: TrainOptions,
    zero3: Zero3CpuOffloadConfig,
    budget: int,
    *,
    device_budget: int | None = None,
    fixed: Collection[str] = (),
    calibration: Calibration | None = None,
    peft_config: Any = None,
) -> BudgetChoice:
    """The fastest planned configuration whose peak fits ``budget`` bytes per rank (see
    the module docstring).

    Args:
        opts: the run (its model, world size, batch, sequence, adapters).
        zero3: the configuration the search starts from.
        budget: host bytes per rank (peak RSS).
        device_budget: device bytes per rank, on an accelerator.
        fixed: option names the search leaves as ``zero3`` has them (``batch_split``:
            the micro-batch and the accumulation).
        calibration: this machine's figures (default: cached or measured).
        peft_config: the adapters' peft config, instead of ``opts``'s.

    Raises:
        NothingFitsError: no candidate fits; the smallest peak and what holds it.
        ConfigError: the run cannot be planned (e.g. no ``model``).
    """
    if opts.model is None:
        raise ConfigError(
            "memory_per_rank needs a transformers model (model=DIR): the planner reads "
            "its config.json"
        )
    calibration = calibration or load_or_measure(local_ranks(opts.world_size))
    first = plan_run(opts, zero3, calibration, peft_config=peft_config)
    layers = first.train["layers"]
    usable = budget * (1 - HEADROOM)  # what a plan may peak at
    seen: list[Candidate] = []

    def planned(run: TrainOptions, changes: dict[str, Any]) -> Candidate | None:
        try:
            config = zero3.evolve(**changes)
        except ConfigError:
            return None  # a combination the configuration refuses
        plan = plan_run(run, config, calibration, peft_config=peft_config)
        host_ok = plan.host_peak_bytes <= usable
        device_ok = device_budget is None or plan.device_peak_bytes <= device_budget
        why = ""
        if not host_ok:
            why = f"peak {_mib(plan.host_peak_bytes)} over {_mib(usable)}"
        elif not device_ok:
            why = f"device peak {_mib(plan.device_peak_bytes)} over {_mib(device_budget or 0)}"
        found = Candidate(run, config, plan, changes, host_ok and device_ok, why)
        seen.append(found)
        return found

    for run, changes in _candidates(opts, zero3, layers, fixed, peft_config is not None):
        planned(run, changes)
    # Fastest first; at the same time the loss chunk as given (fewer, larger chunks),
    # then the smaller peak.
    fitting = sorted(
        (c for c in seen if c.fits),
        key=lambda c: (
            c.plan.predicted_step_s,
            c.zero3.loss_chunk_tokens != zero3.loss_chunk_tokens,
            c.plan.host_peak_bytes,
        ),
    )
    if fitting and "selective_checkpointing_units" not in fixed:
        most = _most_saved(fitting[0], layers, planned)
        if most is not fitting[0]:
            fitting.insert(0, most)
    if not fitting:
        smallest = min(seen, key=lambda c: c.plan.host_peak_bytes)
        held = sorted(smallest.plan.breakdown.items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{name} {_mib(n)}" for name, n in held)
        raise NothingFitsError(
            f"no configuration of the {len(seen)} planned fits {_size(budget)} per rank "
            f"(a plan must leave {HEADROOM:.0%} free: {_mib(usable)}): "
            f"the smallest peak is {_mib(smallest.plan.host_peak_bytes)} "
            f"({_describe(smallest.changes)}), held by {parts}; use more ranks, LoRA or a "
            "smaller sequence",
            smallest.plan,
        )
    chosen = attrs.evolve(fitting[0], why="chosen")
    runners: list[Candidate] = []
    for other in fitting[1:4]:
        slower = other.plan.predicted_step_s - chosen.plan.predicted_step_s
        runners.append(attrs.evolve(other, why=f"{slower:+.2f} s per step predicted"))
    for other in sorted((c for c in seen if not c.fits), key=lambda c: c.plan.predicted_step_s)[:2]:
        runners.append(other)
    return BudgetChoice(
        chosen=chosen,
        runners_up=tuple(runners),
        considered=len(seen),
        budget=budget,
        device_budget=device_budget,
        start=zero3,
    )


def _most_saved(
    best: Candidate,
    layers: int,
    planned: Callable[[TrainOptions, dict[str, Any]], Candidate | None],
) -> Candidate:
    """``best`` with as many checkpointed layers saving their products as fit (the most
    that do, by bisection: each one saved raises the peak and shortens the step), when
    that plans faster; else ``best``."""
    if not best.zero3.activation_checkpointing:
        return best
    fits, over = best.zero3.selective_checkpointing_units, layers + 1  # fits < over
    found = best
    while over - fits > 1:
        units = (fits + over) // 2
        tried = planned(best.opts, {**best.changes, "selective_checkpointing_units": units})
        if tried is not None and tried.fits:
            fits, found = units, tried
        else:
            over = units
    faster = found.plan.predicted_step_s < best.plan.predicted_step_s
    return found if faster else best


def _describe(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "as given"
