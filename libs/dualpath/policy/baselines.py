"""Baseline inter-engine policies, for comparison with DualPath.

Both keep DualPath's admission rules, so a comparison isolates the *selection* rule:
a prefill engine with ``tok_e > β`` is skipped, a decode engine without HBM room for the
request is never chosen, one on a node whose DRAM buffer has no room for its slot ranks
last (chosen only when no node has room, and the pass stops after it, as in
``inter.select_decode_groups``), and a pass stops at the first request that cannot be
placed (FIFO). Neither looks at ``read_q`` or at decode groups.

- ``round_robin``: the n-th decision ever (n = ``state.assigned_total`` + its index in the
  pass) starts at prefill engine ``n mod |PE|`` and decode engine ``n mod |DE|`` and takes
  the first qualifying engine in cyclic id order. Deriving the cursor from the state keeps
  the policy pure: a pass whose decisions are not applied does not move it.
- ``least_tokens``: the prefill engine with the lowest ``tok_e`` (if ≤ β) and, flat over
  all decode engines, the one with the lowest ``tok_e`` that has room; ties go to the
  lowest id; ``tok_e`` grows within the pass.

Read side: ``round_robin`` assigns it round robin too (the paper's round-robin baseline,
whose SNIC traffic max/avg is 1.53 against DualPath's 1.18): the n-th decision reads on the
prefill side when n is even and on the decode side when n is odd. ``least_tokens`` picks it
by ``inter.choose_read_sides`` as DualPath does (the shorter read queue). A request's
``forced_side`` and a ``read_path`` of ``pe``, ``de`` or ``split`` override both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dualpath.policy.index import Candidates
from dualpath.policy.inter import DE_CHOICE, PE_CHOICE, ReadChoice, assemble, choose_read_sides
from dualpath.policy.state import ClusterState, EngineState
from dualpath.policy.thresholds import Thresholds
from dualpath.policy.values import Assignment, PendingRequest, ReadPath, ReadSide

__all__ = ["schedule_least_tokens", "schedule_round_robin"]


def _next_fit(engines: tuple[EngineState, ...], start: int, ok: Callable[[EngineState], bool]) -> int | None:
    """Index of the first engine from ``start`` on, cyclically, that ``ok`` accepts."""
    n = len(engines)
    for step in range(n):
        k = (start + step) % n
        if ok(engines[k]):
            return k
    return None


def schedule_round_robin(
    waiting: Sequence[PendingRequest],
    state: ClusterState,
    thresholds: Thresholds,
    read_path: ReadPath = ReadPath.AUTO,
) -> list[Assignment]:
    """One round-robin pass (see the module docstring). Does not mutate ``state``."""
    pes, des, nodes = state.prefill_engines, state.decode_engines, state.nodes
    beta = thresholds.beta_tokens
    tok: dict[int, int] = {}  # tentative PE tok_e
    free: dict[int, int] = {}  # tentative DE free HBM
    buffer_left: dict[int, int] = {}  # tentative free buffer blocks per decode node
    prefill: list[int] = []
    decode: list[int] = []
    for i, r in enumerate(waiting):
        n = state.assigned_total + i
        need, blocks = r.total_len, r.slot_blocks

        def pe_ok(e: EngineState) -> bool:
            return tok.get(e.engine_id, e.tok) <= beta

        def de_hbm(e: EngineState, need: int = need) -> bool:
            return free.get(e.engine_id, e.free_hbm_tokens) >= need

        def de_ok(e: EngineState, need: int = need, blocks: int = blocks) -> bool:  # de_hbm and buffer room, in one call
            if free.get(e.engine_id, e.free_hbm_tokens) < need:
                return False
            node = nodes[e.node_id]
            return node.buffer_room(blocks, buffer_left.get(e.node_id, node.buffer_free))

        k = _next_fit(pes, n % len(pes), pe_ok)
        if k is None:
            break
        j = _next_fit(des, n % len(des), de_ok)
        overflow = False
        if j is None:  # every buffer looks full: ranked last, then the pass stops
            overflow = True
            j = _next_fit(des, n % len(des), de_hbm)
            if j is None:
                break
        pe, de = pes[k], des[j]
        tok[pe.engine_id] = tok.get(pe.engine_id, pe.tok) + r.miss_tokens
        free[de.engine_id] = free.get(de.engine_id, de.free_hbm_tokens) - need
        buffer_left[de.node_id] = buffer_left.get(de.node_id, nodes[de.node_id].buffer_free) - blocks
        prefill.append(pe.engine_id)
        decode.append(de.engine_id)
        if overflow:
            break
    if read_path is ReadPath.AUTO:
        sides = _round_robin_sides(waiting, len(decode), state.assigned_total)
    else:
        sides = choose_read_sides(waiting, prefill, decode, state, read_path)
    return assemble(waiting, prefill, decode, sides, state)


def _round_robin_sides(waiting: Sequence[PendingRequest], count: int, cursor: int) -> list[ReadChoice]:
    """Read sides of the first ``count`` requests, round robin from decision ``cursor``: PE
    on even decisions, DE on odd ones (a request's ``forced_side`` wins)."""
    sides = []
    for i in range(count):
        forced = waiting[i].forced_side
        if forced is not None:
            sides.append(PE_CHOICE if forced is ReadSide.PE else DE_CHOICE)
        else:
            sides.append(DE_CHOICE if (cursor + i) % 2 else PE_CHOICE)
    return sides


def schedule_least_tokens(
    waiting: Sequence[PendingRequest],
    state: ClusterState,
    thresholds: Thresholds,
    read_path: ReadPath = ReadPath.AUTO,
) -> list[Assignment]:
    """One least-tokens pass (see the module docstring). Does not mutate ``state``."""
    engines, nodes = state.engines, state.nodes
    free: dict[int, int] = {}  # tentative DE free HBM
    buffer_left: dict[int, int] = {}  # tentative free buffer blocks per decode node
    pe_cands = Candidates(state.prefill_index.walk())
    de_cands = Candidates(state.decode_index.walk())
    prefill: list[int] = []
    decode: list[int] = []
    for r in waiting:
        pe = pe_cands.first()
        if pe is None or pe[0] > thresholds.beta_tokens:
            break
        need, blocks = r.total_len, r.slot_blocks

        def hbm(e: tuple[int, int], need: int = need) -> bool:
            return free.get(e[1], engines[e[1]].free_hbm_tokens) >= need

        def room(e: tuple[int, int], need: int = need, blocks: int = blocks) -> bool:  # hbm and buffer room, in one call
            if free.get(e[1], engines[e[1]].free_hbm_tokens) < need:
                return False
            node = nodes[engines[e[1]].node_id]
            return node.buffer_room(blocks, buffer_left.get(node.node_id, node.buffer_free))

        de = de_cands.first(ok=room)
        overflow = False
        if de is None:  # every buffer looks full: ranked last, then the pass stops
            overflow = True
            de = de_cands.first(ok=hbm)
            if de is None:
                break
        pe_cands.take(0, pe, pe[0] + r.miss_tokens)
        de_cands.take(0, de, de[0] + need)
        free[de[1]] = free.get(de[1], engines[de[1]].free_hbm_tokens) - need
        de_node = engines[de[1]].node_id
        buffer_left[de_node] = buffer_left.get(de_node, nodes[de_node].buffer_free) - blocks
        prefill.append(pe[1])
        decode.append(de[1])
        if overflow:
            break
    sides = choose_read_sides(waiting, prefill, decode, state, read_path)
    return assemble(waiting, prefill, decode, sides, state)
