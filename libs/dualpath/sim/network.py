"""A fluid network: links of fixed capacity shared by concurrent flows, max-min fair.

Links are one direction of a NIC: a node's storage NIC (SNIC) read and write directions,
a GPU's compute NIC (CNIC) in and out directions (full duplex: the directions do not share
capacity). A flow crosses one or more links (an RDMA write from a prefill GPU to a decode
node's buffer uses the first's CNIC out and the second's CNIC in) and carries a number of
bytes in a traffic class. Rates are max-min fair per class, classes in strict priority:
``HIGH`` (model collectives) is allocated first, ``LOW`` (KV traffic) gets what is left —
the paper's CNIC QoS, where KV uses the rest and all idle time (§5).

Rates are recomputed when a flow starts or ends, over its *neighbourhood*: the flows that
share a link with it, filled max-min over what flows further away leave of each link (those
keep their rates until an event touches one of their own links). A storage read touches one
SNIC, so its neighbourhood is exactly that link's flows and the share is exact; for flows
over two CNICs this is local max-min, always feasible (no link is ever over capacity), and
bounded in work however large the cluster. A flow is its own completion event, a
``clock.Deadline``; only a flow whose rate changed is rescheduled. A flow that sped up moves
earlier in the loop's heap in place; one that slowed down keeps its place (a flow sharing a
busy link slows down at every arrival) and, when it fires before its new end, goes back in
there, in the place in the order of same-instant events it took when its rate changed: runs
are the same as rescheduling at every change, with fewer events.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heapify, heappop, heappush
from typing import Any, Final

from dualpath.sim.clock import Deadline, EventLoop
from dualpath.sim.series import Series

__all__ = ["HIGH", "LOW", "Flow", "FluidNetwork", "Link"]

HIGH: Final = 0
LOW: Final = 1
_EPS_BYTES: Final = 1e-3


class Link:
    """One direction of a NIC: ``capacity`` bytes/s; ``moved`` bytes carried so far."""

    __slots__ = ("capacity", "count", "flows", "mark", "moved", "name", "place", "residual", "series")

    def __init__(self, name: str, capacity: float, series: Series | None = None) -> None:
        if not capacity > 0:
            raise ValueError(f"link {name}: capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.flows: dict[Flow, None] = {}  # insertion-ordered: runs are deterministic
        self.moved = 0.0
        self.series = series  # bytes over time, for links whose utilisation is reported
        # The max-min fill's scratch (valid during one FluidNetwork._max_min): the capacity
        # left to the flows being filled, how many of them are unfixed, the link's place
        # among the fill's links, and the walk that last listed it (_neighbourhood).
        self.residual = 0.0
        self.count = 0
        self.place = 0
        self.mark = 0

    def __repr__(self) -> str:
        return f"Link({self.name}, {len(self.flows)} flows)"


_INF: Final = float("inf")
_SCAN_LINKS: Final = 12  # _max_min finds the bottleneck by a scan up to this many links, by a heap beyond


class Flow(Deadline):
    """Bytes in transit over ``links``; ``on_done(arg)`` runs when the last byte arrives.

    As a ``Deadline``, ``at`` is when it ends at its current rate (infinite: starved), and
    its completion event moves with it; ``version`` counts its rate changes."""

    __slots__ = ("arg", "cls", "last", "links", "mark", "net", "on_done", "rate", "remaining", "size", "version")

    def __init__(
        self, net: FluidNetwork, links: tuple[Link, ...], nbytes: float, cls: int, on_done: Callable[[Any], None], arg: Any
    ) -> None:
        super().__init__(net.loop)
        self.net = net
        self.links = links
        self.size = nbytes
        self.remaining = float(nbytes)
        self.cls = cls
        self.on_done = on_done
        self.arg = arg
        self.rate = 0.0
        self.last = 0.0
        self.version = 0
        self.mark = 0  # the walk or fill that last marked it (FluidNetwork._epoch): in its set / unfixed

    def due(self) -> None:
        self.net._finish(self)


class FluidNetwork:
    """Flows over links in virtual time (see the module docstring)."""

    __slots__ = ("_epoch", "flows_done", "high", "loop")

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.flows_done = 0
        self.high = 0  # HIGH-class flows in progress (none: max-min has one class to fill)
        self._epoch = 0  # marks of the current walk or fill (Link.mark, Flow.mark): no set to build

    def start(self, links: tuple[Link, ...], nbytes: float, on_done: Callable[[Any], None], arg: Any = None, cls: int = LOW) -> Flow | None:
        """Start moving ``nbytes`` over ``links``; ``on_done(arg)`` when done. An empty flow
        (no bytes or no links) completes at once, in a later event of the same instant."""
        if nbytes <= 0 or not links:
            self.loop.at(self.loop.now, on_done, arg)
            return None
        flow = Flow(self, links, nbytes, cls, on_done, arg)
        flow.last = self.loop.now
        if cls == HIGH:
            self.high += 1
        for link in links:
            link.flows[flow] = None
        self._reallocate(links)
        return flow

    # -- rates ---------------------------------------------------------------------------
    def _neighbourhood(self, seeds: tuple[Link, ...]) -> tuple[list[Link], list[Flow]]:
        """The flows on the seed links and every link they cross (each once, in the order
        first met)."""
        self._epoch += 1
        mark = self._epoch
        flows: list[Flow] = []
        for link in seeds:
            for f in link.flows:
                if f.mark != mark:
                    f.mark = mark
                    flows.append(f)
        return self._links_of(flows, mark), flows

    @staticmethod
    def _links_of(flows: list[Flow], mark: int) -> list[Link]:
        links: list[Link] = []
        for f in flows:
            for link in f.links:
                if link.mark != mark:
                    link.mark = mark
                    links.append(link)
        return links

    def _settle(self, flow: Flow, rate: float) -> None:
        """Advance ``flow``'s bytes to now at ``rate`` (the rate it had since ``flow.last``)."""
        now = self.loop.now
        dt = now - flow.last
        if dt > 0 and rate > 0:
            moved = rate * dt
            moved = min(moved, flow.remaining)
            flow.remaining -= moved
            last = flow.last
            for link in flow.links:
                link.moved += moved
                if link.series is not None:
                    link.series.add(last, now, moved)
        flow.last = now

    def _reallocate(self, seeds: tuple[Link, ...]) -> None:
        alone = seeds[0].flows
        if len(alone) == 1:  # one flow is all the seeds carry (most calls at scale): no neighbourhood to build
            f = next(iter(alone))
            if len(seeds) == 1 or (len(seeds) == 2 and len(seeds[1].flows) == 1 and f in seeds[1].flows):
                rate = f.rate
                if len(f.links) == 1:
                    f.rate = f.links[0].capacity  # _share_one of one flow
                else:
                    self._alone(f)
                if f.rate != rate or not f.version:
                    self._rearm(f, rate)
                return
        flows: list[Flow]
        if len(seeds) == 1:  # _neighbourhood, knowing each flow is on the seed once
            on = seeds[0].flows
            if all(len(f.links) == 1 for f in on):  # every flow crosses only this link: an equal share (one class) or _share_one
                if not self.high:
                    self._equal_share(seeds[0], on)
                    return
                links, flows = [seeds[0]], list(on)
            else:
                self._epoch += 1
                flows = list(on)
                links = self._links_of(flows, self._epoch)
        else:
            links, flows = self._neighbourhood(seeds)
        before = [f.rate for f in flows]
        if len(links) == 1:
            self._share_one(links[0], flows)
        elif len(flows) == 1:
            self._alone(flows[0])
        else:
            self._max_min(links, flows, self.high > 0)
        # Only a flow whose rate changed is settled (at its old rate) and rescheduled: the
        # others keep moving at the same rate, and their completion events still hold. A
        # later end keeps the armed event (see the module docstring).
        for f, rate in zip(flows, before):
            if f.rate != rate or not f.version:
                self._rearm(f, rate)

    def _equal_share(self, link: Link, flows: dict[Flow, None]) -> None:
        """``_share_one`` and the rescheduling loop in one walk, for one class of flows on one link."""
        share = link.capacity / len(flows) if flows else 0.0
        for f in flows:
            rate = f.rate
            if rate != share or not f.version:
                f.rate = share
                self._rearm(f, rate)

    def _rearm(self, f: Flow, rate: float) -> None:
        """``f``'s rate changed from ``rate``: settle it at the old rate and move its end."""
        now = self.loop.now
        dt = now - f.last
        if dt > 0 and rate > 0:  # _settle, inlined (the hottest call of a run)
            moved = rate * dt
            remaining = f.remaining
            if remaining < moved:  # min(moved, remaining) without the call
                moved = remaining
            f.remaining = remaining - moved
            last = f.last
            for link in f.links:
                link.moved += moved
                if link.series is not None:
                    link.series.add(last, now, moved)
        f.last = now
        f.version += 1
        if f.rate > 0:
            f.set(now + f.remaining / f.rate)
        else:
            f.clear()

    @staticmethod
    def _share_one(link: Link, flows: list[Flow]) -> None:
        high = [f for f in flows if f.cls == HIGH]
        if not high:
            share = link.capacity / len(flows) if flows else 0.0
            for f in flows:
                f.rate = share
            return
        hs = link.capacity / len(high)
        for f in flows:
            f.rate = hs if f.cls == HIGH else 0.0
        # LOW flows starve only while HIGH flows saturate the link (always, in a single link).

    @staticmethod
    def _alone(flow: Flow) -> None:
        """One flow over several links: the least any of them leaves it (the general case
        below gives the same, with more work)."""
        rate = float("inf")
        for link in flow.links:
            left = link.capacity
            for f in link.flows:
                if f is not flow:
                    left -= f.rate
            rate = min(rate, left)
        flow.rate = rate if rate > 0 else 0.0

    def _max_min(self, links: list[Link], flows: list[Flow], any_high: bool = True) -> None:
        """Progressive filling of ``flows``, class by class in priority order, over what the
        flows outside the set leave of each link (they keep their rates). ``links`` lists
        every link the flows cross, each once. The fill's sets are marks: a flow is unfixed
        while its ``mark`` is the class's epoch; a link's ``residual`` and ``count`` are
        its capacity left and its unfixed flows."""
        self._epoch += 1
        mark = self._epoch
        for f in flows:
            f.mark = mark
        for link in links:
            left = link.capacity
            n = 0
            for f in link.flows:
                if f.mark == mark:
                    n += 1
                else:
                    left -= f.rate
            link.residual = left if left > 0 else 0.0
            link.count = n
        one_class = not any_high or all(f.cls == LOW for f in flows)
        for cls in (LOW,) if one_class else (HIGH, LOW):
            if one_class:
                active, order = len(flows), links  # counted above, in the order of ``links``
            else:
                self._epoch += 1
                mark = self._epoch
                for link in links:
                    link.count = 0
                order = []  # the links the class's flows cross, in the order they are first met
                active = 0
                for f in flows:
                    if f.cls == cls:
                        f.mark = mark
                        active += 1
                        for link in f.links:
                            if not link.count:
                                order.append(link)
                            link.count += 1
            if len(order) <= _SCAN_LINKS:
                FluidNetwork._fill_scan(order, active, mark)
            else:
                FluidNetwork._fill_heap(order, active, mark)

    @staticmethod
    def _fill_scan(order: list[Link], active: int, mark: int) -> None:
        """The fill for a few links: the bottleneck (least fair share, the first in
        ``order`` among equals) by a scan."""
        while active:
            bottleneck: Link | None = None
            share = _INF
            for link in order:
                n = link.count
                if n:
                    s = link.residual / n
                    if s < share:
                        share, bottleneck = s, link
            if bottleneck is None:
                return
            active -= FluidNetwork._fix(bottleneck, share, mark, None)

    @staticmethod
    def _fill_heap(order: list[Link], active: int, mark: int) -> None:
        """The fill for many links: the bottleneck from a heap by (share, place in
        ``order``), an entry stale once its link's share moved (a scan per step is
        quadratic in the neighbourhood's links)."""
        heap = []
        for i, link in enumerate(order):
            link.place = i
            if link.count:
                heap.append((link.residual / link.count, i, 0, link))
        heapify(heap)
        k = 0  # a link pushed again at an unchanged share is a duplicate: the counter keeps links from being compared
        while active and heap:
            share, _, _, bottleneck = heappop(heap)
            n = bottleneck.count
            if not n or bottleneck.residual / n != share:
                continue  # stale: its share moved since (a fresher entry is in the heap)
            touched: dict[Link, None] = {}
            active -= FluidNetwork._fix(bottleneck, share, mark, touched)
            for link in touched:
                n = link.count
                if n:
                    k += 1
                    heappush(heap, (link.residual / n, link.place, k, link))

    @staticmethod
    def _fix(bottleneck: Link, share: float, mark: int, touched: dict[Link, None] | None) -> int:
        """The fill's step: the unfixed flows over ``bottleneck`` get ``share`` and leave the
        residual and count of every link they cross (``touched`` collects those still
        counted); returns how many were fixed."""
        fixed = 0
        for f in bottleneck.flows:
            if f.mark == mark:
                f.rate = share
                f.mark = 0
                fixed += 1
                for link in f.links:
                    link.residual -= share
                    n = link.count - 1
                    link.count = n
                    if n and touched is not None:
                        touched[link] = None
        return fixed

    def _finish(self, flow: Flow) -> None:
        self._settle(flow, flow.rate)
        flow.remaining = 0.0
        flow.version += 1
        if flow.cls == HIGH:
            self.high -= 1
        links = flow.links
        if len(links) == 1:  # most flows: one link, no tuple to build
            del links[0].flows[flow]
            if links[0].flows:
                self._reallocate(links)
        else:
            for link in links:
                del link.flows[flow]
            remaining = tuple(link for link in links if link.flows)
            if remaining:
                self._reallocate(remaining)
        self.flows_done += 1
        flow.on_done(flow.arg)
