"""The control-plane codec: versioned msgpack envelopes, strict decoding, subject safety."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.protocol import PROTOCOL_VERSION, ProtocolError, decode, encode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects, check_id

u64 = st.integers(min_value=0, max_value=2**64 - 1)


@settings(max_examples=100, deadline=None)
@given(digest=u64, hashes=st.lists(u64, max_size=50), start=st.integers(0, 50))
def test_commit_request_round_trips_through_msgpack(digest, hashes, start):
    msg = m.CommitRequest(model_digest=digest, hashes=hashes, start=start)
    assert decode(encode(msg), m.CommitRequest) == msg


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=200), hit=st.integers(0, 3), temp=st.floats(0, 2, allow_nan=False))
def test_submit_request_round_trips_with_nested_plain_data(tokens, hit, temp):
    msg = m.SubmitRequest(
        request_id="r-1",
        model="tiny",
        model_digest=7,
        prompt_tokens=tokens,
        block_hashes=[1, 2],
        hit_blocks=hit,
        sampling={"temperature": temp, "max_tokens": 4, "seed": None},
        reply_subject="dp.out.gw0.r-1",
    )
    assert decode(encode(msg), m.SubmitRequest) == msg


def test_every_message_type_has_a_unique_code_and_round_trips_with_defaults():
    codes = set()
    for name in m.__all__:
        cls = getattr(m, name)
        if not dataclasses.is_dataclass(cls):
            continue
        assert cls.TYPE_CODE not in codes
        codes.add(cls.TYPE_CODE)
    assert len(codes) >= 20


def test_wrong_version_is_refused_with_the_reason():
    raw = msgpack.packb({"v": PROTOCOL_VERSION + 1, "t": m.Ok.TYPE_CODE, "detail": ""})
    with pytest.raises(ProtocolError, match="version"):
        decode(raw, m.Ok)


def test_a_message_of_another_type_is_refused():
    with pytest.raises(ProtocolError, match="unexpected message type"):
        decode(encode(m.Ok()), m.LookupRequest)


@pytest.mark.parametrize("raw", [b"", b"\xc1", msgpack.packb("text"), msgpack.packb({"v": 1, "t": 10, "model_digest": 1})])
def test_garbage_is_a_protocol_error_not_a_crash(raw):
    with pytest.raises(ProtocolError):
        decode(raw, m.LookupRequest)


def test_field_of_wrong_type_is_named():
    raw = msgpack.packb({"v": 1, "t": m.LookupRequest.TYPE_CODE, "model_digest": 1, "hashes": "nope"})
    with pytest.raises(ProtocolError, match="hashes"):
        decode(raw, m.LookupRequest)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    raw = msgpack.packb({"v": 1, "t": m.LookupReply.TYPE_CODE, "hit_blocks": 3, "future_field": [1]})
    assert decode(raw, m.LookupReply).hit_blocks == 3


def test_subjects_refuse_ids_that_could_inject_tokens():
    s = Subjects("dp")
    assert s.tm("node-1", "load") == "dp.tm.node-1.load"
    for bad in ("a.b", "a*", "a>", "", "a b"):
        with pytest.raises(ValueError):
            check_id(bad)
        with pytest.raises(ValueError):
            s.prefill(bad)
