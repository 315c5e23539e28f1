"""The link relay's queue (``netns_relay.Direction``): delay, order, loss, pacing and its limits,
on a clock the test gives it (no namespace is made here)."""

from __future__ import annotations

import random

from dualpath.cli.launcher.netns_relay import Direction


def test_a_frame_is_held_for_the_delay_and_frames_leave_in_arrival_order():
    way = Direction(delay=0.050)
    for k in range(5):
        way.offer(bytes([k]) * 100, now=1.0 + k * 0.001)
    assert list(way.due(1.0495)) == []
    assert list(way.due(1.0505)) == [b"\x00" * 100]
    assert [f[0] for f in way.due(2.0)] == [1, 2, 3, 4]
    assert way.next_release() is None and way.queued == 0 and way.passed == 5


def test_a_random_share_is_lost():
    way = Direction(delay=0.0, loss=0.01, rng=random.Random(7))
    for _ in range(20_000):
        way.offer(b"x" * 64, now=0.0)
    assert 140 <= way.lost <= 260  # 1% of 20 000, within 4 standard deviations
    assert way.lost + len(way.queue) == 20_000


def test_pacing_spaces_frames_at_the_rate_then_adds_the_delay():
    way = Direction(delay=0.010, rate=1_000_000.0)  # 8 Mbit/s: a 1250-byte frame takes 1.25 ms
    for _ in range(4):
        way.offer(b"x" * 1250, now=5.0)
    releases = [t for t, _ in way.queue]
    assert [round((t - 5.010) * 1e6) for t in releases] == [1250, 2500, 3750, 5000]
    way.offer(b"y" * 1250, now=7.0)  # an idle link starts again from now
    assert round((way.queue[-1][0] - 7.010) * 1e6) == 1250


def test_a_frame_longer_than_the_link_carries_or_past_the_queue_limit_is_dropped():
    way = Direction(delay=1.0, largest=1518, limit=3000)
    way.offer(b"x" * 1519, now=0.0)
    way.offer(b"x" * 1500, now=0.0)
    way.offer(b"x" * 1500, now=0.0)
    way.offer(b"x" * 1, now=0.0)
    assert (way.oversized, way.overflowed, len(way.queue)) == (1, 1, 2)
    assert "oversized 1, overflowed 1" in way.counts()
