"""Hostile input, property-based: every msgpack message decoder and the block-file parser.

A decoder given anything (random bytes, random msgpack, a valid envelope with fields of the
wrong types, a flipped bit in a valid message) either returns a message of an expected type
or raises its one documented error (``ProtocolError``, ``CorruptBlockError``); it never raises
anything else, and a block file that is damaged anywhere is never read as valid.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualpath.kv import BlockStore
from dualpath.kv.block import HEADER_BYTES, BlockHeader, decode_header, encode_header
from dualpath.kv.errors import BlockMissingError, CorruptBlockError
from dualpath.protocol import PROTOCOL_VERSION, ProtocolError, decode, encode
from dualpath.protocol import messages as m
from dualpath.protocol.codec import _BY_CODE

MESSAGES = sorted(_BY_CODE.items())
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# msgpack values of every kind, nested: what a hostile peer can put in a field
plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


def _decode_or_protocol_error(data: bytes, *expected: type):
    try:
        msg = decode(data, *expected)
    except ProtocolError:
        return None
    assert type(msg) in (expected or tuple(_BY_CODE.values()))
    return msg


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_are_a_protocol_error_or_a_message(data):
    _decode_or_protocol_error(data)
    for _code, cls in MESSAGES:
        _decode_or_protocol_error(data, cls)


@FUZZ
@given(
    code=st.sampled_from([c for c, _ in MESSAGES]),
    fields=st.dictionaries(st.text(max_size=24), plain, max_size=8),
    version=st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION]) | plain,
)
def test_an_envelope_with_arbitrary_fields_is_a_protocol_error_or_a_message_of_its_type(code, fields, version):
    body = {**fields, "v": version, "t": code}
    cls = _BY_CODE[code]
    msg = _decode_or_protocol_error(msgpack.packb(body, use_bin_type=True), cls)
    if msg is not None:
        assert isinstance(msg, cls)


def _field_values(cls) -> st.SearchStrategy[dict]:
    """Each field either its own default-ish value or anything msgpack can carry."""
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = plain
    return st.fixed_dictionaries(out)


@FUZZ
@given(data=st.data())
def test_every_message_type_with_hostile_field_values_is_rejected_cleanly(data):
    code, cls = data.draw(st.sampled_from(MESSAGES))
    body = {**data.draw(_field_values(cls)), "v": PROTOCOL_VERSION, "t": code}
    msg = _decode_or_protocol_error(msgpack.packb(body, use_bin_type=True), cls)
    if msg is not None:
        assert decode(encode(msg), cls) == msg  # what is accepted is well-formed enough to round-trip


@FUZZ
@given(
    digest=st.integers(0, 2**64 - 1),
    hashes=st.lists(st.integers(1, 2**64 - 1), max_size=40),
    start=st.integers(0, 40),
    flip=st.integers(0, 10_000),
    bit=st.integers(0, 7),
)
def test_a_flipped_bit_in_a_commit_request_is_a_protocol_error_or_a_commit_request(digest, hashes, start, flip, bit):
    raw = bytearray(encode(m.CommitRequest(model_digest=digest, hashes=hashes, start=start)))
    raw[flip % len(raw)] ^= 1 << bit
    _decode_or_protocol_error(bytes(raw), m.CommitRequest)


# ---- the block file --------------------------------------------------------------------------

headers = st.builds(
    BlockHeader,
    version=st.just(1),
    model_digest=st.integers(0, 2**64 - 1),
    block_hash=st.integers(1, 2**64 - 1),
    layers=st.integers(1, 64),
    tokens=st.integers(1, 128),
    bytes_per_token_layer=st.integers(1, 512),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    checksum=st.integers(0, 2**64 - 1),
)


@FUZZ
@given(raw=st.binary(max_size=HEADER_BYTES * 2))
def test_random_bytes_are_never_a_block_header(raw):
    try:
        decode_header(raw)
    except CorruptBlockError:
        return
    pytest.fail("random bytes parsed as a block header (CRC collision?)")


@FUZZ
@given(h=headers, flip=st.integers(0, HEADER_BYTES - 1), bit=st.integers(0, 7))
def test_a_header_round_trips_and_any_flipped_bit_is_detected(h, flip, bit):
    raw = bytearray(encode_header(h))
    assert decode_header(bytes(raw)) == h
    raw[flip] ^= 1 << bit
    with pytest.raises(CorruptBlockError):
        decode_header(bytes(raw))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    payload=st.binary(min_size=24, max_size=24),
    damage=st.sampled_from(["flip", "truncate", "extend", "garbage"]),
    where=st.integers(0, 10_000),
    junk=st.binary(min_size=1, max_size=200),
)
def test_a_block_file_damaged_anywhere_is_never_read_as_valid(tmp_path, payload, damage, where, junk):
    store = BlockStore(tmp_path, fsync=False)
    fmt = {"layers": 2, "tokens": 3, "bytes_per_token_layer": 4, "dtype": "float32"}
    store.write(model_digest=9, block_hash=77, payload=payload, **fmt)
    path = store.path_for(9, 77)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[where % len(raw)] ^= 0x01
    elif damage == "truncate":
        raw = raw[: where % len(raw)]
    elif damage == "extend":
        raw += junk
    else:
        start = where % len(raw)
        raw[start : start + len(junk)] = junk[: len(raw) - start] or b"\xff"
        if bytes(raw) == path.read_bytes():
            return  # the "garbage" happened to equal the original bytes
    path.write_bytes(bytes(raw))
    dest = bytearray(24)
    try:
        store.read_into(model_digest=9, block_hash=77, dest=dest, **fmt)
    except (CorruptBlockError, BlockMissingError):
        return
    pytest.fail(f"damaged block ({damage}) read as valid: {bytes(dest)!r}")
