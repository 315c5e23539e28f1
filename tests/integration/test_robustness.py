"""Bad input on the bus and in storage: services answer garbage with an error and keep
serving; a corrupt or truncated block file is a miss (recomputed), never used."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import nats
import pytest
from conftest import openai_client, start_stack

from dualpath.kv import BlockStore, block_hashes, model_digest
from dualpath.model import Tokenizer
from dualpath.protocol import decode, encode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("robust")
    s = start_stack(tiny_model, base / "storage", base / "run")
    try:
        yield s
    finally:
        s.stop()


GARBAGE = [
    b"\x00\x01garbage",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"v": 99, "t": 10, "model_digest": 1, "hashes": []}),  # wrong protocol version
    msgpack.packb({"v": 1, "t": 10, "model_digest": "x", "hashes": []}),  # wrong field type
    msgpack.packb({"v": 1, "t": 9999}),  # unknown type
]


async def _probe(stack, node: str) -> list[tuple[str, int]]:
    subj = Subjects(stack.namespace)
    nc = await nats.connect(stack.nats_url, **stack.nats_options())  # the operator: it may publish anywhere
    answers = []
    try:
        for subject in (
            subj.kv_lookup,
            subj.kv_commit,
            subj.submit,
            subj.sched_state,
            subj.tm(node, "load"),
            subj.tm(node, "alloc"),
            subj.prefill("p0e0"),
            subj.decode("d0e0"),
        ):
            for junk in GARBAGE:
                reply = await nc.request(subject, junk, timeout=5)
                err = decode(reply.data, m.ErrorReply)
                answers.append((subject, err.code))
        # still serving: a valid request gets a valid answer
        ok = await nc.request(subj.kv_lookup, encode(m.LookupRequest(model_digest=1, hashes=[1, 2])), timeout=5)
        assert decode(ok.data, m.LookupReply).hit_blocks == 0
        state = await nc.request(subj.sched_state, encode(m.StateRequest()), timeout=5)
        assert decode(state.data, m.StateReply).prefill_engines == 1
    finally:
        await nc.close()
    return answers


def test_garbage_on_every_service_subject_gets_an_error_reply_and_the_service_keeps_serving(stack):
    answers = asyncio.run(_probe(stack, "d0"))
    assert len(answers) == 8 * len(GARBAGE)
    assert all(code == 400 for _, code in answers), answers
    stack.check_alive()
    client = openai_client(stack.url, 60)
    model = client.models.list().data[0].id
    assert client.completions.create(model=model, prompt="still alive?", max_tokens=4, temperature=0).choices[0].text


def _chat(client, model, messages, max_tokens=8):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_or_truncated_block_file_is_a_miss_and_is_recomputed(stack, tiny_model, damage):
    client = openai_client(stack.url, 60)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": f"{damage}: " + "the quick brown fox jumps over the lazy dog " * 6}]
    first, cached = _chat(client, model, messages)
    assert cached == 0
    tok = Tokenizer.from_dir(tiny_model)
    ids = tok.encode(tok.render_chat(messages))
    hashes = block_hashes(model, ids)
    assert len(hashes) >= 3
    path = BlockStore(Path(stack.cfg.storage)).path_for(model_digest(model), hashes[1])
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    else:
        path.write_bytes(bytes(raw[: len(raw) - 100]))
    again, cached = _chat(client, model, messages)
    assert cached == 64  # block 0 is good; block 1 is bad, so the hit ends there
    assert again == first
    healed, cached = _chat(client, model, messages)
    assert cached == (len(ids) - 1) // 64 * 64  # the recomputed blocks were persisted again
    assert healed == first
