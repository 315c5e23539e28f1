"""The DualPath inter-engine policy (paper §6.1): prefill engine, decode engine, read side.

One scheduling pass runs four stages over the waiting queue in its order (FIFO in the
paper; the scheduler core's ranks, ``dualpath.core.CoreConfig.history_credit``). Each stage
returns a decision per request for a *prefix* of the queue; a stage that cannot place a
request stops there, and the pass keeps only the prefix every stage placed (the paper:
"stop when no engine qualifies"; later requests keep waiting, queue order is never broken).

1. ``select_prefill_engines``: skip PEs with ``tok_e > β``; prefer PEs on nodes with
   ``read_q ≤ α`` (and, with read admission, room for a read), lowest ``tok_e``; else PEs
   on the other nodes, lowest ``tok_e``; ``tok_e`` grows after each assignment. ``read_q``
   is the snapshot the pass started from (the paper updates only ``tok_e`` within a pass).
2. ``select_decode_groups`` (phase 1): the DE group with the smallest Σ``tok_e`` among
   groups whose total free HBM holds the request, that have a DE big enough for it and
   whose node's DRAM buffer has room for its slot (beyond the paper, which does not say
   what happens when the DE buffer is full; ``NodeState.buffer_room``). A group without
   room ranks last: when no group has room by the figures, the request takes the group
   it would have without that rule, and the pass stops after it (a node's report lags a
   slot it freed by up to one report interval; a slot refused all the same is the
   scheduler's back-pressure). The baselines follow the same rule.
3. ``place_in_groups`` (phase 2): inside the group, with R = the requests phase 1 gave it,
   ``Z = 1.05 × (Σ_{r∈R} len_r + Σ_e tok_e) / |E|``; among DEs with HBM room prefer
   ``tok_e + len ≤ Z`` by smallest ``seq_e``, else smallest ``tok_e``.
4. ``choose_read_sides``: the node (PE's or DE's) with the shorter read queue; a tie goes
   to the PE side (the classic path); a request's ``forced_side`` or the policy's
   ``read_path`` overrides the comparison. Queues grow by each decision's hit tokens within
   the pass, so a burst between one PE/DE pair alternates sides instead of piling up.
   With ``read_path`` ``split`` (beyond the paper) the hit blocks of a request with nothing
   queued behind it are divided between both nodes so that both reads finish together
   (``split.split_blocks``, ``split.worth_splitting``).
   Read admission (beyond the paper, ``Thresholds.hold_tokens``): a node whose open reads
   (the smaller of ``reads_open`` and ``read_q``: whichever sees a read end first) are at
   the hold takes no read; the request reads on the other side, and when neither can take
   it the pass stops there. The waiting requests stay in the scheduler's queue, whose order
   (``dualpath.core.CoreConfig.history_credit``) then decides which one reads next, instead
   of every request joining a storage NIC's FIFO at once: in a closed loop the agents whose
   turns decoded longest so far (``dualpath.policy.history``) read first and the job's tail
   shrinks (docs/results.md has what it gives on the testbed's clusters).

Agent-aware prefetch (beyond the paper): a request whose hits are staged in a node's DRAM
buffer (``PendingRequest.staged_node``) takes a prefill engine on that node when one
qualifies (``tok_e ≤ β``) and the compute it queues behind there is no longer than the read
it saves (stage 1), or that decode group when it has room and its Σ``tok_e`` is within two
such requests of the least loaded (stage 2), and reads on that side (stage 4, unless
forced, or unless that side's read queue is longer than the other's by more than the
request's hits); otherwise it is placed as any other request.

Ties inside every "smallest" rule go to the lowest engine or node id. Nothing here
mutates the ``ClusterState``; tentative values live in per-pass heaps and dicts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Final, NamedTuple

from dualpath.policy.index import Candidates
from dualpath.policy.split import DE_HOP_PERCENT, split_blocks, worth_splitting
from dualpath.policy.state import ClusterState, EngineState, NodeState
from dualpath.policy.thresholds import Thresholds
from dualpath.policy.values import Assignment, PendingRequest, ReadPath, ReadSide, Role

__all__ = [
    "Z_SLACK_PERCENT",
    "ReadChoice",
    "assemble",
    "choose_read_sides",
    "place_in_groups",
    "schedule_dualpath",
    "select_decode_groups",
    "select_prefill_engines",
]

Z_SLACK_PERCENT = 105  # the paper's 1.05, kept integral so Z comparisons are exact


class ReadChoice(NamedTuple):
    """Stage 4's answer for one request: the side that reads (the first blocks, when split)
    and the hit tokens the decode node reads at the end of the range (0: not split)."""

    side: ReadSide
    de_split_tokens: int


# The two unsplit answers, made once: a NamedTuple's ``__new__`` runs as interpreted Python
# even when compiled code calls it, and a pass answers once per request.
PE_CHOICE: Final = ReadChoice(ReadSide.PE, 0)
DE_CHOICE: Final = ReadChoice(ReadSide.DE, 0)


def select_prefill_engines(waiting: Sequence[PendingRequest], state: ClusterState, th: Thresholds) -> list[int]:
    """Prefill engine ids for the longest placeable prefix of ``waiting`` (stage 1)."""
    return list(_prefill_engines(waiting, state, th))


class _Stage1:
    """Stage 1's per-pass view (the queue classes of prefill nodes). A class, not closures:
    compiled closures form reference cycles, which left garbage for the collector on
    every pass."""

    __slots__ = ("alpha", "engines", "hold", "nodes", "staged")

    def __init__(self, state: ClusterState, th: Thresholds) -> None:
        self.alpha, self.hold = th.alpha_tokens, th.hold_tokens
        self.engines, self.nodes = state.engines, state.nodes
        self.staged = -1  # the node ``on_staged`` accepts

    def is_short(self, n: NodeState) -> bool:
        """read_q <= alpha and, with read admission, room for a read."""
        hold = self.hold
        return n.read_q <= self.alpha and (not hold or n.read_q < hold or n.reads_open < hold)

    def queue_class(self, engine_id: int) -> int:
        """0: the engine's node has a short read queue; 1: long."""
        return 0 if self.is_short(self.nodes[self.engines[engine_id].node_id]) else 1

    def on_staged(self, e: tuple[int, int]) -> bool:
        return self.engines[e[1]].node_id == self.staged


