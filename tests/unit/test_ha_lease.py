"""The JetStream KV leadership lease: one holder at a time, takeover after expiry, release on stop."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from dualpath.bus.embedded import EmbeddedNats
from dualpath.ha.lease import LeaderLease, LeaseLostError

pytestmark = pytest.mark.anyio


@pytest.fixture()
def js_server(tmp_path):
    server = EmbeddedNats(jetstream_dir=str(tmp_path / "js")).start()
    try:
        yield server
    finally:
        server.stop()


async def test_only_one_candidate_holds_the_lease_and_a_standby_takes_over_after_expiry(js_server):
    nc = await nats.connect(js_server.url)
    try:
        js = nc.jetstream()
        a = LeaderLease(js, "t_leader", "a", ttl=1.5, margin=0.3)
        b = LeaderLease(js, "t_leader", "b", ttl=1.5, margin=0.3)
        assert await a.try_acquire()
        assert not await b.try_acquire()
        await a.renew()
        assert a.valid
        t0 = time.monotonic()  # a stops renewing (killed or paused): b wins once the key expires
        assert await asyncio.wait_for(b.acquire(asyncio.Event()), 10)
        took = time.monotonic() - t0
        # not before the key's TTL (less the renew's round trip); the upper bound leaves a shared
        # host 3 s over TTL + poll (a standby that never takes over hits the 10 s wait above)
        assert 1.0 < took < 1.5 + 1.5 / 4 + 3.0, took
        assert not a.valid
        with pytest.raises(LeaseLostError):
            await a.renew()  # a resumes: its compare-and-set fails, it must stop acting
    finally:
        await nc.close()


async def test_a_released_lease_is_taken_at_once(js_server):
    nc = await nats.connect(js_server.url)
    try:
        js = nc.jetstream()
        a = LeaderLease(js, "t_leader2", "a", ttl=5.0)
        b = LeaderLease(js, "t_leader2", "b", ttl=5.0)
        stop = asyncio.Event()
        assert await a.try_acquire()
        holding = asyncio.ensure_future(a.hold(stop))
        await asyncio.sleep(0.2)
        stop.set()
        await holding
        t0 = time.monotonic()
        assert await b.try_acquire()
        assert time.monotonic() - t0 < 5.0 - 1.0  # at once: well before the 5 s TTL would free it
    finally:
        await nc.close()
