"""Planning a run: its predicted peak memory, disk and step time per rank
(:func:`plan`), and the fastest configuration that fits a memory budget
(:func:`choose_config`; for a manager, :class:`MemoryBudget` and
:func:`config_for_budget`). See docs/planning.md."""

from zero3_offload.plan.budget_config import config_for_budget
from zero3_offload.plan.budget_search import HEADROOM, BudgetChoice, NothingFitsError, choose_config
from zero3_offload.plan.calibrate import load_or_measure, measure
from zero3_offload.plan.calibration import Calibration
from zero3_offload.plan.memory_budget import MemoryBudget
from zero3_offload.plan.plan_model import plan
from zero3_offload.plan.planner import plan_run
from zero3_offload.plan.run_plan import RunPlan

__all__ = [
    "HEADROOM",
    "BudgetChoice",
    "Calibration",
    "MemoryBudget",
    "NothingFitsError",
    "RunPlan",
    "choose_config",
    "config_for_budget",
    "load_or_measure",
    "measure",
    "plan",
    "plan_run",
]
