"""The Full Block file header: encoding, decoding and corruption detection."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.kv import FORMAT_VERSION, HEADER_BYTES, BlockHeader, CorruptBlockError, decode_header, encode_header

u64 = st.integers(0, 2**64 - 1)
u32_pos = st.integers(1, 2**32 - 1)
dtypes = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=16)


def make_header(**overrides: object) -> BlockHeader:
    fields: dict[str, object] = dict(
        version=FORMAT_VERSION, model_digest=11, block_hash=22, layers=4, tokens=64,
        bytes_per_token_layer=256, dtype="bfloat16", checksum=33,
    )  # fmt: skip
    fields.update(overrides)
    return BlockHeader(**fields)  # type: ignore[arg-type]


@given(digest=u64, block_hash=u64, layers=u32_pos, tokens=u32_pos, bpt=u32_pos, dtype=dtypes,
       checksum=u64)  # fmt: skip
def test_header_round_trips_through_its_encoding(
    digest: int, block_hash: int, layers: int, tokens: int, bpt: int, dtype: str, checksum: int
) -> None:
    header = make_header(
        model_digest=digest,
        block_hash=block_hash,
        layers=layers,
        tokens=tokens,
        bytes_per_token_layer=bpt,
        dtype=dtype,
        checksum=checksum,
    )
    raw = encode_header(header)
    assert len(raw) == HEADER_BYTES == 64
    assert decode_header(raw) == header
    assert decode_header(raw + b"payload follows") == header


def test_every_single_bit_flip_in_the_header_is_detected() -> None:
    raw = encode_header(make_header())
    for i in range(HEADER_BYTES):
        for bit in (0, 7):
            damaged = bytearray(raw)
            damaged[i] ^= 1 << bit
            with pytest.raises(CorruptBlockError):
                decode_header(bytes(damaged))


def test_unknown_version_with_a_valid_crc_is_rejected() -> None:
    raw = bytearray(encode_header(make_header()))
    struct.pack_into("<H", raw, 4, FORMAT_VERSION + 1)
    struct.pack_into("<I", raw, 60, zlib.crc32(raw[:60]))
    with pytest.raises(CorruptBlockError, match="version"):
        decode_header(bytes(raw))


def test_wrong_magic_with_a_valid_crc_is_rejected() -> None:
    raw = bytearray(encode_header(make_header()))
    raw[:4] = b"NOPE"
    struct.pack_into("<I", raw, 60, zlib.crc32(raw[:60]))
    with pytest.raises(CorruptBlockError, match="magic"):
        decode_header(bytes(raw))


def test_short_header_is_rejected() -> None:
    with pytest.raises(CorruptBlockError, match="header is 10 bytes"):
        decode_header(encode_header(make_header())[:10])


def test_layer_slices_tile_the_payload_in_layer_major_order() -> None:
    header = make_header(layers=3, tokens=64, bytes_per_token_layer=10)
    assert header.payload_bytes == 3 * 64 * 10
    slices = [header.layer_slice(layer) for layer in range(3)]
    assert slices[0].start == 0
    assert slices[-1].stop == header.payload_bytes
    for before, after in zip(slices, slices[1:]):
        assert before.stop == after.start
        assert before.stop - before.start == 64 * 10
    with pytest.raises(IndexError):
        header.layer_slice(3)
    with pytest.raises(IndexError):
        header.layer_slice(-1)


@pytest.mark.parametrize(
    "override",
    [{"layers": 0}, {"tokens": 2**32}, {"dtype": ""}, {"dtype": "x" * 17}, {"dtype": "é"},
     {"checksum": -1}, {"version": 2**16}],
)  # fmt: skip
def test_out_of_range_header_fields_are_refused(override: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_header(**override)


def test_version_1_headers_still_decode_and_say_where_their_payload_starts() -> None:
    from dualpath.kv.block import PAYLOAD_OFFSET, READ_VERSIONS, payload_offset

    assert FORMAT_VERSION == 2 and READ_VERSIONS == (1, 2)
    assert decode_header(encode_header(make_header(version=1))).version == 1
    assert payload_offset(1) == HEADER_BYTES and payload_offset(2) == PAYLOAD_OFFSET == 4096
    with pytest.raises(ValueError, match="version"):
        payload_offset(3)
