"""What a training run was started with (``OUT/run.json``), and whether a restart agrees.

``zero3-offload train --out DIR`` writes the record when it starts a run (no checkpoint in
``DIR/checkpoints`` yet). A later start with the same ``DIR`` whose checkpoints exist
resumes from the latest one by itself when its options agree with the record: every
option except those that do not change the numbers of a step (:data:`MAY_DIFFER`: the
step count to reach, logging, evaluation, saving, threads, memory placement and
budgets, timeouts, overlap). A restart whose options differ is refused, naming each one
with its two values.

The global batch, ``ranks x batch_size x gradient_accumulation_steps`` sequences per
step, must agree rather than each factor: a restart on fewer (or more) ranks takes the
accumulation that keeps it (4 ranks x 8 x 1 on 2 ranks: accumulation 2), and is refused
when none does. Each sequence of a step depends on its global position only (see
``train.corpus``), so such a restart trains on the same data.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs

from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.train.options import OPTIONS, TrainOptions
from zero3_offload.train.sources import OptionError

__all__ = ["MAY_DIFFER", "RunRecord"]

FILE = "run.json"
# Options a restart may change: they do not change the numbers of a step.
MAY_DIFFER = frozenset(
    {
        # the run's length and what it prints, evaluates, saves and exports
        "steps",
        "world_size",
        "eval_every",
        "eval_batches",
        "log_every",
        "save_every",
        "out",
        "resume",
        "export",
        "threads",
        "progress",
        "log_level",
        # where state lives, how much memory it may take, how the work overlaps
        "offload_params",
        "offload_grads",
        "offload_optimizer_states",
        "cpu_memory_budget",
        "gpu_param_memory_budget",
        "max_gpu_memory_mb",
        "max_cpu_memory_mb",
        "prefetch_buffer_size",
        "async_prefetch",
        "overlap_computation",
        "pin_cpu_memory",
        "auto_memory_management",
        "device",
        "collective_timeout_s",
        "heartbeat_timeout_s",
        "divergence_check",
        "cpu_worker_threads",
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "activation_checkpointing",
        "selective_checkpointing_units",
        "sequence_parallel_size",  # the record counts data-parallel ranks (world / S)
        "speculative_step",
        "keep_gathered_for_backward",
        "keep_gathered_bytes",
        "shared_memory_collectives",
        "offload_optimizer_device",
        "offload_param_device",
        "offload_activations",
        "activation_read_ahead_bytes",
        "nvme_path",
        "nvme_replace_stale",
        "max_consecutive_nonfinite",
        # agreed as the global batch instead (see the module docstring)
        "gradient_accumulation_steps",
    }
)


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))


@attrs.frozen
class RunRecord:
    """The options of a run by name (JSON values) and the data-parallel ranks it ran on
    (the world's ranks over ``sequence_parallel_size``)."""

    options: dict[str, Any]
    world_size: int

    @classmethod
    def of(cls, train: TrainOptions, zero3: Zero3CpuOffloadConfig, world_size: int) -> RunRecord:
        """The record of a run started with these options on ``world_size`` ranks."""
        values = attrs.asdict(train) | zero3.to_dict()
        optimizer = values.pop("optimizer")
        values |= {f"optimizer_{key}": value for key, value in optimizer.items()}
        return cls(options=_json(values), world_size=world_size)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks and micro-steps."""
        return (
            self.world_size
            * self.options["batch_size"]
            * self.options["gradient_accumulation_steps"]
        )

    def save(self, out: Path) -> None:
        """Write ``out/run.json`` (atomically: a reader sees the old file or the new one)."""
        out.mkdir(parents=True, exist_ok=True)
        part = out / f".{FILE}.{os.getpid()}.part"
        part.write_text(json.dumps({"world_size": self.world_size, "options": self.options}))
        part.replace(out / FILE)

    @classmethod
    def load(cls, out: Path) -> RunRecord | None:
        """The record in ``out`` (None when there is none).

        Raises:
            OptionError: for a file that is not a record.
        """
        path = out / FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(options=dict(data["options"]), world_size=int(data["world_size"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise OptionError(
                f"{path}: not a run record ({exc}); remove it or give another --out"
            ) from None

    def differences(self, now: RunRecord) -> list[str]:
        """The options of ``now`` that differ from this run's, as ``--flag (run, now)``."""
        out = []
        for name in sorted(set(self.options) | set(now.options)):
            if name in MAY_DIFFER:
                continue
            was, got = self.options.get(name), now.options.get(name)
            if was != got:
                flag = OPTIONS[name].flag if name in OPTIONS else name
                out.append(f"{flag} ({was!r} in the run, {got!r} now)")
        return out

    def resume_config(
        self, now: RunRecord, zero3: Zero3CpuOffloadConfig, where: Path
    ) -> tuple[Zero3CpuOffloadConfig, str | None]:
        """``zero3`` for resuming this run as ``now`` asks, and a line to print when the
        accumulation changed to keep the global batch (else None).

        Raises:
            OptionError: when an option that defines the run differs (each is named), or
                the global batch cannot be kept on ``now``'s ranks.
        """
        different = self.differences(now)
        if different:
            raise OptionError(
                f"--out {where} holds checkpoints of another run: "
                f"{', '.join(different)}; give the run's values to resume it, or another --out"
            )
        asked = now.options["gradient_accumulation_steps"]
        if now.world_size == self.world_size:
            if asked != self.options["gradient_accumulation_steps"]:
                raise OptionError(
                    f"--out {where} holds checkpoints of another run: "
                    f"--gradient-accumulation-steps "
                    f"({self.options['gradient_accumulation_steps']!r} in the run, "
                    f"{asked!r} now); give the run's value to resume it, or another --out"
                )
            return zero3, None
        per_step = now.world_size * now.options["batch_size"]
        accumulation, rest = divmod(self.global_batch, per_step)
        if rest or accumulation < 1:
            raise OptionError(
                f"--out {where}: the run's global batch of {self.global_batch} sequences "
                f"({self.world_size} ranks x --batch-size {self.options['batch_size']} x "
                f"accumulation {self.options['gradient_accumulation_steps']}) cannot be kept on "
                f"{now.world_size} ranks: it is not a multiple of {now.world_size} x "
                f"{now.options['batch_size']}; resume on a number of ranks that divides it"
            )
        if asked not in (accumulation, self.options["gradient_accumulation_steps"]):
            raise OptionError(
                f"--gradient-accumulation-steps={asked} is invalid: resuming {where} on "
                f"{now.world_size} ranks keeps its global batch of {self.global_batch} "
                f"sequences with accumulation {accumulation}; leave the flag as the run had it"
            )
        note = (
            f"resuming the run of {self.world_size} ranks on {now.world_size}: gradient "
            f"accumulation {accumulation} keeps its global batch of {self.global_batch} sequences"
        )
        return zero3.evolve(gradient_accumulation_steps=accumulation), note
