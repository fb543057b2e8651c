"""Answers "which layout?" before a GPU is used: a memory model and a step-time model
(``memory``, ``step_time``, over each block's parameters, activations and FLOPs in ``blocks``,
constants in ``constants``), the planner that ranks layouts
(``planner``, ``python -m dtrain.plan``) and the dry run of a recipe on a fake process group
(``dry_run``, ``python -m dtrain.train --dry-run``)."""

from dtrain.plan.constants import H200, Constants
from dtrain.plan.memory import Layout, MemoryEstimate, Workload, estimate_memory
from dtrain.plan.planner import Candidate, Cluster, plan
from dtrain.plan.step_time import TimeEstimate, estimate_time

__all__ = ["H200", "Candidate", "Cluster", "Constants", "Layout", "MemoryEstimate",
           "TimeEstimate", "Workload", "estimate_memory", "estimate_time", "plan"]
