"""Errors raised by the engine cores (``PrefillBatcher``, ``DecodeBatcher``).

Hierarchy::

    BatcherError
    ├── DuplicateRequestError   (also a ValueError)
    ├── InvalidRequestError     (also a ValueError)
    ├── KvCapacityError         (also a ValueError)
    └── BatchOrderError         (also a RuntimeError)
"""

from __future__ import annotations

__all__ = ["BatchOrderError", "BatcherError", "DuplicateRequestError", "InvalidRequestError", "KvCapacityError"]


class BatcherError(Exception):
    """Base class of every error the engine cores raise."""


class DuplicateRequestError(BatcherError, ValueError):
    """Raised when a request is added to a batcher that already holds it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r} is already on this engine")


class InvalidRequestError(BatcherError, ValueError):
    """Raised when a request's token counts are impossible (no token to compute, a negative
    count, a cached prefix longer than the prompt)."""

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"invalid request {request_id!r}: {reason}")


class KvCapacityError(BatcherError, ValueError):
    """Raised by ``DecodeBatcher.add`` when a request needs more KV memory than the engine has
    in all (it could never be admitted, however long it waited)."""

    def __init__(self, request_id: str, needed: int, capacity: int) -> None:
        self.request_id = request_id
        self.needed = needed
        self.capacity = capacity
        super().__init__(f"request {request_id!r} needs {needed} tokens of KV memory; the engine holds {capacity}")


class BatchOrderError(BatcherError, RuntimeError):
    """Raised when a driver steps ``PrefillBatcher`` out of order: asks for a batch while the
    previous one is not reported finished or failed (an engine runs one batch at a time), or
    reports a batch when none is in flight."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)
