"""The Full Block file format.

A block file is a 64-byte header, zero padding up to ``PAYLOAD_OFFSET`` (4 KiB), then the
payload::

    offset  size  field
    0       4     magic b"DPKV"
    4       2     format version (u16): 2 (1 in files of the first layout, below)
    6       2     KV layout (u16): what a token's bytes are (``KV_LAYOUTS``; 0 in files
                  written before the field existed, which were all per-head K/V)
    8       8     model digest (u64)
    16      8     block hash (u64)
    24      4     layers (u32)
    28      4     tokens (u32)
    32      4     bytes per token per layer (u32)
    36      8     payload checksum: xxh3_64 of the payload (u64)
    44      16    dtype name, ASCII, NUL-padded
    60      4     header CRC: zlib.crc32 of bytes 0..60 (u32)
    64      4032  zeros (checked on read, so a file damaged anywhere is refused)
    4096    ...   payload

All integers are little-endian. The payload is ``[layers, tokens, bytes]`` in layer-major
order, so the Layer Block of layer ``l`` (shape ``[1, tokens, bytes]``) is one contiguous
byte range and a Full Block is the concatenation of its Layer Blocks.

The payload starts at a 4 KiB offset so that an ``O_DIRECT`` read can land it straight in the
caller's buffer (direct I/O needs file offsets aligned to the device's logical block). The
padding costs no disk space where the payload is a multiple of 4 KiB (the filesystem rounds a
file up to its block size either way), one 4 KiB block otherwise. Version 1 files (the same header, the payload at
``HEADER_BYTES``) are still read; nothing writes them. A file's size tells the two apart
before any byte is read (``HEADER_BYTES`` or ``PAYLOAD_OFFSET`` plus the payload), and the
header's version must agree with it.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from dualpath.kv.errors import CorruptBlockError
from dualpath.kv.hashing import check_u64

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "PAYLOAD_OFFSET",
    "READ_VERSIONS",
    "KV_LAYOUTS",
    "MAGIC",
    "BlockHeader",
    "decode_header",
    "encode_header",
    "header_template",
    "match_header",
    "payload_offset",
]

MAGIC = b"DPKV"
FORMAT_VERSION = 2  # what writers write
READ_VERSIONS = (1, 2)  # what readers accept
# What one token's ``bytes_per_token_layer`` hold: per-head K then V (GQA, MHA, MQA), MLA's
# latent then rotary key, or the testbed's modeled stand-in bytes (not KV at all).
KV_LAYOUTS = {"gqa": 0, "mla": 1, "modeled": 2}
_DTYPE_BYTES = 16
_BODY = struct.Struct("<4sHHQQIIIQ16s")  # everything the header CRC covers
_CRC = struct.Struct("<I")
HEADER_BYTES = _BODY.size + _CRC.size
PAYLOAD_OFFSET = 4096  # where a version 2 file's payload starts: the header, zero padded
_CHECKSUM = slice(36, 44)  # the payload checksum's bytes inside the header body
_U16_MAX = (1 << 16) - 1
_U32_MAX = (1 << 32) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockHeader:
    """The header of one Full Block file.

    ``checksum`` is the xxh3_64 of the payload bytes (the header has its own CRC on disk).
    Construction validates ranges: version is a u16; digests, hash and checksum are u64;
    layers, tokens and bytes_per_token_layer are in ``[1, 2**32)``; dtype is 1..16 printable
    ASCII characters (a torch dtype name such as ``"bfloat16"``).

    Raises:
        ValueError: a field is out of range (TypeError for a non-int integer field).
    """

    version: int
    model_digest: int
    block_hash: int
    layers: int
    tokens: int
    bytes_per_token_layer: int
    dtype: str
    checksum: int
    kv_layout: int = 0  # KV_LAYOUTS

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or not 0 <= self.version <= _U16_MAX:
            raise ValueError(f"version must be a u16, got {self.version!r}")
        for name in ("model_digest", "block_hash", "checksum"):
            check_u64(name, getattr(self, name))
        for name in ("layers", "tokens", "bytes_per_token_layer"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= _U32_MAX:
                raise ValueError(f"{name} must be in [1, 2**32), got {value!r}")
        if self.kv_layout not in KV_LAYOUTS.values():
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if not (isinstance(self.dtype, str) and 1 <= len(self.dtype) <= _DTYPE_BYTES and self.dtype.isascii() and self.dtype.isprintable()):
            raise ValueError(f"dtype must be 1..16 printable ASCII chars, got {self.dtype!r}")

    @property
    def payload_bytes(self) -> int:
        """Size of the payload: ``layers * tokens * bytes_per_token_layer``."""
        return self.layers * self.tokens * self.bytes_per_token_layer

    @property
    def layer_bytes(self) -> int:
        """Size of one Layer Block: ``tokens * bytes_per_token_layer``."""
        return self.tokens * self.bytes_per_token_layer

    def layer_slice(self, layer: int) -> slice:
        """Byte range of layer ``layer``'s Layer Block inside the payload.

        Raises:
            IndexError: ``layer`` is not in ``[0, layers)``.
        """
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} out of range for {self.layers} layers")
        size = self.layer_bytes
        return slice(layer * size, (layer + 1) * size)


def encode_header(h: BlockHeader) -> bytes:
    """Serialize ``h`` to exactly ``HEADER_BYTES`` bytes (fields, then a CRC over them)."""
    body = _BODY.pack(
        MAGIC,
        h.version,
        h.kv_layout,
        h.model_digest,
        h.block_hash,
        h.layers,
        h.tokens,
        h.bytes_per_token_layer,
        h.checksum,
        h.dtype.encode("ascii"),
    )
    return body + _CRC.pack(zlib.crc32(body))


def decode_header(raw: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse the first ``HEADER_BYTES`` bytes of ``raw`` into a ``BlockHeader``.

    Raises:
        CorruptBlockError: ``raw`` is too short, the magic or header CRC is wrong, the format
            version is not one of ``READ_VERSIONS``, or a field value is impossible.
    """
    if len(raw) < HEADER_BYTES:
        raise CorruptBlockError(None, f"header is {len(raw)} bytes, need {HEADER_BYTES}")
    view = memoryview(raw)[:HEADER_BYTES]
    body = view[: _BODY.size]
    (crc,) = _CRC.unpack(view[_BODY.size :])
    if zlib.crc32(body) != crc:
        raise CorruptBlockError(None, "header CRC mismatch")
    magic, version, kv_layout, digest, block_hash, layers, tokens, bpt, checksum, dtype = _BODY.unpack(body)
    if magic != MAGIC:
        raise CorruptBlockError(None, f"bad magic {magic!r}")
    if version not in READ_VERSIONS:
        raise CorruptBlockError(None, f"unsupported format version {version}")
    try:
        return BlockHeader(
            version=version,
            model_digest=digest,
            block_hash=block_hash,
            layers=layers,
            tokens=tokens,
            bytes_per_token_layer=bpt,
            dtype=dtype.rstrip(b"\0").decode("ascii"),
            checksum=checksum,
            kv_layout=kv_layout,
        )
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptBlockError(None, f"impossible header field: {exc}") from exc