def _prefill_engines(waiting: Sequence[PendingRequest], state: ClusterState, th: Thresholds) -> Iterator[int]:
    """Stage 1, one request at a time (a pass stops pulling where another stage stops)."""
    alpha, beta, hold = th.alpha_tokens, th.beta_tokens, th.hold_tokens
    view = _Stage1(state, th)
    engines, nodes = state.engines, state.nodes
    if hold:  # is_short, inlined: every pass counts the nodes
        short = sum(1 for n in state.prefill_nodes if n.read_q <= alpha and (n.read_q < hold or n.reads_open < hold))
    else:
        short = sum(1 for n in state.prefill_nodes if n.read_q <= alpha)
    single = short == 0 or short == len(state.prefill_nodes)
    classes: tuple[int, ...]
    if single:  # every node in one class: one list (looking for the empty class would walk every engine)
        cands, classes = Candidates(state.prefill_index.walk()), (0,)
    else:
        cands, classes = Candidates(state.prefill_index.walk(), view.queue_class, classes=2), (0, 1)
    for request in waiting:
        # A class whose lowest tok_e is over beta has no engine that qualifies.
        for cls in classes:
            best = cands.first(cls)
            if best is not None and best[0] <= beta:
                break
        else:
            break
        staged = request.staged_node
        if staged >= 0 and staged in nodes and nodes[staged].role is Role.PREFILL:
            # prefetch: the node holding the staged copy, if one of its engines qualifies
            scls = 0 if single or view.is_short(nodes[staged]) else 1
            view.staged = staged
            near = cands.first(scls, ok=view.on_staged)
            # worth it while the extra compute queued there, (near - best) / (β/5 s), is at most
            # the read it saves, (read_q + hits) / (α/3 s): exact integers
            saved = nodes[engines[best[1]].node_id].read_q + request.hit_tokens
            if near is not None and near[0] <= beta and 5 * alpha * (near[0] - best[0]) <= 3 * beta * saved:
                cls, best = scls, near
        cands.take(cls, best, best[0] + request.miss_tokens)
        yield best[1]


def select_decode_groups(waiting: Sequence[PendingRequest], count: int, state: ClusterState) -> list[NodeState]:
    """Decode groups (nodes) for the first ``count`` requests, phase 1; may return fewer."""
    return list(islice(_decode_groups(waiting, state), count))


