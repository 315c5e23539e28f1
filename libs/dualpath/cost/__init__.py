"""Roofline cost model of target models on target GPUs.

Used by the ``modeled`` compute backend (how long a prefill layer or decode step takes),
by the scheduler (attention time against the intra-engine quota, beta) and by the
simulator. ``cost_model("ds660b")`` (or ``cost_model("path/to/config.json")``) is the usual
entry point; targets are ``config.json`` files (``dualpath.cost.targets``), flattened by
``dualpath.cost.arch``; the roofline is documented in ``dualpath.cost.model``.
"""

from dualpath.cost.errors import (
    CostModelError,
    InvalidWorkloadError,
    ModelDoesNotFitError,
    TargetConfigError,
    UnknownGpuError,
    UnknownTargetError,
)
from dualpath.cost.gpu import GPUS, GpuProfile, get_gpu
from dualpath.cost.model import CostModel, cost_model
from dualpath.cost.targets import NAMED_TARGETS, TARGETS, ModelTarget, get_target, load_target, resolve_target

__all__ = [
    "GPUS",
    "NAMED_TARGETS",
    "TARGETS",
    "CostModel",
    "CostModelError",
    "GpuProfile",
    "InvalidWorkloadError",
    "ModelDoesNotFitError",
    "ModelTarget",
    "TargetConfigError",
    "UnknownGpuError",
    "UnknownTargetError",
    "cost_model",
    "get_gpu",
    "get_target",
    "load_target",
    "resolve_target",
]
