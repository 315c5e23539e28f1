"""The gateway's tenants: who a request comes from (its API key) and whether it may run now.

Keys come from ``--api-key`` (one key, tenant ``default``) and ``--api-key-file`` (``KEY TENANT
[max_concurrency=N] [tokens_per_minute=N]`` lines, ``dualpath.tenant.keys``). With neither,
the gateway is open and every request belongs to the empty tenant, whose prompts hash as they
always have. A tenant is what the KV cache is partitioned by (``dualpath.kv.chain_root``), what
the limits count (``dualpath.tenant.limits``) and a label on ``/metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from fastapi import Request

from dualpath.config import GatewayConfig
from dualpath.telemetry.logs import get_logger
from dualpath.tenant import ApiKeys, TenantLimiter, TenantLimits, configured_keys, readable_by_others

__all__ = ["Tenancy", "scoped_session", "tenant_of"]

log = get_logger("gateway")
_LEASE_GRACE_S = 60.0  # a request's limiter lease outlives its request timeout by this much at most


def presented_keys(headers: Mapping[str, str]) -> list[str]:
    """The keys a request presents: ``Authorization: Bearer KEY`` (OpenAI clients; the scheme
    in any case) and ``x-api-key: KEY`` (Anthropic clients)."""
    out = []
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        out.append(token.strip())
    if key := headers.get("x-api-key", "").strip():
        out.append(key)
    return out


def tenant_of(request: Request) -> str:
    """The tenant the auth middleware found for ``request`` ("" on an open gateway)."""
    return getattr(request.state, "tenant", "")


def scoped_session(tenant: str, session: str) -> str:
    """``session`` as the scheduler sees it: inside its tenant's namespace, so that a tenant
    naming another's session id neither re-ranks nor prefetches for that session."""
    return f"{tenant}/{session}" if tenant and session else session


class Tenancy:
    """The API keys (None: an open gateway) and the per-tenant limiter."""

    def __init__(self, keys: ApiKeys | None, limiter: TenantLimiter) -> None:
        self.keys, self.limiter = keys, limiter

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> Tenancy:
        """The gateway's keys and limits.

        Raises:
            KeyFileError: the key file cannot be read or is malformed (the message names the line).
            ValueError: a negative limit.
        """
        parsed = configured_keys(cfg.api_key, cfg.api_key_file)
        if cfg.api_key_file and readable_by_others(cfg.api_key_file):
            log.warning("api_key_file_readable_by_others", path=cfg.api_key_file, fix=f"chmod 600 {cfg.api_key_file}")
        defaults = TenantLimits(max_concurrency=cfg.tenant_max_concurrency, tokens_per_minute=cfg.tenant_tokens_per_minute)
        limiter = TenantLimiter(defaults, parsed.limits if parsed else {}, lease_ttl_s=cfg.request_timeout + _LEASE_GRACE_S)
        keys = ApiKeys(parsed.keys) if parsed else None
        if keys is not None:
            log.info("tenants", tenants=keys.tenants, limited=sorted(parsed.limits) if parsed else [])
        return cls(keys, limiter)

    @property
    def secured(self) -> bool:
        return self.keys is not None

    def authenticate(self, headers: Mapping[str, str]) -> str | None:
        """The caller's tenant: "" on an open gateway, None for a missing or unknown key."""
        if self.keys is None:
            return ""
        for key in presented_keys(headers):
            tenant = self.keys.tenant_of(key)
            if tenant is not None:
                return tenant
        return None

    def admit(self, rid: str, tenant: str, prompt_tokens: int) -> None:
        """Count ``rid`` against its tenant's limits. Raises RateLimitedError when over one."""
        if self.limiter.active:
            self.limiter.admit(rid, tenant, prompt_tokens, time.monotonic())

    def charge(self, rid: str, tokens: int) -> None:
        """``tokens`` generated for ``rid``: they count against its tenant's token budget."""
        if self.limiter.active:
            self.limiter.charge(rid, tokens, time.monotonic())

    def release(self, rid: str) -> None:
        """``rid`` ended (idempotent)."""
        if self.limiter.active:
            self.limiter.release(rid)
