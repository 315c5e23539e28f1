"""``TenantLimiter``: per-tenant admission limits on requests in flight and tokens per minute.

A pure state machine: the gateway passes the clock (``now``, monotonic seconds) into every
call, so tests drive it without sleeping.

- **max_concurrency**: a tenant may have this many requests admitted and not yet finished; one
  more is refused (retry after 1 s: when a request ends is not known in advance).
- **tokens_per_minute**: a token bucket of that many tokens, refilled continuously at a
  sixtieth of it per second and full at the start. Admission takes the prompt's tokens out;
  generated tokens are taken as they stream (the bucket may go below zero: an answer is never
  cut short). A request is admitted while the bucket holds its prompt (or is full, for a
  prompt larger than the whole budget); otherwise the refusal says when the refill will have
  brought it there. This is how LiteLLM's ``tpm_limit`` counts, prompt and completion alike.

A request's lease is released by ``release`` (idempotent). A lease that outlives ``lease_ttl_s``
(an answer whose end the gateway never saw) stops counting, so that a lost release cannot
lock a tenant out for good.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dualpath.tenant.errors import RateLimitedError
from dualpath.tenant.keys import TenantLimits

__all__ = ["TenantLimiter"]

_CONCURRENCY_RETRY_S = 1.0


@dataclass(slots=True)
class _Tenant:
    limits: TenantLimits
    in_flight: dict[str, float] = field(default_factory=dict)  # request id -> admitted at
    level: float = 0.0  # tokens in the bucket (may be negative)
    at: float | None = None  # when ``level`` was last brought up to date (None: never used)


class TenantLimiter:
    """Admission limits per tenant: ``defaults`` for every tenant, ``per_tenant`` overrides."""

    def __init__(self, defaults: TenantLimits, per_tenant: Mapping[str, TenantLimits] | None = None, *, lease_ttl_s: float) -> None:
        """Raises ValueError: a limit is negative or ``lease_ttl_s`` is not positive."""
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        for who, lim in {"defaults": defaults, **(per_tenant or {})}.items():
            if (lim.max_concurrency or 0) < 0 or (lim.tokens_per_minute or 0) < 0:
                raise ValueError(f"limits of {who} must be >= 0 (0: no limit), got {lim}")
        self.defaults = defaults
        self.per_tenant = dict(per_tenant or {})
        self.lease_ttl_s = lease_ttl_s
        self._tenants: dict[str, _Tenant] = {}
        self._leases: dict[str, str] = {}  # request id -> tenant

    @property
    def active(self) -> bool:
        """False when no tenant has any limit (admission need not be asked)."""
        return any(lim.max_concurrency or lim.tokens_per_minute for lim in (self.defaults, *self.per_tenant.values()))

    def limits_of(self, tenant: str) -> TenantLimits:
        """``tenant``'s limits, every one resolved (0: no limit)."""
        lim = self.per_tenant.get(tenant, TenantLimits()).over(self.defaults)
        return TenantLimits(max_concurrency=lim.max_concurrency or 0, tokens_per_minute=lim.tokens_per_minute or 0)

    def _state(self, tenant: str) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(self.limits_of(tenant))
        return state

    def _refill(self, state: _Tenant, now: float) -> None:
        budget = state.limits.tokens_per_minute or 0
        if state.at is None:
            state.level = float(budget)
        else:
            state.level = min(float(budget), state.level + max(0.0, now - state.at) * budget / 60.0)
        state.at = now

    def admit(self, request_id: str, tenant: str, prompt_tokens: int, now: float) -> None:
        """Admit ``request_id`` of ``tenant`` with ``prompt_tokens`` or refuse it.

        Raises:
            RateLimitedError: the tenant is at its ``max_concurrency`` or out of
                ``tokens_per_minute``; nothing is counted then.
        """
        state = self._state(tenant)
        limits = state.limits
        if limits.max_concurrency:
            for rid in [r for r, t in state.in_flight.items() if now - t > self.lease_ttl_s]:
                del state.in_flight[rid]  # a lease whose release was lost stops counting
                self._leases.pop(rid, None)
            if len(state.in_flight) >= limits.max_concurrency:
                raise RateLimitedError(tenant, "max_concurrency", limits.max_concurrency, _CONCURRENCY_RETRY_S)
        budget = limits.tokens_per_minute or 0
        if budget:
            self._refill(state, now)
            need = min(prompt_tokens, budget)
            if state.level < need:
                raise RateLimitedError(tenant, "tokens_per_minute", budget, (need - state.level) * 60.0 / budget)
            state.level -= prompt_tokens
        if limits.max_concurrency:
            state.in_flight[request_id] = now
            self._leases[request_id] = tenant
        elif budget:
            self._leases[request_id] = tenant  # generated tokens are still charged

    def charge(self, request_id: str, tokens: int, now: float) -> None:
        """``tokens`` more were generated for ``request_id`` (ignored unless it holds a lease)."""
        tenant = self._leases.get(request_id)
        if tenant is None or not tokens:
            return
        state = self._tenants[tenant]
        if state.limits.tokens_per_minute:
            self._refill(state, now)
            state.level -= tokens

    def release(self, request_id: str) -> None:
        """``request_id`` ended (answered, failed or abandoned); a second call does nothing."""
        tenant = self._leases.pop(request_id, None)
        if tenant is not None:
            self._tenants[tenant].in_flight.pop(request_id, None)

    def in_flight(self, tenant: str) -> int:
        """Requests of ``tenant`` holding a concurrency lease."""
        state = self._tenants.get(tenant)
        return len(state.in_flight) if state is not None else 0
