"""The scheduler's queue order: who waits ahead of whom (``QueueOrder``).

A queued request ranks by its submission time less a credit for its expected decode length
(``history_credit`` x its session's predicted decode seconds, ``DecodeHistory``; plus
``decode_credit_s`` x ``max_tokens`` only where clients' ``max_tokens`` are real length
estimates). Among requests submitted close together the longest decode is placed, and
reads, first: it is the one whose end comes last, and its agent's next turn with it
(longest processing time first, the makespan rule for a closed loop). Three rules keep the
order right as time passes:

- *urgent*: a request that has waited ``urgent_wait_s`` goes ahead of every fresher one
  (FIFO among such), so a short request is not held back by longer ones for more than that
  (the paper's TTFT SLO is 4 s);
- *re-rank when a finish is learned*: the client sees a turn's last token before the decode
  engine's next report tells the scheduler, so an agent's next turn is often queued before
  its previous turn was measured; it takes its place by the new prediction when it is;
- *a prior for unmeasured sessions*: a session not measured yet is expected to decode as
  the typical one (``DecodeHistory.prior``), and the queued requests ranked by that prior
  are ranked again when it moves by a fifth.

Retries (re-queued at the head, rank -inf) and urgent requests keep their places. No I/O,
no clock of its own; the core owns the requests and says which are still waiting.

The queue itself is a ``RankedQueue``: a heap by (rank, order of queueing) that keeps
each request's place in it, so a re-rank or a promotion costs O(log n) however many
requests wait (a sorted deque paid O(n) for each: at 48K agents submitting at once that was
most of a simulated rollout's first minutes), and a pass reads its window without popping.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from heapq import heappop, heappush
from operator import attrgetter
from typing import Final

from dualpath.policy.history import DecodeHistory

__all__ = ["QueueOrder", "Queued", "RankedQueue"]

_INF: Final = float("inf")
_URGENT_S: Final = 1e12  # an urgent request ranks this much earlier than its submission: ahead of any decode credit


class Queued:
    """What the order keeps of a request (the core's request type extends it)."""

    __slots__ = ("at", "by_prior", "pos", "rank", "rank_base", "tie")

    def __init__(self, now: float) -> None:
        self.rank = now  # its place in the queue
        self.at = now  # the rank it is queued by (``rank`` may change first; ``RankedQueue.rerank`` catches up)
        self.tie = 0  # its order among equal ranks in a RankedQueue (set by each push)
        self.pos = -1  # its index in the RankedQueue's heap (-1: not queued)
        self.rank_base = now  # its rank before the history credit (submission less any max_tokens credit)
        self.by_prior = False  # ranked by the history's prior (its session had no measured turn yet)

    @property
    def by_credit(self) -> bool:
        """Ranked by its decode credit (not urgent, not a retry at the head)."""
        return self.rank > self.rank_base - _URGENT_S / 2


_place: Final = attrgetter("at", "tie")  # (rank queued by, tie): unique, the queue's order


def _rank(t: Queued) -> float:
    return t.rank


class RankedQueue:
    """Requests sorted by ``rank``, first come first among equal ranks (``push``), or at
    the very head (``push_front``: the newest such first). A heap of the requests by
    ``(at, tie)`` (ties are unique) in which each request keeps its index (``pos``): a
    removal moves the last request into its place, up or down."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[Queued] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return len(self._heap) > 0

    def __iter__(self) -> Iterator[Queued]:
        """The queued requests in order (a sorted copy: O(n log n), for views and tests)."""
        return iter(sorted(self._heap, key=_place))

    def members(self) -> list[Queued]:
        """The queued requests in no particular order (O(n))."""
        return list(self._heap)

    def push(self, t: Queued, rank: float) -> None:
        """Queue ``t`` by ``rank``, after every request queued before it at a rank at most its own."""
        self._seq += 1
        t.rank = t.at = rank
        t.tie = self._seq
        self._heap.append(t)
        self._up(t, len(self._heap) - 1)

    def push_front(self, t: Queued) -> None:
        """Queue ``t`` at the head, ahead of every request (earlier ``push_front``s included)."""
        self._seq += 1
        t.rank = t.at = -_INF
        t.tie = -self._seq
        self._heap.append(t)
        self._up(t, len(self._heap) - 1)

    def remove(self, t: Queued) -> None:
        """Take ``t`` (queued) out of the queue."""
        self._take(t.pos)

    def popleft(self) -> Queued:
        """The first request, taken out of the queue."""
        return self._take(0)

    def _take(self, pos: int) -> Queued:
        heap = self._heap
        t = heap[pos]
        t.pos = -1
        last = heap.pop()
        if pos < len(heap):  # the last request fills the hole, then finds its place
            if pos > 0:
                p = heap[(pos - 1) >> 1]
                if last.at < p.at or (last.at == p.at and last.tie < p.tie):
                    self._up(last, pos)
                    return t
            self._down(last, pos)
        return t

    def _up(self, t: Queued, pos: int) -> None:
        heap = self._heap
        at, tie = t.at, t.tie
        while pos > 0:
            parent = (pos - 1) >> 1
            p = heap[parent]
            if at < p.at or (at == p.at and tie < p.tie):
                heap[pos] = p
                p.pos = pos
                pos = parent
            else:
                break
        heap[pos] = t
        t.pos = pos

    def _down(self, t: Queued, pos: int) -> None:
        heap = self._heap
        n = len(heap)
        at, tie = t.at, t.tie
        child = 2 * pos + 1
        while child < n:
            c = heap[child]
            right = child + 1
            if right < n:
                r = heap[right]
                if r.at < c.at or (r.at == c.at and r.tie < c.tie):
                    child, c = right, r
            if at < c.at or (at == c.at and tie < c.tie):
                break
            heap[pos] = c
            c.pos = pos
            pos = child
            child = 2 * pos + 1
        heap[pos] = t
        t.pos = pos

    def head(self, k: int) -> list[Queued]:
        """The first ``k`` requests in order, without taking them out (a best-first walk of
        the heap: O(k log k))."""
        heap = self._heap
        n = len(heap)
        out: list[Queued] = []
        if not n or k <= 0:
            return out
        frontier = [(heap[0].at, heap[0].tie, 0)]
        while frontier:
            _, _, i = heappop(frontier)
            out.append(heap[i])
            if len(out) == k:
                break
            child = 2 * i + 1
            if child < n:
                c = heap[child]
                heappush(frontier, (c.at, c.tie, child))
                if child + 1 < n:
                    c = heap[child + 1]
                    heappush(frontier, (c.at, c.tie, child + 1))
        return out

    def rerank(self) -> None:
        """The requests' ``rank``s were changed in place: sort them again, keeping the current
        order among equal ranks (as a stable sort of the queue would)."""
        live = sorted(self._heap, key=_place)  # the current order
        live.sort(key=_rank)  # stable: equal ranks keep it
        self._heap = live  # ascending: already a heap
        for i, t in enumerate(live):
            self._seq += 1
            t.tie = self._seq
            t.at = t.rank
            t.pos = i


class QueueOrder:
    """The queue, sorted by rank, and the rules that rank it (module docstring).

    ``waiting(t, attempt)`` tells whether request ``t`` is still queued as ``attempt``.
    """

    def __init__(
        self,
        *,
        history_credit: float,
        decode_credit_s: float,
        urgent_wait_s: float,
        waiting: Callable[[Queued, int], bool],
    ) -> None:
        self.history_credit, self.decode_credit_s, self.urgent_wait_s = history_credit, decode_credit_s, urgent_wait_s
        self.items = RankedQueue()  # by rank: retries (-inf), then urgent ones, then the rest
        self.history = DecodeHistory()  # per-session decode seconds
        self._waiting = waiting
        self._arrivals: deque[tuple[float, int, Queued]] = deque()  # (queued since, attempt, request) in queueing order
        self._turns: dict[str, tuple[Queued, int]] = {}  # session -> its newest submitted request (re-ranked when learned)
        self._prior = 0.0  # the prior the queued requests of unmeasured sessions are ranked by

    def __len__(self) -> int:
        return len(self.items)

    def submit(self, t: Queued, now: float, attempt: int, session: str, max_tokens: int) -> None:
        """Queue a new request by its submission and its expected decode."""
        history = self.history
        t.rank_base = now - self.decode_credit_s * max_tokens
        t.by_prior = bool(session) and not history.knows(session)
        self.items.push(t, t.rank_base - self.history_credit * history.predict(session))
        if session:
            turns = self._turns
            turns.pop(session, None)
            if len(turns) >= history.max_sessions:
                del turns[next(iter(turns))]  # the longest-waiting entry (most are long placed)
            turns[session] = (t, attempt)
        if self.urgent_wait_s < float("inf"):
            self._arrivals.append((now, attempt, t))  # promoted if it is still queued urgent_wait_s later

    def requeue(self, t: Queued) -> None:
        """Put a request back at the head: nothing submitted later goes ahead of it."""
        self.items.push_front(t)

    def learned(self, session: str, decode_s: float) -> None:
        """Session ``session`` decoded a turn in ``decode_s`` seconds: learn it, and rank
        the requests waiting on that knowledge again."""
        self.history.observe(session, decode_s)
        self._rerank(session)
        self._rerank_priors()

    def promote_urgent(self, now: float) -> None:
        """Requests queued ``urgent_wait_s`` or longer move ahead of every fresher one."""
        arrivals, limit = self._arrivals, now - self.urgent_wait_s
        while arrivals and arrivals[0][0] <= limit:
            since, attempt, t = arrivals.popleft()
            if not self._waiting(t, attempt) or not t.by_credit:
                continue  # placed meanwhile (a retry is at the head already)
            self.items.remove(t)
            self.items.push(t, since - _URGENT_S)  # ahead of every credit, behind the urgent ones queued before it

    def _rerank(self, session: str) -> None:
        """The session's prediction changed: its request still waiting (the agent's next
        turn, submitted before this finish was known) takes its place by the new one."""
        entry = self._turns.pop(session, None)
        if entry is None:
            return
        t, attempt = entry
        if not self._waiting(t, attempt) or not t.by_credit:
            return
        self._turns[session] = entry  # still waiting: a later finish may re-rank it again
        t.by_prior = False
        rank = t.rank_base - self.history_credit * self.history.predict(session)
        if rank != t.rank:
            self.items.remove(t)
            self.items.push(t, rank)

    def _rerank_priors(self) -> None:
        """The prior moved by a fifth or more since the queued requests of unmeasured
        sessions were ranked by it: rank them by the new one (a burst of first turns is
        ranked FIFO, by a prior of 0; as sessions are measured, those still waiting move
        ahead of the next turns of agents measured to decode less than the typical one).
        A fifth: a handful of re-sorts per run."""
        prior = self.history.prior()
        if abs(prior - self._prior) <= 0.2 * self._prior:
            return
        self._prior = prior
        credit = self.history_credit * prior
        moved = False
        for t in self.items.members():  # rerank sorts them
            if t.by_prior and t.by_credit:
                t.rank = t.rank_base - credit
                moved = True
        if moved:
            self.items.rerank()
