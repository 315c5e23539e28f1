"""KV-cache blocks: hashing, the Full Block file format, block storage and the trie index.

- ``hashing``  block identity as a hash chain over full 64-token blocks
- ``block``    the Full Block file header (``[layers, tokens, bytes]`` payload, layer-major)
- ``storage``  ``BlockStore``: atomic, verified block files under a storage root
- ``trie``     ``BlockIndex``: the durable, capacity-bounded trie of persisted blocks
- ``hits``     how many hit blocks a prefill reads (never the last prompt token's) and computes
- ``errors``   the package's errors (a missing or corrupt block is a miss, never data)
"""

from dualpath.kv.block import (
    FORMAT_VERSION,
    HEADER_BYTES,
    PAYLOAD_OFFSET,
    BlockHeader,
    decode_header,
    encode_header,
)
from dualpath.kv.errors import (
    BlockMissingError,
    CorruptBlockError,
    IndexCorruptError,
    IndexLockedError,
    KVError,
)
from dualpath.kv.hashing import BLOCK_TOKENS, block_hashes, chain_root, hash_hex, model_digest, pack_hashes, unpack_hashes
from dualpath.kv.hits import miss_tokens, planned_hit_blocks, readable_hit_blocks
from dualpath.kv.storage import BlockStore
from dualpath.kv.trie import BlockIndex

__all__ = [
    "BLOCK_TOKENS",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "PAYLOAD_OFFSET",
    "BlockHeader",
    "BlockIndex",
    "BlockMissingError",
    "BlockStore",
    "CorruptBlockError",
    "IndexCorruptError",
    "IndexLockedError",
    "KVError",
    "block_hashes",
    "chain_root",
    "decode_header",
    "encode_header",
    "hash_hex",
    "miss_tokens",
    "model_digest",
    "pack_hashes",
    "planned_hit_blocks",
    "readable_hit_blocks",
    "unpack_hashes",
]