class _Stage2:
    """Stage 2's per-pass figures and the tests ``Candidates.first`` applies to a group
    (methods, not closures: see ``_Stage1``)."""

    __slots__ = ("blocks", "buffer_left", "free_total", "max_free", "need", "nodes", "staged")

    def __init__(self, state: ClusterState) -> None:
        self.nodes = state.nodes
        self.free_total: dict[int, int] = {}  # tentative Σ free HBM per group looked at this pass
        self.max_free: dict[int, int] = {}  # largest single-DE free HBM at pass start
        self.buffer_left: dict[int, int] = {}  # tentative free buffer blocks per group given requests this pass
        self.need = self.blocks = 0  # the request being placed: tokens, slot blocks
        self.staged = -1  # the group ``staged_fits`` accepts

    def hbm_sums(self, node_id: int) -> int:
        """The group's largest single-DE free HBM, filling ``max_free``/``free_total`` on first sight."""
        biggest = total = 0
        for engine in self.nodes[node_id].engines:
            free = engine.free_hbm_tokens
            total += free
            biggest = max(biggest, free)
        self.max_free[node_id], self.free_total[node_id] = biggest, total
        return biggest

    def hbm_fits(self, entry: tuple[int, int]) -> bool:
        node_id, need = entry[1], self.need
        biggest = self.max_free.get(node_id)
        if biggest is None:
            biggest = self.hbm_sums(node_id)
        return biggest >= need and self.free_total[node_id] >= need

    def fits(self, entry: tuple[int, int]) -> bool:
        node_id = entry[1]
        node = self.nodes[node_id]
        if node.buffer_blocks >= 0:  # NodeState.buffer_room, inlined: every pass calls this per group it looks at
            free = self.buffer_left.get(node_id, node.buffer_free)
            if self.blocks > free and free < node.buffer_blocks:
                return False
        return self.hbm_fits(entry)

    def staged_fits(self, e: tuple[int, int]) -> bool:
        return e[1] == self.staged and self.fits(e)


def _decode_groups(waiting: Sequence[PendingRequest], state: ClusterState) -> Iterator[NodeState]:
    """Stage 2 (phase 1), one request at a time."""
    nodes = state.nodes
    view = _Stage2(state)
    cands = Candidates(state.decode_group_index.walk())
    most = state.max_decode_free()  # no group fits a request that needs more (every pass-start ``biggest`` is at most this)
    for request in waiting:
        need, blocks = request.total_len, request.slot_blocks
        if need > most:
            break
        view.need, view.blocks = need, blocks
        best = cands.first(ok=view.fits)
        overflow = False
        if best is None:  # every buffer looks full: the least loaded group with HBM room, then stop
            overflow = True
            best = cands.first(ok=view.hbm_fits)
            if best is None:
                break
        staged = request.staged_node
        if staged >= 0 and staged != best[1] and staged in nodes and nodes[staged].role is Role.DECODE:
            # prefetch: the group holding the staged copy, if it has room
            view.staged = staged
            near = cands.first(ok=view.staged_fits)
            if near is not None and near[0] <= best[0] + 2 * need:  # within two such requests of the least loaded
                best = near
        cands.take(0, best, best[0] + need)
        view.free_total[best[1]] -= need
        node = nodes[best[1]]
        view.buffer_left[best[1]] = view.buffer_left.get(best[1], node.buffer_free) - blocks
        yield node
        if overflow:
            return


def place_in_groups(waiting: Sequence[PendingRequest], groups: Sequence[NodeState], slack_percent: int = Z_SLACK_PERCENT) -> list[int]:
    """Decode engine ids inside each request's group (phase 2); may return fewer than
    ``len(groups)`` when a group's HBM is too fragmented for a request."""
    demand: dict[int, int] = {}  # Σ len_r over R, per group
    for i, node in enumerate(groups):
        demand[node.node_id] = demand.get(node.node_id, 0) + waiting[i].total_len
    tentative: dict[int, tuple[int, int, int]] = {}  # engine -> (tok, seq, free) after this pass's picks
    chosen: list[int] = []
    for i, node in enumerate(groups):
        need = waiting[i].total_len
        # tok + len <= Z  <=>  100·|E|·(tok + len) <= slack·(ΣR + Σtok): exact integers.
        z_num = slack_percent * (demand[node.node_id] + node.tok_sum)
        engine = _pick_decode_engine(node, need, z_num, tentative)
        if engine is None:
            break
        tok, seq, free = tentative.get(engine.engine_id) or (engine.tok, engine.seq, engine.free_hbm_tokens)
        tentative[engine.engine_id] = (tok + need, seq + 1, free - need)
        chosen.append(engine.engine_id)
    return chosen


