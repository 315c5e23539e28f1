"""A slice of a cluster: a few nodes that stand for a P/D split of many (the planner's evaluator).

A split of ``N`` nodes into ``P`` prefill and ``D`` decode nodes is simulated on a slice of
``n`` nodes, ``p`` prefill and ``d`` decode, where ``p/d`` is the ratio closest to ``P/D`` that
a cluster of ``min_nodes`` to ``max_nodes`` nodes has (ties: the fewest nodes). When ``P/D``
in lowest terms fits, the ratio is exact: 48P96D is 1P2D, simulated as 4P8D when the floor is 12
nodes. The load per node is the whole's: offline the agents scaled by ``n/N``, online the
arrival rate (each sweep starts at a rate of the slice's own NICs), so the whole's APS is the
slice's times ``N/n``.

Why a slice stands for the whole: every simulated node has its own storage NIC, compute NICs,
DRAM buffer and engines, storage has no cluster-wide limit (a node reads through its own SNIC),
and the scheduler spreads agents evenly; at the same ratio and load per node the whole is
``N/n`` slices side by side. The one per-GPU figure that depends on the cluster's size is the
decode side's expert-parallel group (``decode_ep`` auto: every decode GPU, at most one routed
expert per GPU, so 256 for ds660b on 32 or more decode nodes, 32 on 4): the slice is given the
whole's group size (``decode_ep`` pinned), so its per-GPU expert weights, KV room and all-to-all
time are the whole's. The cost model already takes every GPU of a group to carry the same
batch, so the members outside the slice need not be simulated.

Where it is inexact:

- **ratio**: when ``P/D`` in lowest terms needs more than ``max_nodes`` nodes, the nearest ratio
  (``Slice.p_over_d``; near 1:2 the error is under 2%, at the extremes it is large: 1P143D is
  simulated as 1P23D with 24 nodes at most).
- **pooling**: the scheduler balances over ``n`` nodes, not ``N``, and the offline JCT is set by
  the last of fewer agents: a slice finishes slightly earlier than its whole, the more so the
  fewer its nodes (docs/simulator.md gives the measured gap by slice size).
- **online**: a probe of the slice has ``n/N`` of the whole's arrivals, so its SLO attainment is a
  coarser statistic, and the sweep's rate grid scales with the slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dualpath.cost import get_target
from dualpath.sim.config import SimConfig
from dualpath.sim.workload import Workload

__all__ = ["Slice", "slice_of", "slice_split"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Slice:
    """The nodes simulated for a split of ``whole_nodes``: ``prefill_nodes`` and ``decode_nodes``,
    the decode EP group pinned to the whole's (``decode_ep``)."""

    prefill_nodes: int
    decode_nodes: int
    decode_ep: int
    whole_nodes: int

    @property
    def nodes(self) -> int:
        return self.prefill_nodes + self.decode_nodes

    @property
    def p_over_d(self) -> float:
        return self.prefill_nodes / self.decode_nodes

    @property
    def scale(self) -> float:
        """Whole nodes per slice node: a rate of the slice times this is the whole's."""
        return self.whole_nodes / self.nodes

    def to_json(self) -> dict:
        return {
            "prefill_nodes": self.prefill_nodes,
            "decode_nodes": self.decode_nodes,
            "p_over_d": self.p_over_d,
            "decode_ep": self.decode_ep,
            "scale": self.scale,
        }


def slice_of(prefill: int, decode: int, *, min_nodes: int, max_nodes: int) -> tuple[int, int]:
    """The (p, d) of ``min_nodes`` to ``max_nodes`` nodes whose ratio is closest to
    ``prefill/decode`` (in log ratio; ties: the fewest nodes). A whole of fewer than
    ``min_nodes`` nodes is its own slice; ``max_nodes`` 0 means no slicing (the whole).

    Raises:
        ValueError: a count below 1, or ``min_nodes > max_nodes > 0``.
    """
    if min(prefill, decode, min_nodes) < 1 or max_nodes < 0 or min_nodes > max_nodes > 0:
        raise ValueError(f"slice_of({prefill}, {decode}, min_nodes={min_nodes}, max_nodes={max_nodes})")
    whole = prefill + decode
    if max_nodes == 0 or whole <= min_nodes:
        return prefill, decode

    def miss(p: int, n: int) -> float:  # 0 exactly when p/(n-p) == prefill/decode
        return 0.0 if p * decode == prefill * (n - p) else abs(math.log(p * decode / (prefill * (n - p))))

    best: tuple[float, int, int] | None = None
    for n in range(min_nodes, min(max_nodes, whole) + 1):
        near = round(n * prefill / whole)
        for p in {max(1, min(n - 1, q)) for q in (near - 1, near, near + 1)}:
            key = (miss(p, n), n, p)
            if best is None or key < best:
                best = key
    assert best is not None  # min_nodes <= min(max_nodes, whole): the range is not empty
    _, n, p = best
    return p, n - p


def slice_split(whole: SimConfig, workload: Workload, *, min_nodes: int, max_nodes: int, online: bool) -> tuple[SimConfig, Workload, Slice]:
    """The slice's config (the whole's, with its nodes and the whole's decode EP group) and
    workload (offline: the agents scaled to its nodes; online: unchanged, arrivals are set by
    the sweep's rate), and the slice."""
    target = get_target(whole.target)
    ep = whole.decode_ep_size(target.default_ep, target.routed_experts)
    p, d = slice_of(whole.prefill_nodes, whole.decode_nodes, min_nodes=min_nodes, max_nodes=max_nodes)
    s = Slice(prefill_nodes=p, decode_nodes=d, decode_ep=ep, whole_nodes=whole.prefill_nodes + whole.decode_nodes)
    if not online:
        workload = replace(workload, agents=max(1, round(workload.agents / s.scale)))
    return replace(whole, prefill_nodes=p, decode_nodes=d, decode_ep=ep), workload, s
