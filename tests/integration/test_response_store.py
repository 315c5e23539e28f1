"""The stored-responses bucket on a real nats-server with JetStream: what one gateway replica
stores another reads, a conversation is rebuilt from its chain, deleted and expired entries are
gone, a server restart keeps them (file storage), and an entry too large for one message is a
named error."""

from __future__ import annotations

import asyncio

import nats
import pytest

from dualpath.bus.embedded import EmbeddedNats, free_port
from services.gateway.response_store import ResponseStore, StoredResponse, StoreError


@pytest.fixture()
def server(tmp_path):
    s = EmbeddedNats(port=free_port(), jetstream_dir=str(tmp_path / "js")).start()
    try:
        yield s
    finally:
        s.stop()


def _entry(n: int, previous: str | None, session: str = "s") -> StoredResponse:
    return StoredResponse(
        response={"id": f"resp_{n}", "output": [{"type": "message", "id": f"msg_{n}"}]},
        input_items=[{"type": "message", "id": f"in_{n}"}],
        previous_response_id=previous,
        session=session,
    )


async def _store(url: str, ttl_s: float = 60.0) -> tuple[nats.NATS, ResponseStore]:
    nc = await nats.connect(url)
    return nc, ResponseStore(nc.jetstream(), "test_responses", ttl_s=ttl_s)


@pytest.mark.anyio
async def test_what_one_replica_stores_another_reads_and_a_chain_rebuilds_the_conversation(server):
    nc_a, a = await _store(server.url)
    nc_b, b = await _store(server.url)
    await a.put("resp_1", _entry(1, None))
    await a.put("resp_2", _entry(2, "resp_1"))
    got = await b.get("resp_2")
    assert got is not None and got.previous_response_id == "resp_1" and got.session == "s"
    chain = await b.chain("resp_2")
    assert chain is not None and [e.response["id"] for e in chain] == ["resp_1", "resp_2"]
    assert await b.delete("resp_1") and not await b.delete("resp_1")
    assert await a.get("resp_1") is None and await a.chain("resp_2") is None  # its chain is broken
    assert await a.get("../etc") is None and await a.get("") is None  # not a key: nothing to find
    await nc_a.close()
    await nc_b.close()


@pytest.mark.anyio
async def test_entries_expire_after_the_ttl_and_a_new_ttl_applies_to_the_bucket(server):
    nc, store = await _store(server.url, ttl_s=60.0)
    await store.put("resp_old", _entry(1, None))
    await nc.close()
    nc, store = await _store(server.url, ttl_s=1.0)  # a gateway started with a shorter TTL
    await store.put("resp_new", _entry(2, None))
    assert await store.get("resp_new") is not None
    await asyncio.sleep(1.6)
    assert await store.get("resp_new") is None and await store.get("resp_old") is None
    info = await nc.jetstream().stream_info("KV_test_responses")
    assert info.config.max_age == 1.0
    await nc.close()


@pytest.mark.anyio
async def test_stored_responses_survive_a_nats_server_restart(tmp_path):
    port, js = free_port(), str(tmp_path / "js")
    server = EmbeddedNats(port=port, jetstream_dir=js).start()
    nc, store = await _store(server.url)
    await store.put("resp_1", _entry(1, None))
    await nc.close()
    server.stop()
    server = EmbeddedNats(port=port, jetstream_dir=js).start()
    try:
        nc, store = await _store(server.url)
        got = await store.get("resp_1")
        assert got is not None and got.input_items == [{"type": "message", "id": "in_1"}]
        await nc.close()
    finally:
        server.stop()


@pytest.mark.anyio
async def test_an_entry_larger_than_the_max_payload_is_a_store_error(server):
    nc, store = await _store(server.url)
    big = _entry(1, None)
    big.input_items = [{"type": "message", "text": "x" * (nc.max_payload + 1)}]
    with pytest.raises(StoreError, match="max payload"):
        await store.put("resp_big", big)
    await nc.close()


def test_without_jetstream_stored_response_routes_answer_503_naming_the_bucket(nats_server, tiny_model):
    """A NATS server without JetStream (the fixture's): the gateway serves on, and the routes
    that need the shared store say why they cannot."""
    from fastapi.testclient import TestClient

    from dualpath.config import BusConfig, GatewayConfig, ModelConfigSpec
    from services.gateway.app import build_app
    from services.gateway.core import Gateway

    gw = Gateway(GatewayConfig(), BusConfig(nats_url=nats_server.url), ModelConfigSpec(model=str(tiny_model)))
    with TestClient(build_app(gw)) as client:
        for method, path in (
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"),
            ("GET", "/v1/responses/resp_1/input_items"),
        ):
            r = client.request(method, path)
            assert r.status_code == 503 and "stored-responses bucket is unavailable" in r.json()["error"]["message"], r.text
        assert client.get("/v1/models").status_code == 200
