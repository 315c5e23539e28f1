"""API keys and the tenants they name: the ``--api-key-file`` format, and a lookup whose time
does not depend on the configured keys.

The file holds one key per line, the key first, then its tenant, then optional limits::

    # KEY                TENANT   [max_concurrency=N] [tokens_per_minute=N]
    sk-alice-0f3a9c...   alice
    sk-alice-ci-77d2...  alice    max_concurrency=2
    sk-bob-5e81b0...     bob      tokens_per_minute=200000

Fields are separated by whitespace; blank lines and lines starting with ``#`` are skipped.
Several keys may name one tenant (key rotation, one key per machine): they share its KV cache
namespace and its limits. A limit left out takes the gateway's ``--tenant-max-concurrency`` /
``--tenant-tokens-per-minute``; 0 means no limit. A key listed twice, a line without a tenant,
a tenant name outside ``[A-Za-z0-9][A-Za-z0-9_.@-]*`` (at most 64 characters: it is a metrics
label), an unknown option and a tenant given two different values of one limit are errors
naming the line; so is a file with no key at all (which would open the gateway to everyone).
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from dualpath.tenant.errors import KeyFileError

__all__ = [
    "DEFAULT_TENANT",
    "LIMIT_OPTIONS",
    "ApiKeys",
    "KeyFile",
    "TenantLimits",
    "configured_keys",
    "parse_key_file",
    "readable_by_others",
]

DEFAULT_TENANT = "default"  # the tenant of the single ``--api-key``
LIMIT_OPTIONS = ("max_concurrency", "tokens_per_minute")
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_COUNT = re.compile(r"[0-9]{1,12}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantLimits:
    """A tenant's limits: ``None`` takes the gateway-wide default, 0 is no limit."""

    max_concurrency: int | None = None  # requests in flight at once
    tokens_per_minute: int | None = None  # prompt plus generated tokens, as a bucket refilled each second

    def over(self, defaults: TenantLimits) -> TenantLimits:
        """These limits, each one left out taken from ``defaults``."""
        return TenantLimits(
            max_concurrency=defaults.max_concurrency if self.max_concurrency is None else self.max_concurrency,
            tokens_per_minute=defaults.tokens_per_minute if self.tokens_per_minute is None else self.tokens_per_minute,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyFile:
    """A parsed key file: each key's tenant, and the limits the file gives tenants."""

    keys: dict[str, str]  # key -> tenant
    limits: dict[str, TenantLimits] = field(default_factory=dict)  # tenant -> the limits its lines set

    @property
    def tenants(self) -> list[str]:
        return sorted(set(self.keys.values()))


def parse_key_file(text: str, path: str = "<api key file>") -> KeyFile:
    """Parse the text of a key file (format in the module docstring).

    Raises:
        KeyFileError: a malformed line (its number in ``line``), a duplicate key, conflicting
            limits of one tenant, or no key at all.
    """
    keys: dict[str, str] = {}
    first_line: dict[str, int] = {}  # key -> the line it is on (to name both lines of a duplicate)
    limits: dict[str, TenantLimits] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, *rest = line.split()
        if not rest:
            raise KeyFileError(path, number, "expected 'KEY TENANT [max_concurrency=N] [tokens_per_minute=N]', found one field")
        tenant, options = rest[0], rest[1:]
        if not (key.isascii() and key.isprintable()):
            raise KeyFileError(path, number, "the key must be printable ASCII (it travels in an HTTP header)")
        if not _TENANT.fullmatch(tenant):
            raise KeyFileError(path, number, f"tenant {tenant!r} must match [A-Za-z0-9][A-Za-z0-9_.@-]* (64 characters at most)")
        if key in keys:
            raise KeyFileError(path, number, f"duplicate key (already on line {first_line[key]})")
        keys[key], first_line[key] = tenant, number
        limits[tenant] = _merge(limits.get(tenant, TenantLimits()), _options(options, path, number), tenant, path, number)
    if not keys:
        raise KeyFileError(path, 0, "no API key in the file (an empty key file would leave the gateway open)")
    return KeyFile(keys=keys, limits={t: lim for t, lim in limits.items() if lim != TenantLimits()})


def _options(options: list[str], path: str, number: int) -> TenantLimits:
    """The ``name=N`` options of one line."""
    given: dict[str, int] = {}
    for option in options:
        name, eq, value = option.partition("=")
        if name not in LIMIT_OPTIONS or not eq:
            raise KeyFileError(path, number, f"unknown option {option!r} (known: {', '.join(f'{o}=N' for o in LIMIT_OPTIONS)})")
        if not _COUNT.fullmatch(value):
            raise KeyFileError(path, number, f"{name} must be a whole number >= 0 (0: no limit), got {value!r}")
        if name in given:
            raise KeyFileError(path, number, f"{name} given twice")
        given[name] = int(value)
    return TenantLimits(**given)


def _merge(old: TenantLimits, new: TenantLimits, tenant: str, path: str, number: int) -> TenantLimits:
    """One tenant's limits over all its lines: a limit set on two lines must agree."""
    for name in LIMIT_OPTIONS:
        a, b = getattr(old, name), getattr(new, name)
        if a is not None and b is not None and a != b:
            raise KeyFileError(path, number, f"tenant {tenant!r} has {name}={a} on an earlier line and {name}={b} here")
        if b is not None:
            old = replace(old, **{name: b})
    return old


def readable_by_others(path: str | os.PathLike[str]) -> bool:
    """True when users other than the owner may read ``path`` (a key file should be 0600)."""
    return bool(os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH))


def configured_keys(api_key: str, key_file: str) -> KeyFile | None:
    """The keys a gateway accepts: those of ``key_file`` plus ``api_key`` (the single-key form,
    tenant ``"default"``); None when neither is set (an open gateway, no tenants).

    Raises:
        KeyFileError: the file cannot be read or is malformed (see ``parse_key_file``), or
            ``api_key`` is also in it.
    """
    parsed = KeyFile(keys={})
    if key_file:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(key_file, 0, f"cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
        parsed = parse_key_file(text, key_file)
    if api_key:
        if api_key in parsed.keys:
            raise KeyFileError(key_file, 0, "the --api-key is also listed in the file; list it once")
        parsed.keys[api_key] = DEFAULT_TENANT
    return parsed if parsed.keys else None


class ApiKeys:
    """Each accepted key's tenant, looked up in time independent of the keys' values.

    Keys are held only as HMAC-SHA256 digests under a random per-process secret, and a
    presented key is found by its digest: what a lookup's time depends on (the digest's
    hash and bytes) cannot be related to any configured key without that secret, so
    response times leak nothing about how close a guess was. The digests are fixed-length,
    so neither is the length of a key leaked.
    """

    def __init__(self, keys: Mapping[str, str]) -> None:
        """``keys``: key -> tenant.

        Raises:
            ValueError: ``keys`` is empty or holds an empty key.
        """
        if not keys or not all(keys):
            raise ValueError("ApiKeys needs at least one key, and no empty one")
        self._secret = secrets.token_bytes(32)
        self._tenants = {self._digest(key): tenant for key, tenant in keys.items()}
        self.tenants = sorted(set(keys.values()))

    def _digest(self, key: str) -> bytes:
        return hmac.digest(self._secret, key.encode("utf-8", "surrogateescape"), "sha256")

    def tenant_of(self, presented: str) -> str | None:
        """The tenant of ``presented``; None for an unknown (or empty) key."""
        return self._tenants.get(self._digest(presented)) if presented else None
