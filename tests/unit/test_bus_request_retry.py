"""``Bus.request`` retries once after "no responders" (a fresh connection can be told that for a
subject just served elsewhere), with a round trip to the server in between; the whole stays
within the request's timeout. The NATS connection is faked: what is tested is the retry."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from nats.errors import FlushTimeoutError, NoRespondersError

from dualpath.bus import Bus
from dualpath.bus.errors import BusTimeoutError
from dualpath.protocol import encode
from dualpath.protocol import messages as m

pytestmark = pytest.mark.anyio

REPLY = m.StateReply(prefill_engines=1, decode_engines=1, nodes=2, queued=0, running=0, policy="p")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Conn:
    """Answers "no responders" first, then ``REPLY``; a flush answers at once or, with
    ``stalled``, never (nats.py raises FlushTimeoutError when its timeout runs out)."""

    def __init__(self, stalled: bool) -> None:
        self.stalled, self.requests, self.flush_timeouts = stalled, 0, []
        self.is_reconnecting = False

    async def request(self, subject, data, timeout, headers=None):
        self.requests += 1
        if self.requests == 1:
            raise NoRespondersError
        return SimpleNamespace(data=encode(REPLY))

    async def flush(self, timeout=10):
        self.flush_timeouts.append(timeout)
        if self.stalled:
            await asyncio.sleep(timeout)
            raise FlushTimeoutError


async def test_after_no_responders_a_round_trip_and_a_second_request_get_the_answer() -> None:
    conn = _Conn(stalled=False)
    reply = await Bus(conn, "probe", tasks=None).request("t.state", m.StateRequest(), m.StateReply, timeout=5.0)  # type: ignore[arg-type]
    assert reply == REPLY and conn.requests == 2 and len(conn.flush_timeouts) == 1


async def test_a_server_that_stops_answering_after_no_responders_times_out_within_the_request_timeout() -> None:
    conn = _Conn(stalled=True)
    started = time.monotonic()
    with pytest.raises(BusTimeoutError):
        await Bus(conn, "probe", tasks=None).request("t.state", m.StateRequest(), m.StateReply, timeout=0.6)  # type: ignore[arg-type]
    took = time.monotonic() - started
    assert took < 1.2, f"{took:.1f} s: the round trip outlived the request's 0.6 s timeout"
    assert conn.requests == 1 and all(t <= 0.6 for t in conn.flush_timeouts)
