"""The engine: the manager's wired components and its step state."""

from zero3_offload.engine.engine import Engine, build_engine
from zero3_offload.engine.step_state import StepState

__all__ = ["Engine", "StepState", "build_engine"]
