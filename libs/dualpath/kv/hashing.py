"""Block identity: a hash chain over full blocks of token ids.

``h_i = xxh3_64(h_{i-1} as 8 LE bytes || model_digest as 8 LE bytes || tokens of block i as
LE uint32)`` with ``h_{-1} = parent`` (0 at the root of a conversation). Because each hash
folds in its predecessor, the chain *is* the trie path: equal hashes imply equal prefixes
(up to 64-bit collisions), and the longest persisted prefix of a chain is the cache hit.
Only full blocks get a hash; the partial tail of a context is recomputed, never persisted.

Tenants: a conversation's chain starts at ``h_{-1} = chain_root(tenant, cache_salt)`` instead
of 0, so the same tokens sent by two tenants (or with two ``cache_salt`` values) share no block
hash, and no one gets a hit on -- or a faster first token from -- another's prefix. With
neither given the root is 0: the chains, and so every persisted block, are those above.
"""

from __future__ import annotations

import array
import functools
import hashlib
import sys
from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = [
    "BLOCK_TOKENS",
    "U64_MAX",
    "block_hashes",
    "chain_root",
    "check_u64",
    "hash_hex",
    "model_digest",
    "pack_hashes",
    "unpack_hashes",
]

BLOCK_TOKENS = 64
U64_MAX = (1 << 64) - 1
_U32_LIMIT = 1 << 32


def check_u64(name: str, value: int) -> int:
    """Return ``value`` if it is an int in ``[0, 2**64)``.

    Raises:
        TypeError: ``value`` is not an int (bools are refused too).
        ValueError: ``value`` is out of range.
    """
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{name} must be a u64, got {value}")
    return value


@functools.lru_cache(maxsize=64)
def model_digest(model_id: str) -> int:
    """Return the stable u64 digest of a model id (xxh3_64 of its UTF-8 bytes).

    Raises:
        TypeError: ``model_id`` is not a str.
        ValueError: ``model_id`` is empty.
    """
    if not isinstance(model_id, str):
        raise TypeError(f"model_id must be a str, got {type(model_id).__name__}")
    if not model_id:
        raise ValueError("model_id must not be empty")
    return xxhash.xxh3_64_intdigest(model_id.encode("utf-8"))


@functools.lru_cache(maxsize=4096)
def chain_root(tenant: str = "", cache_salt: str = "") -> int:
    """Return the parent hash of a conversation's first block for ``tenant`` and ``cache_salt``.

    0 when both are empty (unsalted: the chains every deployment without API keys has always
    had). Otherwise a nonzero u64 from BLAKE2b over both strings, each length-prefixed so that
    ``("ab", "c")`` and ``("a", "bc")`` differ, under a personalisation string of its own: a
    cryptographic hash here means no one can choose a salt whose root lands on another
    tenant's root. The root depends on nothing secret: gateway replicas agree on it, and a
    tenant's replay after a restart still hits its own blocks.

    Raises:
        TypeError: ``tenant`` or ``cache_salt`` is not a str.
    """
    if not isinstance(tenant, str) or not isinstance(cache_salt, str):
        raise TypeError("tenant and cache_salt must be str")
    if not tenant and not cache_salt:
        return 0
    h = hashlib.blake2b(digest_size=8, person=b"dualpath.root.1")
    for part in (tenant.encode("utf-8"), cache_salt.encode("utf-8")):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return int.from_bytes(h.digest(), "little") or 1  # 0 means "unsalted"; a zero digest must not


def hash_hex(h: int) -> str:
    """Return ``h`` as 16 lowercase hex digits (the form used in paths and logs).

    Raises:
        TypeError, ValueError: ``h`` is not a u64.
    """
    return f"{check_u64('hash', h):016x}"


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """``hashes`` as little-endian u64s, 8 bytes each: how a lookup carries a chain, so that the
    index decodes only the hashes it probes (about 10 of 511) instead of building 511 ints.

    Raises:
        ValueError: a hash is negative or not below 2**64 (TypeError: not an int).
    """
    try:
        packed = array.array("Q", hashes)
    except OverflowError as exc:
        raise ValueError(f"block hashes must be u64s: {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_hashes(packed: bytes) -> Sequence[int]:
    """The hashes of ``pack_hashes`` output as a read-only sequence; indexing decodes one.

    Raises:
        ValueError: the length is not a multiple of 8.
    """
    if len(packed) % 8:
        raise ValueError(f"packed hashes: {len(packed)} bytes is not a whole number of u64s")
    if sys.byteorder == "big":
        swapped = array.array("Q", packed)
        swapped.byteswap()
        return swapped
    return memoryview(packed).cast("Q")


def _pack_tokens(tokens: Sequence[int], count: int) -> bytes:
    """Pack the first ``count`` token ids as little-endian uint32 bytes.

    Raises:
        ValueError: a token id is negative, >= 2**32, or not an integer.
    """
    if isinstance(tokens, (list, tuple)):
        # array.array converts a list ~3x faster than numpy and range-checks each id.
        try:
            packed = array.array("I", tokens[:count])
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from exc
        if packed.itemsize == 4:
            if sys.byteorder == "big":
                packed.byteswap()
            return packed.tobytes()
    arr = np.asarray(tokens[:count])
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    # Range-check before narrowing so an out-of-range id cannot wrap into a valid one.
    if int(arr.min()) < 0 or int(arr.max()) >= _U32_LIMIT:
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def block_hashes(
    model_id: str,
    tokens: Sequence[int],
    *,
    block_tokens: int = BLOCK_TOKENS,
    parent: int = 0,
) -> list[int]:
    """Return the hash chain of the full blocks of ``tokens``, one u64 per full block.

    ``parent`` is the hash of the block preceding ``tokens[0]``; when ``tokens`` starts a
    conversation it is the conversation's ``chain_root`` (0 unsalted). So
    ``block_hashes(m, t[k*bt:], parent=hs[k-1]) == hs[k:]``. The partial
    tail (``len(tokens) % block_tokens`` tokens) has no hash.

    Raises:
        ValueError: ``block_tokens`` < 1, a token id is outside ``[0, 2**32)``, or ``parent``
            is not a u64 (TypeError if it is not an int).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    h = check_u64("parent", parent)
    n_blocks = len(tokens) // block_tokens
    if n_blocks == 0:
        return []
    packed = memoryview(_pack_tokens(tokens, n_blocks * block_tokens))  # [blocks * bt * 4]
    salt = model_digest(model_id).to_bytes(8, "little")
    stride = block_tokens * 4
    digest = xxhash.xxh3_64_intdigest
    out: list[int] = []
    for i in range(n_blocks):
        # Sequential by construction: each block's input starts with the previous hash.
        h = digest(h.to_bytes(8, "little") + salt + packed[i * stride : (i + 1) * stride])
        out.append(h)
    return out
