"""``RunPlan``: the predicted memory and time of one training run, per rank."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["RunPlan"]


@attrs.frozen(kw_only=True)
class RunPlan:
    """What one rank (the largest) of a run is predicted to hold and take.

    Byte figures are whole-process figures: ``host_peak_bytes`` is the peak resident
    set (``VmHWM``) over loading the model and training, the larger of the two.
    """

    host_peak_bytes: int
    device_peak_bytes: int  # 0 on the CPU device (the host is the device)
    disk_bytes: int  # the disk tiers' files and offloaded activations
    host_peak_at: str  # where in the run the host peak falls
    device_peak_at: str
    breakdown: dict[str, int]  # what the host peak holds, by name
    device_breakdown: dict[str, int]
    phases: dict[str, int]  # host bytes at each point of a step (and the load)
    predicted_step_s: float
    step_breakdown: dict[str, float]  # seconds by kind of work
    config: dict[str, Any]  # Zero3CpuOffloadConfig.to_dict() of the plan
    train: dict[str, Any]  # the run: world size, batch, sequence, adapters
    params: int
    trainable: int

    def to_json(self) -> dict[str, Any]:
        """The plan as ``zero3-offload plan --json`` prints it."""
        return {
            "host_peak_bytes": self.host_peak_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "disk_bytes": self.disk_bytes,
            "host_peak_at": self.host_peak_at,
            "device_peak_at": self.device_peak_at,
            "breakdown": dict(self.breakdown),
            "device_breakdown": dict(self.device_breakdown),
            "phases": dict(self.phases),
            "predicted_step_s": self.predicted_step_s,
            "step_breakdown": dict(self.step_breakdown),
            "params": self.params,
            "trainable": self.trainable,
            "train": dict(self.train),
            "config": dict(self.config),
        }
