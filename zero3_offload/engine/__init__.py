"""The engine: the manager's wired components, its step state, and argument checks."""

from zero3_offload.engine.engine import Engine, build_engine
from zero3_offload.engine.step_state import StepState

__all__ = ["Engine", "StepState", "build_engine"]
