"""The gateway's token streams across runs of one request: a retry (a new ``attempt``) or a
resubmission (a new reply subject) generates the answer again from its first token, and the
client must get exactly one answer: resumed at the first undelivered token, never spliced
from two different runs, never stalled by a gap."""

from __future__ import annotations

import asyncio

import pytest

from dualpath.protocol import encode
from dualpath.protocol.messages import TokenEvent
from services.gateway.streams import DIVERGED, Restarted, TokenStreams, stream_key

NS = "dp.out.gw0."


class Raw:
    def __init__(self, ev: TokenEvent, submission: int = 0) -> None:
        self.data = encode(ev)
        self.subject = NS + stream_key(ev.request_id, submission)


def ev(index: int, tokens: list[int], attempt: int = 0, finish: str | None = None, **kw) -> TokenEvent:
    return TokenEvent(
        request_id="r", index=index, token_ids=tokens, logprobs=[-0.5] * len(tokens), attempt=attempt, finish_reason=finish, **kw
    )


def run(events: list[TokenEvent | tuple[TokenEvent, int]], *, restartable: bool = False, timeout: float = 1.0) -> list:
    """Feed ``events`` (optionally with a submission number), then read the stream to its end."""

    async def go() -> list:
        s = TokenStreams()
        s.open("r", restartable=restartable)
        for e in events:
            e, sub = e if isinstance(e, tuple) else (e, 0)
            await s.on_message(Raw(e, sub))
        out: list = []
        async for item in s.events("r", timeout=timeout):
            out.append("restart" if isinstance(item, Restarted) else (item.index, item.token_ids, item.finish_reason, item.error))
        return out

    return asyncio.run(go())


def tokens(out: list) -> list[int]:
    return [t for item in out if item != "restart" for t in item[1]]


def test_a_retried_stream_resumes_exactly_where_delivery_stopped_when_an_event_straddles_it():
    first = [ev(0, [10]), ev(1, [11]), ev(2, [12])]  # delivered, then the decode engine died
    retry = [ev(0, [10], 1), ev(1, [11, 12, 13], 1), ev(4, [14], 1), ev(5, [], 1, "length")]  # stream_interval 3
    out = run(first + retry)
    assert tokens(out) == [10, 11, 12, 13, 14]
    assert out[-1][2] == "length"
    assert out[3] == (3, [13], None, "")  # the straddling event, cut at the first undelivered index


def test_events_held_from_an_older_attempt_are_dropped_when_a_retry_starts():
    # index 2 of attempt 0 arrived, index 1 never did (its engine died): it was held
    first = [ev(0, [10]), ev(2, [99, 98])]
    retry = [ev(0, [10], 1), ev(1, [11], 1), ev(2, [12], 1), ev(3, [], 1, "stop")]
    assert tokens(run(first + retry)) == [10, 11, 12]


def test_an_older_runs_events_are_never_held_once_a_newer_run_is_followed():
    # attempt 0's index-3 event arrives late, ahead of the stream: not kept (it may be stale)
    events = [ev(0, [10]), ev(1, [11]), ev(0, [10], 1), ev(3, [99]), ev(1, [11], 1), ev(2, [12], 1), ev(3, [13], 1), ev(4, [], 1, "length")]
    out = run(events)
    assert tokens(out) == [10, 11, 12, 13] and out[-1][2] == "length"


def test_an_older_run_that_keeps_going_completes_the_answer_when_the_newer_one_stalls():
    # the retry's first token came (attempt 1), but its decode engine took the hand-off as a
    # duplicate of attempt 0, which it still runs: attempt 0's events continue the answer
    events = [ev(0, [10]), ev(1, [11]), ev(0, [10], 1), ev(2, [12]), ev(3, [13]), ev(4, [], 0, "length")]
    out = run(events)
    assert tokens(out) == [10, 11, 12, 13] and out[-1][2] == "length"


def test_a_non_streamed_answer_that_started_over_ignores_older_runs():
    events = [ev(0, [10]), ev(0, [20], 1), ev(1, [11]), ev(1, [21], 1), ev(2, [], 0, "length"), ev(2, [], 1, "length")]
    out = run(events, restartable=True)
    assert out[1] == "restart" and tokens(out[2:]) == [20, 21] and out[-1][2] == "length"


def test_a_retry_that_regenerates_different_tokens_ends_a_streamed_answer_with_an_error_not_a_splice():
    first = [ev(0, [10]), ev(1, [11])]
    retry = [ev(0, [10], 1), ev(1, [77], 1), ev(2, [78], 1), ev(3, [], 1, "length")]  # sampling without a seed
    out = run(first + retry)
    assert tokens(out) == [10, 11]
    assert out[-1][2] == "error" and out[-1][3] == DIVERGED


def test_a_non_streamed_answer_starts_over_with_the_new_run():
    first = [ev(0, [10]), ev(1, [11])]
    retry = [ev(0, [20], 1), ev(1, [21], 1), ev(2, [22], 1), ev(3, [], 1, "length")]
    out = run(first + retry, restartable=True)
    assert out[2] == "restart"
    assert tokens(out[3:]) == [20, 21, 22] and out[-1][2] == "length"


def test_the_schedulers_error_ends_a_stream_whose_tokens_already_went_out():
    out = run([ev(0, [10]), ev(1, [11]), ev(0, [], finish="error", error="request failed after 3 attempts", error_code=503)])
    assert tokens(out) == [10, 11] and out[-1][2:] == ("error", "request failed after 3 attempts")


def test_a_resubmission_supersedes_the_run_of_the_lost_scheduler():
    # the dead scheduler's run (submission 0, attempt 2) streamed two tokens; the new
    # scheduler's run (submission 1, attempt 0) replays them and finishes
    events = [
        (ev(0, [10], 2), 0),
        (ev(1, [11], 2), 0),
        (ev(0, [10]), 1),
        (ev(1, [11, 12]), 1),
        (ev(2, [52], 2), 0),
        (ev(3, [], 0, "length"), 1),
    ]
    out = run(events)
    assert tokens(out) == [10, 11, 12] and out[-1][2] == "length"


def test_events_on_another_requests_subject_are_refused():
    async def go() -> bool:
        s = TokenStreams()
        s.open("r")
        raw = Raw(ev(0, [10]))
        raw.subject = NS + "other-s1"
        await s.on_message(raw)
        return s.started("r")

    assert asyncio.run(go()) is False


def test_a_request_is_started_once_any_run_sent_an_event():
    async def go() -> list[bool]:
        s = TokenStreams()
        s.open("r")
        before = s.started("r")
        await s.on_message(Raw(ev(0, [10]), 1))
        return [before, s.started("r"), s.next_submission("r") == 1]

    assert asyncio.run(go()) == [False, True, True]


@pytest.mark.parametrize("submission", [0, 3])
def test_stream_keys_name_the_submission(submission):
    from services.gateway.streams import _submission

    assert _submission(NS + stream_key("cmpl-ab12", submission), "cmpl-ab12") == submission
