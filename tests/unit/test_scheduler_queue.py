"""``RankedQueue``, the scheduler's queue, against a plain sorted list: any mix of pushes,
pushes to the head, removals, pops and re-ranks leaves the same requests in the same order."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualpath.core.scheduler_queue import Queued, RankedQueue

OPS = st.lists(
    st.tuples(st.sampled_from(["push", "front", "remove", "pop", "rerank", "head"]), st.integers(0, 9), st.integers(0, 40)),
    max_size=120,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_the_ranked_queue_keeps_the_order_of_a_stable_sorted_list(ops):
    queue = RankedQueue()
    model: list[Queued] = []  # the queue's order: push appends then sorts stably by rank
    requests = [Queued(0.0) for _ in range(60)]
    fresh = iter(requests)
    for op, rank, pick in ops:
        if op in ("push", "front"):
            t = next(fresh, None)
            if t is None:
                continue
            if op == "push":
                queue.push(t, float(rank))
                # after every request at a rank at most its own: before the first with a larger rank
                i = next((i for i, q in enumerate(model) if q.rank > rank), len(model))
                model.insert(i, t)
            else:
                queue.push_front(t)
                model.insert(0, t)
        elif op == "remove" and model:
            t = model.pop(pick % len(model))
            queue.remove(t)
        elif op == "pop" and model:
            assert queue.popleft() is model.pop(0)
        elif op == "rerank" and model:
            for q in model[pick % len(model) :: 3]:  # changed in place, as QueueOrder does
                if q.rank != float("-inf"):
                    q.rank = float((q.rank * 7 + pick) % 41)
            queue.rerank()
            model.sort(key=lambda q: q.rank)  # stable: equal ranks keep their order
        elif op == "head":
            assert queue.head(pick % 12) == model[: pick % 12]
        assert len(queue) == len(model) and bool(queue) == bool(model)
    assert list(queue) == model
    assert queue.head(len(model) + 1) == model
    while model:
        assert queue.popleft() is model.pop(0)
    assert not queue
