"""Layout and memory planner behind `rlhf-megatron plan` (docs/PLANNER.md).

shapes.py (parameter counts per rank) and memory.py (byte formulas) are pure; checks.py and
estimate.py apply them to a TrainConfig on a Cluster; plan.py gives the verdict, suggest.py
searches a layout that fits, report.py renders it and command.py is the CLI.
"""

from rlhf_megatron.planner.cluster import Cluster, Finding
from rlhf_megatron.planner.plan import PlanReport, Suggestion
from rlhf_megatron.planner.shapes import ModelShape, stage_params
from rlhf_megatron.planner.suggest import plan_config

__all__ = ["Cluster", "Finding", "ModelShape", "PlanReport", "Suggestion", "plan_config",
           "stage_params"]
