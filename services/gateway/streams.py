"""Per-request token streams: one NATS wildcard subscription, events routed to bounded queues.

The first token comes from the prefill engine and the rest from the decode engine, so two
publishers feed one stream; events are re-ordered by ``index`` before a consumer sees them.

A request can be *run* more than once: the scheduler re-dispatches it when an engine dies
(``TokenEvent.attempt`` counts those placements), and the gateway submits it again when the
scheduler that held it lost leadership (the *submission*, carried by the reply subject:
``stream_key``). Every run generates the answer again from its first token, so a stream follows one run at a
time, the newest ``(submission, attempt)`` it has heard from:

- on the first event of a newer run, events held from older runs are dropped; the new run's
  tokens below ``next_index`` are checked against those already delivered and skipped (an
  event that straddles ``next_index`` is cut there), so the answer resumes exactly where it
  stopped;
- an older run's event is used only when it continues the answer right now (it covers
  ``next_index``), never held: a run that was superseded but keeps going (an engine that was
  expelled while paused and resumed) cannot leave a gap or stale tokens behind, nor a hang;
- when a replay differs from what was delivered (sampling without a seed), a streamed answer
  ends with an explicit error rather than splicing two answers; a *restartable* stream (the
  gateway showed the client nothing yet: non-streamed answers) starts over instead: the
  consumer gets ``Restarted`` and then the followed run from index 0;
- an error event of the scheduler ends the stream whatever its index.

A stream also remembers which decode engine serves the run it follows
(``TokenEvent.decode_engine``): when that engine is lost, the gateway resubmits the request
(``Gateway``), since the scheduler that placed it may have died meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from dualpath.protocol import ProtocolError, decode
from dualpath.protocol.messages import TokenEvent
from dualpath.telemetry.logs import get_logger

__all__ = ["Restarted", "StreamOverflowError", "TokenStreams", "stream_key"]

log = get_logger("gateway.streams")
_MAX_PENDING = 4096
_SUBMISSION = "-s"  # stream_key separator: request ids are "cmpl-<hex>" / "chatcmpl-<hex>"
DIVERGED = "the request was run again after a failure and its new answer differs from the part already streamed"


class StreamOverflowError(Exception):
    """Raised when a request's consumer fell more than ``_MAX_PENDING`` events behind."""


@dataclass(frozen=True, slots=True)
class Restarted:
    """Yielded by ``TokenStreams.events``: forget the tokens so far, a new run starts from index 0."""

    submission: int
    attempt: int


def stream_key(request_id: str, submission: int) -> str:
    """The last token of the reply subject of ``request_id``'s ``submission``-th submission."""
    return request_id if submission == 0 else f"{request_id}{_SUBMISSION}{submission}"


def _submission(subject: str, request_id: str) -> int | None:
    """The submission a reply subject names (0 when the subject is unknown), None if it names
    another request."""
    key = subject.rsplit(".", 1)[-1] if subject else request_id
    if key == request_id:
        return 0
    head, sep, n = key.rpartition(_SUBMISSION)
    return int(n) if sep and head == request_id and n.isdigit() else None


def _tail(ev: TokenEvent, skip: int) -> TokenEvent:
    """``ev`` without its first ``skip`` tokens (and their logprobs)."""
    return replace(
        ev,
        index=ev.index + skip,
        token_ids=ev.token_ids[skip:],
        logprobs=ev.logprobs[skip:],
        top_logprobs=ev.top_logprobs[skip:],
    )


class _Stream:
    __slots__ = (
        "delivered",
        "done",
        "engine",
        "held",
        "last_event",
        "next_index",
        "overflow",
        "queue",
        "request_id",
        "restartable",
        "restarted",
        "run",
        "submissions",
    )

    def __init__(self, request_id: str, restartable: bool) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[TokenEvent | Restarted] = asyncio.Queue(maxsize=_MAX_PENDING)
        self.next_index = 0
        self.held: dict[int, TokenEvent] = {}  # events of ``run`` past next_index, by index
        self.run: tuple[int, int] | None = None  # (submission, attempt) followed; None before the first event
        self.delivered: list[int] = []  # token ids queued so far (to check a newer run's replay)
        self.restartable = restartable
        self.restarted = False  # started over after a divergence: older runs are not used any more
        self.submissions = 0  # the newest submission of the request (see stream_key)
        self.overflow = False  # the consumer fell too far behind: the stream is broken
        self.done = False  # the final event is queued
        self.engine = ""  # the decode engine serving the followed run ("name@incarnation", or "name" from the first token)
        self.last_event = 0.0  # monotonic time of the last event of the followed run