def _pick_decode_engine(node: NodeState, need: int, z_num: int, tentative: dict[int, tuple[int, int, int]]) -> EngineState | None:
    """The DE of ``node`` for a request of ``need`` tokens: HBM room required;
    ``tok + need <= Z`` by smallest (seq, tok), else smallest tok; ties to the lower id.
    ``node.tok_sum`` in ``z_num`` is the pass-start sum, so Z stays fixed for the pass."""
    scale = 100 * len(node.engines)
    preferred: EngineState | None = None
    fallback: EngineState | None = None
    best_seq = best_tok = fallback_tok = 0  # the preferred one's (seq, tok), the fallback's tok
    for engine in node.engines:  # ascending engine id
        over = tentative.get(engine.engine_id) if tentative else None
        if over is None:
            tok, seq, free = engine.tok, engine.seq, engine.free_hbm_tokens
        else:
            tok, seq, free = over
        if free < need:
            continue
        if scale * (tok + need) <= z_num:
            if preferred is None or seq < best_seq or (seq == best_seq and tok < best_tok):
                preferred, best_seq, best_tok = engine, seq, tok
        elif fallback is None or tok < fallback_tok:
            fallback, fallback_tok = engine, tok
    return preferred if preferred is not None else fallback


def choose_read_sides(
    waiting: Sequence[PendingRequest],
    prefill: Sequence[int],
    decode: Sequence[int],
    state: ClusterState,
    read_path: ReadPath = ReadPath.AUTO,
    hop_percent: int = DE_HOP_PERCENT,
    hold_tokens: int = 0,
) -> list[ReadChoice]:
    """The read side per placed request (stage 4); a request's ``forced_side``, else
    ``read_path``, forces a side, so the queues grow on the node that actually reads.
    ``ReadPath.SPLIT`` divides each request's hit blocks between both nodes
    (``split.split_blocks``); a request whose split is one-sided reads on that side only.

    With ``hold_tokens`` > 0 (read admission, ``Thresholds.hold_tokens``) a node whose open
    reads (``NodeState.reads_open``, grown within the pass) are at ``hold_tokens`` or more
    takes no read: the request reads on the other side, or, when neither side (or its
    forced side) can take it, the pass stops there and it waits in the queue."""
    engines, nodes = state.engines, state.nodes
    queue: dict[int, int] = {}  # tentative read_q of nodes touched this pass
    opened: dict[int, int] = {}  # tentative reads_open of nodes touched this pass (read admission)
    sides: list[ReadChoice] = []
    for i in range(len(decode)):
        pe_node, de_node = engines[prefill[i]].node_id, engines[decode[i]].node_id
        q_pe = queue.get(pe_node, nodes[pe_node].read_q)
        q_de = queue.get(de_node, nodes[de_node].read_q)
        r = waiting[i]
        forced = r.forced_side
        if read_path is ReadPath.PE or read_path is ReadPath.DE:
            forced = forced if forced is not None else (ReadSide.PE if read_path is ReadPath.PE else ReadSide.DE)
        pe_open = de_open = True
        if hold_tokens and r.hit_tokens:  # of the two figures, the one that sees a read end first counts
            pe_open = min(q_pe, opened.get(pe_node, nodes[pe_node].reads_open)) < hold_tokens
            de_open = min(q_de, opened.get(de_node, nodes[de_node].reads_open)) < hold_tokens
            if not (pe_open if forced is ReadSide.PE else de_open if forced is ReadSide.DE else pe_open or de_open):
                break  # no side can take its read now: it waits, and so does the rest of the queue
        staged_here = r.staged_node >= 0 and r.staged_node in (pe_node, de_node) and pe_node != de_node
        splittable = read_path is ReadPath.SPLIT and not staged_here and pe_node != de_node and pe_open and de_open
        if forced is None and splittable and worth_splitting(r.hit_tokens, q_pe, q_de, len(waiting) - 1 - i):
            bt = r.block_tokens
            pe_tok = min(split_blocks(-(-r.hit_tokens // bt), bt, q_pe, q_de, hop_percent) * bt, r.hit_tokens)
            queue[pe_node], queue[de_node] = q_pe + pe_tok, q_de + r.hit_tokens - pe_tok
            if hold_tokens:
                opened[pe_node] = opened.get(pe_node, nodes[pe_node].reads_open) + pe_tok
                opened[de_node] = opened.get(de_node, nodes[de_node].reads_open) + r.hit_tokens - pe_tok
            sides.append(ReadChoice(ReadSide.PE, r.hit_tokens - pe_tok) if pe_tok else DE_CHOICE)
            continue
        if forced is not None:
            pe_side = forced is ReadSide.PE
        elif not (pe_open and de_open):
            pe_side = pe_open  # read admission: the one side that can take it
        elif staged_here and _staged_side_bounded(r, pe_node, q_pe, q_de):
            pe_side = r.staged_node == pe_node  # prefetch: the side that holds the staged copy
        else:
            pe_side = q_pe <= q_de
        node = pe_node if pe_side else de_node
        if pe_side:
            sides.append(PE_CHOICE)
            queue[pe_node] = q_pe + r.hit_tokens
        else:
            sides.append(DE_CHOICE)
            queue[de_node] = q_de + r.hit_tokens
        if hold_tokens:
            opened[node] = opened.get(node, nodes[node].reads_open) + r.hit_tokens
    return sides


def _staged_side_bounded(r: PendingRequest, pe_node: int, q_pe: int, q_de: int) -> bool:
    """Whether reading on the staged side is safe: its queue is at most one such read longer
    than the other side's, so a copy lost meanwhile (evicted, expired, partly staged) costs
    at most that; a whole copy needs no storage read at all."""
    q_staged, q_other = (q_pe, q_de) if r.staged_node == pe_node else (q_de, q_pe)
    return q_staged <= q_other + r.hit_tokens


def assemble(
    waiting: Sequence[PendingRequest],
    prefill: Sequence[int],
    decode: Sequence[int],
    sides: Sequence[ReadChoice],
    state: ClusterState,
) -> list[Assignment]:
    """Zip per-request choices into ``Assignment`` objects carrying their charges."""
    engines = state.engines
    out = []
    for i, (side, de_split) in enumerate(sides):
        r = waiting[i]
        read_engine = prefill[i] if side is ReadSide.PE else decode[i]
        out.append(
            Assignment(
                request_id=r.request_id,
                prefill_engine=prefill[i],
                decode_engine=decode[i],
                read_side=side,
                read_node=engines[read_engine].node_id,
                prefill_tokens=r.miss_tokens,
                decode_tokens=r.total_len,
                read_tokens=r.hit_tokens,
                de_split_tokens=de_split,
            )
        )
    return out


def schedule_dualpath(
    waiting: Sequence[PendingRequest],
    state: ClusterState,
    thresholds: Thresholds,
    read_path: ReadPath = ReadPath.AUTO,
    slack_percent: int = Z_SLACK_PERCENT,
) -> list[Assignment]:
    """One DualPath scheduling pass: assignments for the longest FIFO prefix of
    ``waiting`` that every stage could place. Does not mutate ``state``."""
    # Stages 1 and 2 advance together and stop where either stops (neither depends on the
    # other; each request's choice depends only on those before it).
    if not waiting or waiting[0].total_len > state.max_decode_free():
        # The head fits no decode engine now (stage 2 would stop at it): nothing to place.
        # Checked here rather than by running stage 2 ahead of stage 1, which would walk the
        # window a second time on every pass.
        return []
    prefill: list[int] = []
    groups: list[NodeState] = []
    # Not zip(): mypyc's zip over two compiled generators fails when one of them ends.
    decode_groups = _decode_groups(waiting, state)
    for pe in _prefill_engines(waiting, state, thresholds):
        group = next(decode_groups, None)
        if group is None:
            break
        if not prefill and not choose_read_sides(
            waiting[:1], [pe], [group.engines[0].engine_id], state, read_path, hold_tokens=thresholds.hold_tokens
        ):
            # The head cannot read anywhere now, so the pass places nothing: say so before
            # running stages 1 and 2 for the rest of the window (stage 4 of the head reads
            # only its nodes, which stages 1 and 2 chose; most passes of a busy cluster end here).
            return []
        prefill.append(pe)
        groups.append(group)
    decode = place_in_groups(waiting, groups, slack_percent)
    sides = choose_read_sides(waiting, prefill, decode, state, read_path, hold_tokens=thresholds.hold_tokens)
    return assemble(waiting, prefill, decode, sides, state)
