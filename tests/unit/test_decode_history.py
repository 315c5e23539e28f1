"""Queue order from measured history: the scheduler learns each session's decode time from
its earlier turns (``DecodeHistory``) and places the longest expected decode first; an API's
``max_tokens`` (a cap, not a length) does not reorder anything by default."""

from __future__ import annotations

import pytest

from dualpath.core import RequestFinished
from dualpath.policy.errors import InvalidThresholdError
from dualpath.policy.history import DecodeHistory
from tests.unit.test_scheduler_core import Cluster


def reserved(cmds) -> list[str]:
    return [cmd.request_id for cmd in cmds if type(cmd).__name__ == "ReserveSlot"]


def test_the_history_is_an_exponentially_weighted_mean_per_session_and_bounded():
    h = DecodeHistory(weight=0.5, max_sessions=2)
    assert h.predict("a") == 0.0 and h.predict("") == 0.0
    h.observe("a", 2.0)
    h.observe("a", 4.0)
    assert h.predict("a") == pytest.approx(3.0)
    h.observe("", 9.0)  # no session: nothing learned
    h.observe("b", 1.0)
    h.observe("a", 3.0)  # a is now the most recently updated
    h.observe("c", 5.0)  # over the bound: b (least recently updated) is forgotten
    assert (h.predict("a"), h.predict("c"), len(h), h.knows("b")) == (3.0, 5.0, 2, False)
    assert h.predict("b") == pytest.approx(4.0)  # an unmeasured session: the mean of the measured ones
    assert h.predict("") == 0.0
    with pytest.raises(InvalidThresholdError):
        DecodeHistory(weight=0.0)


def run_turn(c: Cluster, rid: str, session: str, decode_s: float) -> None:
    """One turn of ``session``: placed, prefilled, then decoded for ``decode_s`` seconds."""
    d = c.place(rid, session=session)
    c.handle(RequestFinished(now=c.now, request_id=rid, engine=d.prefill_engine))
    c.now += decode_s
    c.handle(RequestFinished(now=c.now, request_id=rid, engine=d.decode_engine))


@pytest.mark.parametrize(("history_credit", "first"), [(5.0, "long-2"), (0.0, "short-2")])
def test_a_session_whose_turns_decoded_longer_is_placed_first_among_close_submissions(history_credit, first):
    c = Cluster(history_credit=history_credit)
    run_turn(c, "long-1", "agent-long", 2.0)
    run_turn(c, "short-1", "agent-short", 0.1)
    assert c.core.history.predict("agent-long") == pytest.approx(2.0)
    c.submit("short-2", session="agent-short")
    c.now += 0.5  # submitted later, but expected to decode ~2 s: 10 s of credit against 0.5 s
    c.submit("long-2", session="agent-long")
    assert reserved(c.tick())[0] == first


def test_max_tokens_alone_does_not_reorder_the_queue_by_default():
    c = Cluster()
    c.submit("short", max_tokens=10)
    c.now += 0.5
    c.submit("long", max_tokens=4096)
    assert reserved(c.tick()) == ["short", "long"]


@pytest.mark.parametrize(("history_credit", "first"), [(5.0, "long-2"), (0.0, "short-2")])
def test_a_turn_submitted_before_its_previous_turns_finish_is_known_is_re_ranked_when_it_is(history_credit, first):
    # The client sees the last token before the scheduler hears of the decode's end (engines
    # report finishes periodically), so an agent's next turn is often queued first.
    c = Cluster(history_credit=history_credit)
    run_turn(c, "short-1", "agent-short", 0.1)
    d = c.place("long-1", session="agent-long")
    c.handle(RequestFinished(now=c.now, request_id="long-1", engine=d.prefill_engine))
    c.now += 2.0
    c.submit("short-2", session="agent-short")
    c.now += 0.1
    c.submit("long-2", session="agent-long")  # no history for agent-long yet: ranked by submission
    c.now += 0.1
    c.handle(RequestFinished(now=c.now, request_id="long-1", engine=d.decode_engine))  # now it is known
    assert c.core.history.predict("agent-long") == pytest.approx(2.2)
    assert reserved(c.tick())[0] == first


def test_an_urgent_request_keeps_its_place_when_its_session_is_learned():
    c = Cluster(urgent_wait_s=1.0)
    d = c.place("a-1", session="a")
    c.handle(RequestFinished(now=c.now, request_id="a-1", engine=d.prefill_engine))
    c.submit("a-2", session="a")
    c.now += 1.5
    c.submit("b-1", session="b")
    c.core.order.promote_urgent(c.now)  # a-2 has waited 1.5 s: ahead of every fresher request
    rank = c.core.requests["a-2"].rank
    c.handle(RequestFinished(now=c.now, request_id="a-1", engine=d.decode_engine))
    assert c.core.requests["a-2"].rank == rank
    assert [t.rid for t in c.core.queue] == ["a-2", "b-1"]


def test_first_turns_queued_before_any_session_was_measured_move_ahead_of_agents_measured_to_decode_less_than_the_typical_one():
    # 0 s: a burst of first turns (no history: ranked FIFO); then one agent finishes a short
    # turn and one a long turn, and the short one's next turn is queued. The first turns
    # still waiting are expected to decode as the typical agent (the mean, 0.125 s), so they
    # go ahead of the short agent's second turn (0.05 s expected), not behind it.
    c = Cluster(history_credit=5.0)
    d_long = c.place("long-1", session="long")
    d_short = c.place("short-1", session="short")
    for rid, d in (("long-1", d_long), ("short-1", d_short)):
        c.handle(RequestFinished(now=c.now, request_id=rid, engine=d.prefill_engine))
    c.submit("first-a", session="a")
    c.submit("first-b", session="b")
    c.now += 0.05
    c.handle(RequestFinished(now=c.now, request_id="short-1", engine=d_short.decode_engine))
    c.now += 0.15
    c.handle(RequestFinished(now=c.now, request_id="long-1", engine=d_long.decode_engine))
    assert c.core.history.prior() == pytest.approx(0.125, rel=0.05)
    c.submit("short-2", session="short")  # 0.2 s - 5 x 0.05 s: ahead of 0 s, behind 0 s - 5 x 0.125 s
    assert [t.rid for t in c.core.queue] == ["first-a", "first-b", "short-2"]
    c.submit("long-2", session="long")  # measured at 0.2 s: ahead of the typical agent
    assert [t.rid for t in c.core.queue][0] == "long-2"
