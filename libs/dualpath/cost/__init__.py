"""Roofline cost model of target models on target GPUs.

Used by the ``modeled`` compute backend (how long a prefill layer or decode step takes),
by the scheduler (attention time against the intra-engine quota, beta) and by the
simulator. ``cost_model("ds660b")`` is the usual entry point; formulas are documented in
``dualpath.cost.model``.
"""

from dualpath.cost.errors import (
    CostModelError,
    InvalidWorkloadError,
    ModelDoesNotFitError,
    UnknownGpuError,
    UnknownTargetError,
)
from dualpath.cost.gpu import GPUS, GpuProfile, get_gpu
from dualpath.cost.model import CostModel, cost_model
from dualpath.cost.targets import TARGETS, ModelTarget, get_target

__all__ = [
    "GPUS",
    "TARGETS",
    "CostModel",
    "CostModelError",
    "GpuProfile",
    "InvalidWorkloadError",
    "ModelDoesNotFitError",
    "ModelTarget",
    "UnknownGpuError",
    "UnknownTargetError",
    "cost_model",
    "get_gpu",
    "get_target",
]