class TokenStreams:
    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}

    def open(self, request_id: str, *, restartable: bool = False) -> None:
        """Start collecting ``request_id``'s events; ``restartable``: see the module docstring."""
        self._streams[request_id] = _Stream(request_id, restartable)

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def started(self, request_id: str) -> bool:
        """Whether any run of the request has sent an event (True for unknown requests)."""
        st = self._streams.get(request_id)
        return st is None or st.run is not None or st.done

    def serving(self, request_id: str, idle_s: float = 0.0) -> str:
        """The decode engine serving the run followed, for a request whose answer has started
        and not ended ("" otherwise, or when no event named one); with ``idle_s``, "" too when
        the run sent an event within the last ``idle_s`` seconds (its engine is alive)."""
        st = self._streams.get(request_id)
        if st is None or st.run is None or st.done or time.monotonic() - st.last_event < idle_s:
            return ""
        return st.engine

    def next_submission(self, request_id: str) -> int:
        """Number a new submission of the request (its events come on ``stream_key(rid, n)``);
        0 when the request is no longer open."""
        st = self._streams.get(request_id)
        if st is None or st.done:
            return 0
        st.submissions += 1
        return st.submissions

    def superseded(self, request_id: str, submission: int) -> bool:
        """Whether ``request_id``'s ``submission`` no longer needs to reach a scheduler: the
        request is closed or answered, or a newer submission of it was made."""
        st = self._streams.get(request_id)
        return st is None or st.done or st.submissions > submission

    def fail(self, request_id: str, error: str, code: int) -> None:
        """End the stream with an error event (e.g. a resubmission nobody accepted)."""
        st = self._streams.get(request_id)
        if st is not None and not st.done and not st.overflow:
            self._final_error(st, TokenEvent(request_id=request_id, index=st.next_index, token_ids=[], error=error, error_code=code))

    async def on_message(self, raw) -> None:
        """NATS callback for the gateway's wildcard token subject."""
        try:
            ev = decode(raw.data, TokenEvent)
        except ProtocolError as exc:
            log.warning("bad_token_event", error=exc.reason)
            return
        st = self._streams.get(ev.request_id)
        if st is None or st.overflow or st.done:
            return  # request already finished, cancelled or broken
        sub = _submission(getattr(raw, "subject", ""), ev.request_id)
        if sub is None:
            log.warning("token_event_subject_mismatch", request_id=ev.request_id, subject=raw.subject)
            return
        if ev.error or ev.finish_reason == "error":
            # The scheduler gave the request up (every attempt): final, whatever its index;
            # a failure told by the scheduler of an older submission is superseded.
            if st.run is None or sub >= st.run[0]:
                self._final_error(st, ev)
            return
        run = (sub, ev.attempt)
        if st.run is None:
            st.run = run
        elif run > st.run:
            log.info("token_stream_new_run", request_id=st.request_id, run=list(run), previous=list(st.run), next_index=st.next_index)
            st.run = run
            st.held.clear()  # only the followed run's events are ever held
            st.engine = ""
        if run == st.run:
            st.last_event = time.monotonic()
            if ev.decode_engine:
                st.engine = ev.decode_engine
        elif run < st.run and (st.restarted or not ev.index <= st.next_index < ev.index + max(1, len(ev.token_ids))):
            return  # an older run's event that does not continue the answer right now
        self._accept(st, ev, held=run == st.run)

    def _accept(self, st: _Stream, ev: TokenEvent, *, held: bool) -> None:
        """Deliver ``ev`` (or its part from ``next_index`` on); ``held``: keep it for later if
        it comes early (only events of the followed run are kept)."""
        if ev.index < st.next_index:
            # Another run regenerates the answer from its first token: what was delivered is
            # skipped, after checking it is the same (greedy and seeded sampling repeat it).
            seen = st.delivered[ev.index : ev.index + len(ev.token_ids)]
            if ev.token_ids[: len(seen)] != seen or (ev.finish_reason is not None and ev.index + len(ev.token_ids) < st.next_index):
                if not held:
                    return  # an older run that went another way: not followed
                log.warning("token_stream_diverged", request_id=ev.request_id, run=list(st.run or ()), index=ev.index)
                if not st.restartable:
                    self._final_error(st, replace(ev, token_ids=[], finish_reason="error", error=DIVERGED, error_code=503))
                    return
                # nothing was shown yet: the answer starts over with the followed run, older ones are ignored
                st.next_index, st.held, st.restarted = 0, {}, True
                st.delivered.clear()
                if not self._put(st, Restarted(*(st.run or (0, 0)))):
                    return
            elif ev.index + len(ev.token_ids) <= st.next_index and ev.finish_reason is None:
                return  # wholly delivered already
            else:
                ev = _tail(ev, st.next_index - ev.index)  # straddles next_index: keep the new tokens
        if ev.index != st.next_index and not held:
            return
        st.held[ev.index] = ev
        while st.next_index in st.held and not st.done:
            nxt = st.held.pop(st.next_index)
            st.next_index += len(nxt.token_ids)
            st.delivered.extend(nxt.token_ids)
            if nxt.finish_reason is not None:
                st.done = True  # anything after the final event is irrelevant
                st.held.clear()
            if not self._put(st, nxt):
                return

    def _final_error(self, st: _Stream, ev: TokenEvent) -> None:
        st.done = True
        st.held.clear()
        self._put(st, replace(ev, finish_reason="error"))

    @staticmethod
    def _put(st: _Stream, item: TokenEvent | Restarted) -> bool:
        if st.queue.full():
            # Raising here would only reach NATS's error callback and leave the consumer
            # waiting for its timeout; mark the stream broken and let ``events`` say so.
            st.overflow = True
            st.held.clear()
            return False
        st.queue.put_nowait(item)
        return True

    async def events(self, request_id: str, timeout: float) -> AsyncIterator[TokenEvent | Restarted]:
        """Yield the request's events in order until the final one (``Restarted`` when a
        restartable stream starts over).

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
            if isinstance(ev, TokenEvent) and ev.finish_reason is not None:
                return
