"""Errors raised by the tenant library (API keys, their tenants, per-tenant limits).

Hierarchy::

    TenantError
    ├── KeyFileError     (also a ValueError)
    └── RateLimitedError
"""

from __future__ import annotations

import math

__all__ = ["KeyFileError", "RateLimitedError", "TenantError"]


class TenantError(Exception):
    """Base class of every error the tenant library raises."""


class KeyFileError(TenantError, ValueError):
    """Raised when an API key file cannot be read or a line of it is malformed: a line
    without a tenant, a bad tenant name, an unknown or malformed option, a key listed twice,
    one tenant given two different limits, or a file with no key at all. ``line`` is the
    1-based line number (0 when the file as a whole is at fault). The message never holds a
    key: keys are secrets and error messages end up in logs."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}, line {line}" if line else path
        super().__init__(f"API key file {where}: {reason}")


class RateLimitedError(TenantError):
    """Raised at admission when a tenant is over one of its limits: ``limit`` is
    ``"max_concurrency"`` (as many requests in flight as it may have) or ``"tokens_per_minute"``
    (its token budget is spent); ``retry_after_s`` is when to come back (whole seconds, at
    least 1, what HTTP's ``Retry-After`` carries)."""

    def __init__(self, tenant: str, limit: str, allowed: int, retry_after_s: float) -> None:
        self.tenant, self.limit, self.allowed = tenant, limit, allowed
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        what = f"{allowed} requests in flight" if limit == "max_concurrency" else f"{allowed} tokens per minute"
        who = f"tenant {tenant!r}" if tenant else "this gateway"
        super().__init__(f"rate limit reached: {who} allows {what} ({limit}); retry after {self.retry_after_s} s")
