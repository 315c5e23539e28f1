"""Errors raised by the scheduling policy library.

Hierarchy::

    PolicyError
    ├── InvalidRequestError     (also a ValueError)
    ├── InvalidTopologyError    (also a ValueError)
    ├── InvalidThresholdError   (also a ValueError)
    ├── UnknownPolicyError      (also a LookupError)
    ├── UnknownEngineError      (also a LookupError)
    ├── UnknownNodeError        (also a LookupError)
    ├── UnknownRequestError     (also a LookupError)
    ├── DuplicateRequestError   (also a ValueError)
    ├── RoleMismatchError       (also a ValueError)
    ├── InsufficientHbmError
    ├── EmptyValuesError        (also a ValueError)
    ├── NegativeLoadError       (also a ValueError)
    └── UnknownMemberError      (also a LookupError)
"""

from __future__ import annotations

__all__ = [
    "DuplicateRequestError",
    "EmptyValuesError",
    "InsufficientHbmError",
    "InvalidRequestError",
    "InvalidThresholdError",
    "InvalidTopologyError",
    "NegativeLoadError",
    "PolicyError",
    "RoleMismatchError",
    "UnknownEngineError",
    "UnknownMemberError",
    "UnknownNodeError",
    "UnknownPolicyError",
    "UnknownRequestError",
]


class PolicyError(Exception):
    """Base class of every error the policy library raises."""


class InvalidRequestError(PolicyError, ValueError):
    """Raised when a pending request's token counts are impossible (negative, a hit that
    leaves no token to compute, or a total length shorter than the prompt)."""

    def __init__(self, request_id: int, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"invalid request {request_id}: {reason}")


class InvalidTopologyError(PolicyError, ValueError):
    """Raised when a cluster description is inconsistent: no engines of a role, an engine
    listed twice, an empty node, or a negative capacity."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"invalid cluster topology: {reason}")


class InvalidThresholdError(PolicyError, ValueError):
    """Raised when a threshold input (bandwidth, bytes per token, window, quota) is not
    positive or a derived threshold is negative."""

    def __init__(self, name: str, value: object) -> None:
        self.name = name
        self.value = value
        super().__init__(f"invalid {name}: {value!r} (must be positive)")


class UnknownPolicyError(PolicyError, LookupError):
    """Raised by ``get_policy`` for a policy or read-path name it does not know."""

    def __init__(self, name: str, valid: list[str]) -> None:
        self.name = name
        self.valid = sorted(valid)
        super().__init__(f"unknown policy {name!r}; valid: {', '.join(self.valid)}")


class UnknownEngineError(PolicyError, LookupError):
    """Raised when a report or an assignment names an engine the cluster does not have."""

    def __init__(self, engine_id: int) -> None:
        self.engine_id = engine_id
        super().__init__(f"unknown engine {engine_id}")


class UnknownNodeError(PolicyError, LookupError):
    """Raised when a report names a node the cluster does not have."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        super().__init__(f"unknown node {node_id}")


class UnknownRequestError(PolicyError, LookupError):
    """Raised when a completion names a request that is not live (never assigned, or
    already finished)."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id} is not live in the cluster state")


class DuplicateRequestError(PolicyError, ValueError):
    """Raised when an assignment is applied for a request that is already live."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id} is already assigned")


class RoleMismatchError(PolicyError, ValueError):
    """Raised when an assignment names a decode engine as its prefill engine, or the
    reverse."""

    def __init__(self, engine_id: int, expected: str) -> None:
        self.engine_id = engine_id
        self.expected = expected
        super().__init__(f"engine {engine_id} is not a {expected} engine")


class InsufficientHbmError(PolicyError):
    """Raised when an assignment is applied to a decode engine whose free HBM is smaller
    than the request's reservation (a stale decision applied after the state moved)."""

    def __init__(self, engine_id: int, needed: int, free: int) -> None:
        self.engine_id = engine_id
        self.needed = needed
        self.free = free
        super().__init__(f"decode engine {engine_id} has {free} free HBM tokens, needs {needed}")


class EmptyValuesError(PolicyError, ValueError):
    """Raised by the load-balance helpers when asked for a ratio over no values."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"max/avg of {what}: no values")


class NegativeLoadError(PolicyError, ValueError):
    """Raised by the load-balance helpers for a negative load (bytes or seconds)."""

    def __init__(self, what: str, value: float) -> None:
        self.what = what
        self.value = value
        super().__init__(f"{what}: negative load {value}")


class UnknownMemberError(PolicyError, LookupError):
    """Raised when a load is added for a member the accumulator was not built with."""

    def __init__(self, what: str, member: object) -> None:
        self.what = what
        self.member = member
        super().__init__(f"{what}: unknown member {member!r}")
