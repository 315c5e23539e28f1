"""After a client loses its NATS server, it tries the other servers of the cluster before that one.

A server cut off by the network fails a connect only after the connect timeout (2 s); nats.py's
own order (a shuffle) tries it first a third of the time in a cluster of three. Here a server is
made to stop answering with SIGSTOP, as a cut would: the kernel still accepts connections on
its port, and nothing answers on them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from conftest import pause, spawn_nats

from dualpath.bus import Bus
from dualpath.bus.client import _RECONNECT_WAIT_S, ReconnectOrder
from dualpath.ha.natscluster import nats_servers

# nats.py leaves the socket of a connection it gave up on for the garbage collector, which Python
# reports as an unraisable ResourceWarning; conftest collects them when this module ends, here.
pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _server(netloc: str, reconnects: int = 0):
    import nats.aio.client

    return nats.aio.client.Server(uri=urlparse(f"nats://{netloc}"), reconnects=reconnects)


def test_the_server_just_lost_is_tried_after_every_other_one_then_all_take_turns() -> None:
    order = ReconnectOrder()
    order.connected(urlparse("nats://h0:4222"))
    lost, a, b = _server("h0:4222"), _server("h1:4222"), _server("h2:4222")
    assert order([lost, a, b], {}) == (a, 0.0)  # first of the others, at once
    a.reconnects = 1
    assert order([lost, a, b], {}) == (b, 0.0)
    b.reconnects = 1
    assert order([lost, a, b], {}) == (lost, 0.0)  # each other one failed once: now the lost one
    lost.reconnects = 1
    assert order([lost, a, b], {}) == (a, _RECONNECT_WAIT_S)  # then turns, each after a pause
    alone = _server("h0:4222")
    assert order([alone], {}) == (alone, 0.0)  # the only server is tried
    assert order([], {}) == (None, 0.0)


class _Cluster:
    def __init__(self, root: Path) -> None:
        self.specs = nats_servers(3, root)
        self.procs = [spawn_nats(spec.cmd, spec.url, root / f"{spec.name}.log") for spec in self.specs]

    def proc_of(self, netloc: str) -> subprocess.Popen:
        return next(p for s, p in zip(self.specs, self.procs, strict=True) if urlparse(s.url).netloc == netloc)

    def stop(self) -> None:
        for p in self.procs:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
        for p in self.procs:
            p.wait(10)


@pytest.fixture
def cluster(tmp_path):
    c = _Cluster(tmp_path)
    yield c
    c.stop()


async def test_a_client_whose_server_stops_answering_reconnects_to_a_live_one_first(cluster) -> None:
    """Four times over, the server the client is on stops answering: the client reconnects to
    another one, and the stopped one is not the first it tries (nats.py's shuffle alone puts it
    first in 1 of 3 outages, a 1 - (2/3)**4 = 80% chance over four)."""
    urls = [s.url for s in cluster.specs]
    async with Bus.open(urls, "probe", ping_interval=0.5, max_outstanding_pings=2) as bus:
        nc = bus.nc
        order = nc._reconnect_to_server_handler
        assert isinstance(order, ReconnectOrder)
        tried: list[str] = []

        def recorded(servers, info):  # the order's answers, as nats.py gets them
            pick, delay = order(servers, info)
            tried.append(pick.uri.netloc if pick is not None else "")
            return pick, delay

        nc._reconnect_to_server_handler = recorded
        for _ in range(4):
            before = nc.connected_url.netloc
            proc = cluster.proc_of(before)
            tried.clear()
            started = time.monotonic()
            pause(proc.pid)
            try:
                while not (nc.is_connected and nc.connected_url.netloc != before):
                    assert time.monotonic() - started < 10, f"no reconnection within 10 s; tried {tried}"
                    await asyncio.sleep(0.05)
                await nc.flush(timeout=2)  # the new server answers
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert tried and tried[0] != before, (before, tried)


def test_the_other_servers_drop_their_route_to_a_server_that_stops_answering(cluster, tmp_path) -> None:
    """Within 3 route PINGs 2 s apart (the default is 2 x 2 minutes): until a route is dropped,
    the survivors still send requests to queue subscribers behind it, and those are lost."""
    stopped = cluster.specs[0].name
    pause(cluster.procs[0].pid)
    started = time.monotonic()
    try:
        logs = [tmp_path / f"{s.name}.log" for s in cluster.specs[1:]]
        while not all(f"Stale Connection - Remote: {stopped}" in log.read_text() for log in logs):
            assert time.monotonic() - started < 12, [log.read_text()[-2000:] for log in logs]
            time.sleep(0.2)
    finally:
        os.kill(cluster.procs[0].pid, signal.SIGCONT)
    print(f"routes to {stopped} dropped {time.monotonic() - started:.1f} s after it stopped")
