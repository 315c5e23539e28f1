"""``Bus.serve`` returns once the server has the subscription, across a reconnection.

Its round trip is a PING answered. A PING that goes out on a connection the server then drops
is never answered, and nats.py's flush waits out its whole timeout (10 s) and raises: a service
starting while its connection dropped failed that way. Here the server stops (SIGSTOP) while the
PING is in flight, is killed, and a new one takes its port.
"""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest
from conftest import pause, spawn_nats

from dualpath.bus import Bus
from dualpath.ha.natscluster import nats_servers
from dualpath.protocol import messages as m

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _state(_req: m.StateRequest) -> m.StateReply:
    return m.StateReply(prefill_engines=1, decode_engines=1, nodes=2, queued=0, running=0, policy="p")


async def test_serve_returns_when_its_ping_was_lost_with_a_dropped_connection(tmp_path) -> None:
    spec = nats_servers(1, tmp_path)[0]
    log = tmp_path / "nats.log"
    proc = spawn_nats(spec.cmd, spec.url, log)
    try:
        async with Bus.open(spec.url, "probe") as bus:
            pause(proc.pid)
            started = time.monotonic()
            serving = asyncio.ensure_future(bus.serve("t.state", _state, m.StateRequest))
            await asyncio.sleep(0.3)  # SUB and PING are in the socket, unanswered
            proc.kill()
            proc.wait(5)
            proc = spawn_nats(spec.cmd, spec.url, log)  # the same port: the client reconnects to it
            await asyncio.wait_for(serving, 8.0)  # nats.py's flush alone raises after 10 s
            took = time.monotonic() - started
            reply = await bus.request("t.state", m.StateRequest(), m.StateReply, timeout=5.0)
            assert reply.nodes == 2
            print(f"serve returned {took:.1f} s after its PING went out")
    finally:
        proc.kill()
        proc.wait(5)


async def test_serve_called_while_the_client_reconnects_returns_once_the_server_has_the_subscription(tmp_path) -> None:
    """nats.py's flush returns at once, with no PING, while its client reconnects: a serve that
    trusted it returned before any server had the subscription."""
    spec = nats_servers(1, tmp_path)[0]
    log = tmp_path / "nats.log"
    proc = spawn_nats(spec.cmd, spec.url, log)
    try:
        async with Bus.open(spec.url, "probe") as bus:
            proc.kill()
            proc.wait(5)
            with anyio.fail_after(5):
                while not bus.nc.is_reconnecting:
                    await asyncio.sleep(0.01)
            serving = asyncio.ensure_future(bus.serve("t.state", _state, m.StateRequest))
            await asyncio.sleep(1.0)
            assert not serving.done(), "serve returned while no server was up"
            proc = spawn_nats(spec.cmd, spec.url, log)
            await asyncio.wait_for(serving, 8.0)
            assert bus.nc.is_connected
            reply = await bus.request("t.state", m.StateRequest(), m.StateReply, timeout=5.0)
            assert reply.nodes == 2
    finally:
        proc.kill()
        proc.wait(5)
