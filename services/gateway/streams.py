"""Per-request token streams: one NATS wildcard subscription, events routed to bounded queues.

The first token comes from the prefill engine and the rest from the decode engine, so two
publishers feed one stream; events are re-ordered by ``index`` before a consumer sees them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from dualpath.protocol import ProtocolError, decode
from dualpath.protocol.messages import TokenEvent
from dualpath.telemetry.logs import get_logger

__all__ = ["StreamOverflowError", "TokenStreams"]

log = get_logger("gateway.streams")
_MAX_PENDING = 4096


class StreamOverflowError(Exception):
    """Raised when a request's consumer fell more than ``_MAX_PENDING`` events behind."""


class _Stream:
    __slots__ = ("held", "next_index", "overflow", "queue")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue(maxsize=_MAX_PENDING)
        self.next_index = 0
        self.held: dict[int, TokenEvent] = {}
        self.overflow = False  # the consumer fell too far behind: the stream is broken


class TokenStreams:
    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}

    def open(self, request_id: str) -> None:
        self._streams[request_id] = _Stream()

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def on_message(self, raw) -> None:
        """NATS callback for the gateway's wildcard token subject."""
        try:
            ev = decode(raw.data, TokenEvent)
        except ProtocolError as exc:
            log.warning("bad_token_event", error=exc.reason)
            return
        st = self._streams.get(ev.request_id)
        if st is None or st.overflow:
            return  # request already finished, cancelled or broken
        if ev.index < st.next_index:
            return  # duplicate after a retry
        st.held[ev.index] = ev
        while st.next_index in st.held:
            nxt = st.held.pop(st.next_index)
            st.next_index += len(nxt.token_ids)
            if st.queue.full():
                # Raising here would only reach NATS's error callback and leave the consumer
                # waiting for its timeout; mark the stream broken and let ``events`` say so.
                st.overflow = True
                st.held.clear()
                return
            st.queue.put_nowait(nxt)
            if nxt.finish_reason is not None:
                # anything after the final event is irrelevant
                st.held.clear()
                break

    async def events(self, request_id: str, timeout: float) -> AsyncIterator[TokenEvent]:
        """Yield the request's events in order until the final one.

        Raises:
            TimeoutError: the request did not finish within ``timeout`` seconds.
            StreamOverflowError: the consumer fell more than ``_MAX_PENDING`` events behind.
        """
        st = self._streams[request_id]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if st.overflow and st.queue.empty():
                raise StreamOverflowError(request_id)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(request_id)
            ev = await asyncio.wait_for(st.queue.get(), remaining)
            yield ev
            if ev.finish_reason is not None:
                return
