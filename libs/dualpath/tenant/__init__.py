"""Tenants: who a caller is (its API key), what it may share, and what it may use.

- ``keys``    the ``--api-key-file`` format (``KEY TENANT [max_concurrency=N]
              [tokens_per_minute=N]``) and ``ApiKeys``, a key -> tenant lookup whose time
              does not depend on the keys
- ``limits``  ``TenantLimiter``: per-tenant requests in flight and tokens per minute (pure)
- ``errors``  the package's errors

A tenant's KV cache is its own: the gateway seeds each prompt's block hash chain with
``dualpath.kv.chain_root(tenant, cache_salt)``, so two tenants never share a block.
"""

from dualpath.tenant.errors import KeyFileError, RateLimitedError, TenantError
from dualpath.tenant.keys import (
    DEFAULT_TENANT,
    LIMIT_OPTIONS,
    ApiKeys,
    KeyFile,
    TenantLimits,
    configured_keys,
    parse_key_file,
    readable_by_others,
)
from dualpath.tenant.limits import TenantLimiter

__all__ = [
    "DEFAULT_TENANT",
    "LIMIT_OPTIONS",
    "ApiKeys",
    "KeyFile",
    "KeyFileError",
    "RateLimitedError",
    "TenantError",
    "TenantLimiter",
    "TenantLimits",
    "configured_keys",
    "parse_key_file",
    "readable_by_others",
]
