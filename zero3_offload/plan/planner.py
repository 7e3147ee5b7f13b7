"""``plan()``: predict a training run's peak memory, disk and step time per rank.

[Note: the plan's memory model]
Every term is a byte count of tensors the run will hold, or a measurement:

* ``runtime``: what a rank holds whatever its model (torch, transformers and this
  library loaded, the autograd engine, thread pools, the C heap's arenas), measured by
  the calibration on a tiny training run (``plan.calibration``);
* ``model state``: this rank's master shards, optimizer state, compute copies, gradient
  shards, frozen shards and disk-tier buffers, from ``memory.budget.cpu_memory_need``
  over the units' flat layouts, the functions the engine itself calls;
* ``gathered``: the root unit (embeddings, final norm, head; gathered for the whole
  step) and the decoder units gathered at once at the forward's end (the prefetch
  window and those kept for backward: ``prefetch_buffer_size + 2`` units, the engine's
  buffer pool), in the compute dtype (frozen parts as stored with
  ``frozen_decode_at_use``), and the flat gradient buffers of the unit in backward;
* ``activations``: one decoder layer's saved tensors measured on a real one-layer
  forward (``plan.activation_probe``) at this run's tokens per rank, times the layers
  that keep them; with checkpointing each unit's input instead, plus the selective
  units' products and the one layer recomputed in backward; a tiled MLP's chunk
  instead of its whole intermediates;
* ``backward working set``: what one layer's forward allocates and frees again (the
  gradient of the layer being back-propagated needs about as much); with checkpointing
  only what exceeds the recomputed layer's saved tensors;
* ``loss``: the logits of one loss chunk (or all of them without chunking), fp32,
  with their softmax and gradient;
* ``shared memory``: the CPU collectives' region on more than one local rank;
* ``data``: the training text's tokens as the trainer holds them.

The host peak is the largest of three points: the load (runtime, model state, the
largest frozen shard read whole and a file's slice being read), the forward's end
(everything above), and the optimizer step (runtime, state and what stays gathered).
On an accelerator the gathered units, activations and loss live on the device instead;
the host keeps the runtime, the model state and pinned staging buffers.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
from torch import nn

from zero3_offload.config import OffloadActivations, OffloadDevice, Zero3CpuOffloadConfig
from zero3_offload.engine.engine import SHARED_MEMORY_BLOCK_BYTES
from zero3_offload.integrations.pretrained_weights import READ_ELEMENTS
from zero3_offload.memory.allocator import TRAIN_MMAP_THRESHOLD
from zero3_offload.memory.budget import disk_record_bytes
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.parameter.frozen_rows import SCRATCH_ELEMENTS
from zero3_offload.plan.activation_probe import LayerActivations, probe_layer
from zero3_offload.plan.calibration import Calibration
from zero3_offload.plan.model_shape import ModelShape, meta_model
from zero3_offload.plan.run_plan import RunPlan
from zero3_offload.storage.record_file import aligned
from zero3_offload.train.adapters import peft_config_of
from zero3_offload.train.options import TrainOptions

__all__ = ["local_ranks", "plan_run"]

_FP32 = 4
_POOL_EXTRA_LAYERS = 2  # engine: the unit in use and the one being released
_LOSS_COPIES = 3  # a chunk's logits, their softmax and their gradient, fp32
# With a frozen head and no logit transform, the gradient is written over the logits.
_LOSS_COPIES_IN_PLACE = 2
_TEXT_ITEMSIZE = 8  # token ids (int64) of the training text


class _Hashed:
    """A peft config that the probe cache can key on (by its repr)."""

    def __init__(self, key: str, value: Any) -> None:
        self.key, self.value = key, value

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hashed) and other.key == self.key


@functools.lru_cache(maxsize=32)
def _probe(
    directory: str, dtype: torch.dtype, peft: _Hashed, freeze: Any, threads: int
) -> LayerActivations:
    return probe_layer(
        directory, dtype=dtype, peft_config=peft.value, freeze=freeze, threads=threads
    )


@functools.lru_cache(maxsize=8)
def _meta(directory: str, peft: _Hashed, freeze: Any) -> nn.Module:
    return meta_model(directory, peft_config=peft.value, freeze=freeze)


@functools.lru_cache(maxsize=256)
def _shape_of(directory: str, config: str, world: int, peft: _Hashed, freeze: Any) -> ModelShape:
    model = _meta(directory, peft, freeze)
    hf = model.config.to_dict()
    zero3 = Zero3CpuOffloadConfig.from_dict(json.loads(config))
    kind = str(hf.get("model_type", type(model).__name__))
    return ModelShape.of_model(model, zero3, world_size=world, config=hf, kind=kind)


def _shape(
    directory: str, zero3: Zero3CpuOffloadConfig, world: int, peft: _Hashed, freeze: Any
) -> ModelShape:
    key = json.dumps(zero3.to_dict(), sort_keys=True)
    return _shape_of(directory, key, world, peft, freeze)


def _full_training(shape: ModelShape) -> bool:
    """Whether the run trains the model itself (at least half its parameters), the head
    included, rather than adapters or a few layers over a frozen model and head."""
    return shape.trainable >= shape.params * 0.5


def _loss_copies(zero3: Zero3CpuOffloadConfig, shape: ModelShape) -> int:
    """fp32 chunks of logits the tiled loss holds at once: two where a frozen head's
    gradient is taken in the forward and written over its logits (no logit transform),
    else three (see [Note: tiled loss] in ``execution.tiled_loss``)."""
    softcap = shape.config.get("final_logit_softcapping") is not None
    if zero3.loss_chunk_tokens and not _full_training(shape) and not softcap:
        return _LOSS_COPIES_IN_PLACE
    return _LOSS_COPIES


def local_ranks(world_size: int) -> int:
    """The ranks of a run of ``world_size`` on one host (torchrun's ``LOCAL_WORLD_SIZE``
    when set): whose calibration applies."""
    return min(world_size, max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))


def plan_run(
    opts: TrainOptions,
    zero3: Zero3CpuOffloadConfig,
    calibration: Calibration,
    *,
    peft_config: Any = None,
) -> RunPlan:
    """Predict the run ``opts`` with ``zero3`` (``opts.model`` must be set; its adapters
    are ``opts``'s, or ``peft_config``)."""
    assert opts.model is not None, "the planner needs a transformers model directory"
    world = opts.world_size
    cal = calibration
    peft = peft_config if peft_config is not None else peft_config_of(opts)
    hashed = _Hashed(repr(peft), peft)
    shape = _shape(opts.model, zero3, world, hashed, opts.freeze)
    acts = _probe(str(opts.model), zero3.compute_dtype, hashed, opts.freeze, cal.threads_per_rank)
    memory = _Memory(opts, zero3, shape, acts, cal)
    seconds = _StepTime(opts, zero3, shape, cal, acts).seconds()
    return memory.plan(seconds, opts)


class _Memory:
    """The byte terms of [Note: the plan's memory model] for one run."""

    def __init__(
        self,
        opts: TrainOptions,
        zero3: Zero3CpuOffloadConfig,
        shape: ModelShape,
        acts: LayerActivations,
        cal: Calibration,
    ) -> None:
        self.opts, self.zero3, self.shape, self.acts, self.cal = opts, zero3, shape, acts, cal
        self.item = torch.empty((), dtype=zero3.compute_dtype).element_size()
        self.sequence = zero3.sequence_parallel_size
        self.local_seq = -(-opts.seq_len // self.sequence)
        self.tokens = opts.batch_size * self.local_seq
        self.layers = len(shape.decoder_units)
        self.on_device = torch.device(zero3.device).type != "cpu"

    # -------------------------------------------------------------- terms

    def gathered(self) -> dict[str, int]:
        shape, zero3 = self.shape, self.zero3
        root = shape.gather_bytes(shape.root.name, zero3) if shape.root is not None else 0
        root += max((shape.gather_bytes(u, zero3) for u in shape.other_units), default=0)
        units = [shape.gather_bytes(u, zero3) for u in shape.decoder_units]
        largest = max(units, default=0)
        # The prefetch window and the unit in use, and the last units of the forward
        # kept for backward (one by default on the CPU: the pool's extra buffers).
        kept = _POOL_EXTRA_LAYERS - 1
        if zero3.keep_gathered_bytes and largest:
            kept = zero3.keep_gathered_bytes // largest
        if not zero3.keep_gathered_for_backward:
            kept = 0
        held = min(len(units), zero3.prefetch_buffer_size + 1 + kept)
        window = min(held * largest, zero3.gpu_param_memory_budget)
        trainable = max((shape.layouts[u].padded_numel for u in shape.decoder_units), default=0)
        lossy = zero3.frozen_compression.storage_dtype(zero3.compute_dtype) != zero3.compute_dtype
        scratch = SCRATCH_ELEMENTS * self.item if zero3.frozen_decode_at_use and lossy else 0
        return {
            "decode-at-use scratch": scratch,
            "gathered root unit and head": root,
            "gathered decoder units": window,
            "gradient buffers": 2 * _FP32 * trainable,
        }

    def per_layer(self) -> int:
        """What one decoder layer saves for backward without checkpointing."""
        acts, batch, zero3 = self.acts, self.opts.batch_size, self.zero3
        saved = acts.saved.at(self.local_seq) * batch
        if zero3.mlp_chunk_tokens:
            chunk = min(zero3.mlp_chunk_tokens, self.tokens)
            saved += (
                -acts.mlp.at(self.local_seq) * batch + self.tokens * acts.hidden_bytes_per_token
            )
            saved += acts.mlp.at(chunk)
        return max(saved, 0)

    def activations(self) -> dict[str, int]:
        zero3, acts = self.zero3, self.acts
        one = self.per_layer()
        work = acts.temporaries.at(self.local_seq) * self.opts.batch_size
        if not zero3.activation_checkpointing:
            return {"activations": self.layers * one, "backward working set": work}
        inputs = self.tokens * acts.hidden_bytes_per_token
        selective = min(zero3.selective_checkpointing_units, self.layers)
        products = acts.products.at(self.local_seq) * self.opts.batch_size
        kept = self.layers * inputs
        out: dict[str, int] = {}
        if zero3.offload_activations is OffloadActivations.NVME:
            read_ahead = max(zero3.activation_read_ahead_bytes, inputs)
            out["checkpointed inputs (read ahead from disk)"] = min(kept, read_ahead)
        else:
            out["checkpointed inputs"] = kept
        out["selective products"] = selective * products
        out["recomputed layer"] = one
        # Its forward's temporaries are gone before its backward, which frees its saved
        # tensors as it goes: the larger of the two, not their sum.
        out["backward working set"] = max(0, work - one)
        return out

    def loss(self) -> int:
        vocab = self.shape.dim("vocab_size")
        chunk = self.zero3.loss_chunk_tokens
        tokens = min(chunk, self.tokens) if chunk else self.tokens
        return tokens * vocab * _FP32 * _loss_copies(self.zero3, self.shape)

    def reading(self) -> int:
        """What the load holds on the host besides the model state, read from weights: a
        unit's frozen part read whole (this rank's fp32 shard, encoded into its stored
        copy and let go) and the slice of a file being read into it (``READ_ELEMENTS``
        at most). A trainable shard is read straight into the master it becomes on the
        host; a master on the device is read into a host shard first and copied."""
        layouts = self.shape.layouts.values()
        frozen = max((lay.frozen.shard_numel for lay in layouts if lay.frozen), default=0)
        shard = max((lay.shard_numel for lay in layouts), default=0)
        staged = shard if self.on_device and not self.zero3.offload_params else 0
        return (max(frozen, staged) + min(READ_ELEMENTS, max(frozen, shard))) * _FP32

    def runtime(self) -> int:
        adapters = self.shape.trainable < self.shape.params
        return self.cal.adapter_runtime_rss_bytes if adapters else self.cal.runtime_rss_bytes

    def shared_memory(self) -> int:
        local = min(self.opts.world_size, self.cal.ranks)
        if local < 2 or not self.zero3.shared_memory_collectives or self.on_device:
            return 0
        return 2 * SHARED_MEMORY_BLOCK_BYTES * local  # two blocks per rank

    def data(self) -> int:
        if self.opts.data is not None:
            return 0  # examples: read and tokenized as the steps go
        return int(self.opts.corpus_mb * 1e6) * _TEXT_ITEMSIZE

    def disk(self) -> int:
        zero3, shape = self.zero3, self.shape
        total = 0
        trained = [lay for lay in shape.layouts.values() if lay.numel]
        if zero3.offload_optimizer_device is OffloadDevice.NVME:
            total += sum(disk_record_bytes(zero3, lay.shard_numel) for lay in trained)
        if zero3.offload_param_device is OffloadDevice.NVME:
            codec = ShardCodec(
                zero3.compute_copy_compression(),
                zero3.compute_dtype,
                block_size=zero3.compression_block_size,
            )
            total += sum(aligned(codec.wire_nbytes(lay.shard_numel)) for lay in trained)
        if zero3.offload_activations is OffloadActivations.NVME:
            total += self.layers * self.tokens * self.acts.hidden_bytes_per_token
        return total

    # -------------------------------------------------------------- the plan

    def plan(self, seconds: dict[str, float], opts: TrainOptions) -> RunPlan:
        need = self.shape.cpu_need
        runtime = {
            "runtime (torch, transformers, this library)": self.runtime(),
            "training data": self.data(),
        }
        state = {
            "master shards": need.master,
            "optimizer state": need.optimizer_state,
            "compute copies": need.compute_copies,
            "gradient shards": need.gradients,
            "frozen shards": need.frozen,
            "disk tier buffers": need.disk_tier_buffers,
        }
        step = {
            **self.gathered(),
            **self.activations(),
            "loss chunk": self.loss(),
            "shared memory region": self.shared_memory(),
        }
        device: dict[str, int] = {}
        if self.on_device:  # gathered units, activations and loss live on the device
            device, step = step, {"shared memory region": 0}
            device["model state on the device"] = self.shape.device_state_bytes
        load = {**runtime, **state, "weights being read": self.reading()}
        # One micro-step per update: each layer's gradient shard is made in its backward and
        # updated and let go at once, as its saved activations go: none at the forward's end.
        held = (
            state if self.zero3.gradient_accumulation_steps > 1 else {**state, "gradient shards": 0}
        )
        at_forward_end = {**runtime, **held, **step}
        optimizer = {
            **runtime,
            **state,
            **{k: step.get(k, 0) for k in ("gathered root unit and head",)},
        }
        phases = {
            "load": load,
            "forward end / backward start": at_forward_end,
            "optimizer step": optimizer,
        }
        totals = {name: sum(parts.values()) for name, parts in phases.items()}
        at = max(totals, key=lambda k: totals[k])
        return RunPlan(
            host_peak_bytes=totals[at],
            device_peak_bytes=sum(device.values()),
            disk_bytes=self.disk(),
            host_peak_at=at,
            device_peak_at="forward end / backward start" if device else "",
            breakdown={k: v for k, v in phases[at].items() if v},
            device_breakdown={k: v for k, v in device.items() if v},
            phases=totals,
            predicted_step_s=sum(seconds.values()),
            step_breakdown=seconds,
            config=self.zero3.to_dict(),
            train={
                "model": opts.model,
                "world_size": opts.world_size,
                "batch_size": opts.batch_size,
                "seq_len": opts.seq_len,
                "lora": opts.lora.describe() if opts.lora is not None else None,
                "peft_config": opts.peft_config,
                "freeze": ",".join(opts.freeze) if opts.freeze else None,
                "layers": self.layers,
                "units": len(self.shape.layouts),
                "largest_unit": max(
                    (lay.param_numel for lay in self.shape.layouts.values()), default=0
                ),
            },
            params=self.shape.params,
            trainable=self.shape.trainable,
        )


class _StepTime:
    """Seconds of one optimizer step, by kind of work: the model's own layer as timed by
    the probe (compute), the new memory its large tensors map, the calibrated per-unit
    time, collectives, the optimizer, the disk tiers and frozen-weight decoding."""

    def __init__(
        self,
        opts: TrainOptions,
        zero3: Zero3CpuOffloadConfig,
        shape: ModelShape,
        cal: Calibration,
        acts: LayerActivations,
    ) -> None:
        self.opts, self.zero3, self.shape, self.cal, self.acts = opts, zero3, shape, cal, acts

    def line(self, full: bool) -> tuple[float, float]:
        """Seconds of one decoder layer's training step as ``fixed + FLOPs / rate``: the
        line through the one-layer model's two timed steps (``plan.activation_probe``,
        this process alone, their page faults taken out), the rate slowed as the
        calibration's decoder layer is slowed with every local rank busy."""
        acts, hidden = self.acts, self.shape.dim("hidden_size")
        points = []
        for tokens, seconds, faulted in zip(
            acts.step_tokens, acts.step_seconds, acts.step_faulted_bytes, strict=True
        ):
            flops = (2 * tokens * acts.layer_params + 2 * tokens * tokens * hidden) * (
                3 if full else 2
            )
            points.append((flops, max(seconds - faulted / self.cal.fresh_bytes_per_s, 1e-9)))
        (f0, s0), (f1, s1) = points
        per_flop = (s1 - s0) / (f1 - f0) if f1 > f0 and s1 > s0 else s1 / f1
        fixed = max(s1 - per_flop * f1, 0.0)
        return fixed, self.cal.busy(self.zero3.compute_dtype) / per_flop

    def fresh_bytes(self, recomputed: float) -> float:
        """Bytes of one micro-step's tensors of ``TRAIN_MMAP_THRESHOLD`` or more (each
        mapped, faulted in and unmapped again): the decoder layers' forward, backward and
        ``recomputed`` forwards (from ``plan.activation_probe``), and the loss's logits."""
        opts, zero3, shape = self.opts, self.zero3, self.shape
        rows = opts.batch_size
        tokens = opts.seq_len // zero3.sequence_parallel_size
        forward, backward = self.acts.large_outputs(tokens, TRAIN_MMAP_THRESHOLD // rows)
        layers = len(shape.decoder_units) * rows * (forward * (1 + recomputed) + backward)
        chunk = min(zero3.loss_chunk_tokens or tokens, tokens) * rows
        logits = chunk * shape.dim("vocab_size") * _FP32
        # fp32 logits and their log-softmax (the gradient written over the logits), or
        # the logits in the forward and again, with their gradient, in the backward.
        copies = _loss_copies(zero3, shape)
        loss = copies * logits * (rows * tokens / chunk) if logits >= TRAIN_MMAP_THRESHOLD else 0
        return layers + loss

    def seconds(self) -> dict[str, float]:
        opts, zero3, shape, cal = self.opts, self.zero3, self.shape, self.cal
        accum = zero3.gradient_accumulation_steps
        sequence = zero3.sequence_parallel_size
        tokens = opts.batch_size * opts.seq_len / sequence  # per rank and micro-step
        hidden = shape.dim("hidden_size")
        layers = len(shape.decoder_units)
        vocab = shape.dim("vocab_size")
        decoder = sum(shape.layouts[u].param_numel for u in shape.decoder_units)
        # Matrix products: 2 FLOPs per weight and token, and attention's QK^T and AV
        # over the causal half of each sequence.
        head = 2 * tokens * vocab * hidden
        forward = 2 * tokens * decoder + head
        forward += 2 * tokens * opts.seq_len * hidden * layers
        full = _full_training(shape)
        backward = 2 * forward if full else forward
        recompute = skipped = 0.0
        if zero3.activation_checkpointing:
            share = 1 - 0.85 * zero3.selective_checkpointing_units / max(layers, 1)
            recompute = forward * share
            # Products the line counts that are not computed again, at the matrix
            # product's rate: a recomputation stops at the layer's last saved tensor, so
            # the MLP's down-projection (its output only feeds the residual) is not
            # recomputed; a frozen head's gradient is taken in the forward, so its loss
            # computes no logits again (see execution.tiled_loss).
            skipped = 2 * tokens * shape.dim("intermediate_size") * hidden * layers * share
            skipped += 0.0 if full else head
        if zero3.mlp_chunk_tokens:
            recompute += forward * 0.6
        fixed, rate = self.line(full)
        passes = (1 + recompute / forward) * accum  # the layers' steps, recomputation in
        compute = (forward + backward + recompute) * accum / rate + fixed * layers * passes
        compute -= skipped * accum / cal.matmul_rate(zero3.compute_dtype)
        fresh = self.fresh_bytes(recompute / forward) * accum / cal.fresh_bytes_per_s
        item = torch.empty((), dtype=zero3.compute_dtype).element_size()
        world = opts.world_size
        gathered = sum(shape.gather_bytes(u, zero3) for u in shape.decoder_units)
        wire = (world - 1) / world if world > 1 else 0.0
        same_host = zero3.shared_memory_collectives and torch.device(zero3.device).type == "cpu"
        bandwidth = cal.shared_gather_bytes_per_s if same_host else cal.gather_bytes_per_s
        communication = 2 * gathered * wire * accum / bandwidth
        communication += _FP32 * shape.trainable * wire * accum / bandwidth
        if sequence > 1:  # all-to-alls around attention: q, k, v and the output
            communication += 4 * tokens * hidden * item * layers * 3 * accum / cal.copy_bytes_per_s
        shard = sum(lay.shard_numel for lay in shape.layouts.values())
        frozen = sum(lay.frozen.padded_numel for lay in shape.layouts.values() if lay.frozen)
        decode = 0.0
        lossy = zero3.frozen_compression.storage_dtype(zero3.compute_dtype) != zero3.compute_dtype
        if lossy:  # decoded at each gather (forward and backward), or at each use
            # at use: the forward, the recomputation (checkpointed) and the backward
            at_use = 3 if zero3.activation_checkpointing else 2
            passes = at_use if zero3.frozen_decode_at_use else 2
            rate = cal.decode_rate(zero3.frozen_compression)
            decode = passes * frozen * accum / rate
        trainable_shard = sum(lay.shard_numel for lay in shape.layouts.values() if lay.numel)
        optimizer = 8 * _FP32 * trainable_shard / cal.copy_bytes_per_s
        disk = 0.0
        if zero3.offload_optimizer_device is OffloadDevice.NVME:
            record = 3 * _FP32 * trainable_shard
            disk += record / cal.disk_read_bytes_per_s + record / cal.disk_write_bytes_per_s
        if zero3.offload_param_device is OffloadDevice.NVME:
            disk += 2 * item * shard / cal.disk_read_bytes_per_s
        if zero3.offload_activations is OffloadActivations.NVME:
            spilled = layers * tokens * hidden * item * accum
            disk += spilled / cal.disk_write_bytes_per_s + spilled / cal.disk_read_bytes_per_s
        return {
            "compute": compute,
            "new memory": fresh,
            "per unit": cal.unit_overhead_s * len(shape.layouts) * accum,
            "collectives": communication,
            "optimizer": optimizer,
            "disk": disk,
            "frozen decode": decode,
        }
