"""Errors raised by the roofline cost model.

Hierarchy::

    CostModelError
    ├── UnknownTargetError   (also a LookupError)
    ├── TargetConfigError    (also a LookupError)
    ├── UnknownGpuError      (also a LookupError)
    ├── InvalidWorkloadError (also a ValueError)
    └── ModelDoesNotFitError
"""

from __future__ import annotations

__all__ = [
    "CostModelError",
    "InvalidWorkloadError",
    "ModelDoesNotFitError",
    "TargetConfigError",
    "UnknownGpuError",
    "UnknownTargetError",
]


class CostModelError(Exception):
    """Base class of every error the cost model raises."""


class UnknownTargetError(CostModelError, LookupError):
    """Raised when a target is neither a name in ``TARGETS`` nor an existing path; the
    message lists valid names."""

    def __init__(self, name: str, valid: list[str]) -> None:
        self.name = name
        self.valid = sorted(valid)
        super().__init__(f"unknown target model {name!r}; valid targets: {', '.join(self.valid)}, or a path to a config.json")


class TargetConfigError(CostModelError, LookupError):
    """Raised when a target's ``config.json`` is missing or unreadable, or describes an
    architecture ``ModelConfig`` does not support; ``reason`` says which."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"target {path}: {reason}")


class UnknownGpuError(CostModelError, LookupError):
    """Raised when a GPU profile name is not in ``GPUS``; the message lists valid names."""

    def __init__(self, name: str, valid: list[str]) -> None:
        self.name = name
        self.valid = sorted(valid)
        super().__init__(f"unknown GPU profile {name!r}; valid GPUs: {', '.join(self.valid)}")


class InvalidWorkloadError(CostModelError, ValueError):
    """Raised when a batch or request has impossible token counts (negative cached or
    context tokens, fewer than one new token) or a parameter is out of range."""

    def __init__(self, what: str, value: object) -> None:
        self.what = what
        self.value = value
        super().__init__(f"invalid {what}: {value!r}")


class ModelDoesNotFitError(CostModelError):
    """Raised when one GPU's share of the weights leaves no HBM for KV-cache."""

    def __init__(self, target: str, weight_bytes: int, usable_bytes: int) -> None:
        self.target = target
        self.weight_bytes = weight_bytes
        self.usable_bytes = usable_bytes
        super().__init__(
            f"{target}: {weight_bytes / 1e9:.1f} GB of weights per GPU exceed the "
            f"{usable_bytes / 1e9:.1f} GB of usable HBM; raise expert parallelism (ep)"
        )