def payload_offset(version: int) -> int:
    """Where the payload of a file of format ``version`` starts.

    Raises:
        ValueError: ``version`` is not one of ``READ_VERSIONS``.
    """
    if version not in READ_VERSIONS:
        raise ValueError(f"format version must be one of {READ_VERSIONS}, got {version!r}")
    return HEADER_BYTES if version == 1 else PAYLOAD_OFFSET


def header_template(
    *,
    model_digest: int,
    block_hash: int,
    layers: int,
    tokens: int,
    bytes_per_token_layer: int,
    dtype: str,
    kv_layout: int = 0,
    version: int = FORMAT_VERSION,
) -> bytes | None:
    """The header body (``HEADER_BYTES`` minus the CRC) that a block of format ``version``
    with these fields has, its checksum field zeroed, for ``match_header``; None if a field
    cannot be encoded (such a block cannot exist: ``decode_header`` says why)."""
    try:
        return _BODY.pack(
            MAGIC, version, kv_layout, model_digest, block_hash, layers, tokens, bytes_per_token_layer, 0, dtype.encode("ascii")
        )
    except (struct.error, UnicodeEncodeError):
        return None


def match_header(raw: bytes | bytearray | memoryview, template: bytes) -> int | None:
    """The payload checksum of header ``raw`` if it is the one ``template`` describes (every
    field equal but the checksum) and its CRC holds; None otherwise (``decode_header`` then
    tells what is wrong). A read's check without building a ``BlockHeader``: one comparison of
    bytes stands for the field checks, since fields that decode equal are encoded equal."""
    body = bytes(raw[: _BODY.size])
    if (
        len(raw) < HEADER_BYTES
        or body[: _CHECKSUM.start] != template[: _CHECKSUM.start]
        or body[_CHECKSUM.stop :] != template[_CHECKSUM.stop :]
    ):
        return None
    if zlib.crc32(body) != int.from_bytes(raw[_BODY.size : HEADER_BYTES], "little"):
        return None
    return int.from_bytes(body[_CHECKSUM], "little")
