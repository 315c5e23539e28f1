"""Property-based tests of the inter-engine policies.

Two kinds of check on random clusters and queues:
- invariants read straight off the paper, replayed decision by decision (FIFO prefix, no
  PE over β, no DE without HBM room, read side = shorter queue, head placed when there
  is room, the state untouched), and of DualPath's read admission (no read on a node whose
  open reads are at the hold);
- equality with a deliberately naive reference of the DualPath rules (linear scans, exact
  fractions for Z), also after random histories of assignments and completions, which
  exercises the incremental indices the fast policy relies on.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualpath.policy import (
    POLICY_NAMES,
    ClusterState,
    NodeSpec,
    PendingRequest,
    ReadSide,
    Role,
    Thresholds,
    get_policy,
)
from dualpath.policy.index import LazyIndex

# too_slow: generation of a cluster can be slow on a loaded CI machine; it is not a bug.
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw) -> tuple[ClusterState, Thresholds, list[PendingRequest]]:
    """A small cluster with random engine/node counters, thresholds and a FIFO queue."""
    pe_nodes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    de_nodes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    hbm = draw(st.integers(500, 20_000))
    specs, eid = [], 0
    for node_id, (role, count) in enumerate([(Role.PREFILL, c) for c in pe_nodes] + [(Role.DECODE, c) for c in de_nodes]):
        specs.append(
            NodeSpec(node_id=node_id, role=role, engine_ids=tuple(range(eid, eid + count)), hbm_tokens=hbm if role is Role.DECODE else 0)
        )
        eid += count
    state = ClusterState(specs)
    for engine in state.engines.values():
        free = draw(st.integers(0, hbm)) if engine.role is Role.DECODE else None
        state.report_engine(engine.engine_id, seq=draw(st.integers(0, 3)), tok=draw(st.integers(0, 20_000)), free_hbm_tokens=free)
    for node in state.nodes.values():
        state.report_node(node.node_id, read_q=draw(st.integers(0, 5000)))
        state.adjust_reads_open(node.node_id, draw(st.integers(0, 5000)))
    # read admission off (0), the default, or holds from a fraction of α to many times it
    hold_percent = draw(st.sampled_from([0, 5, 50, 100, 1000]))
    th = Thresholds(alpha_tokens=draw(st.integers(0, 5000)), beta_tokens=draw(st.integers(0, 20_000)), read_hold_percent=hold_percent)
    waiting = []
    for rid in range(draw(st.integers(0, 12))):
        prompt = draw(st.integers(2, 4000))
        hit = draw(st.integers(0, prompt - 1))
        waiting.append(PendingRequest(request_id=rid, prompt_tokens=prompt, hit_tokens=hit, total_len=prompt + draw(st.integers(0, 3000))))
    return state, th, waiting


def reference_dualpath(waiting, state, th):
    """The paper's rules as literally as possible; returns (request, PE, DE, side) tuples."""
    pe_tok = {e.engine_id: e.tok for e in state.prefill_engines}
    node_of = {e.engine_id: e.node_id for e in state.engines.values()}
    hold = th.hold_tokens

    def has_room(n):  # read admission: the node's open reads (or its queue, if shorter) are below the hold
        return not hold or min(n.read_q, n.reads_open) < hold

    short = {e for e in pe_tok if state.nodes[node_of[e]].read_q <= th.alpha_tokens and has_room(state.nodes[node_of[e]])}
    pes = []
    for r in waiting:
        ok = [e for e in pe_tok if pe_tok[e] <= th.beta_tokens]
        pool = [e for e in ok if e in short] or ok
        if not pool:
            break
        e = min(pool, key=lambda x: (pe_tok[x], x))
        pe_tok[e] += r.miss_tokens
        pes.append(e)
    g_sum = {n.node_id: sum(e.tok for e in n.engines) for n in state.decode_nodes}
    g_free = {n.node_id: sum(e.free_hbm_tokens for e in n.engines) for n in state.decode_nodes}
    g_max = {n.node_id: max(e.free_hbm_tokens for e in n.engines) for n in state.decode_nodes}
    groups = []
    for r in waiting[: len(pes)]:
        ok = [g for g in g_sum if g_max[g] >= r.total_len and g_free[g] >= r.total_len]
        if not ok:
            break
        g = min(ok, key=lambda x: (g_sum[x], x))
        g_sum[g] += r.total_len
        g_free[g] -= r.total_len
        groups.append(g)
    z = {}
    for g in set(groups):
        node = state.nodes[g]
        demand = sum(r.total_len for r, gg in zip(waiting, groups) if gg == g)
        z[g] = Fraction(105, 100) * (demand + sum(e.tok for e in node.engines)) / len(node.engines)
    de = {e.engine_id: [e.tok, e.seq, e.free_hbm_tokens] for e in state.decode_engines}
    des = []
    for r, g in zip(waiting, groups):
        fits = [e.engine_id for e in state.nodes[g].engines if de[e.engine_id][2] >= r.total_len]
        if not fits:
            break
        under = [e for e in fits if de[e][0] + r.total_len <= z[g]]
        e = min(under, key=lambda x: (de[x][1], de[x][0], x)) if under else min(fits, key=lambda x: (de[x][0], x))
        de[e][0] += r.total_len
        de[e][1] += 1
        de[e][2] -= r.total_len
        des.append(e)
    queue = {n.node_id: n.read_q for n in state.nodes.values()}
    opened = {n.node_id: n.reads_open for n in state.nodes.values()}
    out = []
    for r, p, d in zip(waiting, pes, des):
        pn, dn = node_of[p], node_of[d]
        room = {n: not hold or not r.hit_tokens or min(queue[n], opened[n]) < hold for n in (pn, dn)}
        if not (room[pn] or room[dn]):
            break
        if room[pn] and room[dn]:
            side = ReadSide.PE if queue[pn] <= queue[dn] else ReadSide.DE
        else:
            side = ReadSide.PE if room[pn] else ReadSide.DE
        node = pn if side is ReadSide.PE else dn
        queue[node] += r.hit_tokens
        opened[node] += r.hit_tokens
        out.append((r.request_id, p, d, side))
    return out


def check_invariants(name, waiting, state, th, out):
    """Replay ``out`` against ``state`` and assert the rules every policy must keep."""
    assert [a.request_id for a in out] == [r.request_id for r in waiting[: len(out)]]  # FIFO prefix
    tok = {e.engine_id: e.tok for e in state.engines.values()}
    free = {e.engine_id: e.free_hbm_tokens for e in state.engines.values()}
    queue = {n.node_id: n.read_q for n in state.nodes.values()}
    opened = {n.node_id: n.reads_open for n in state.nodes.values()}
    hold = th.hold_tokens if name == "dualpath" else 0  # read admission is DualPath's

    def room(node_id, r):
        return not hold or not r.hit_tokens or min(queue[node_id], opened[node_id]) < hold

    for i, (r, a) in enumerate(zip(waiting, out)):
        pe, de = state.engines[a.prefill_engine], state.engines[a.decode_engine]
        assert pe.role is Role.PREFILL and de.role is Role.DECODE
        assert tok[pe.engine_id] <= th.beta_tokens  # never to a PE over beta
        assert free[de.engine_id] >= r.total_len  # never to a DE without room
        assert (a.prefill_tokens, a.decode_tokens, a.read_tokens) == (r.miss_tokens, r.total_len, r.hit_tokens)
        q_pe, q_de = queue[pe.node_id], queue[de.node_id]
        if name == "basic":
            assert a.read_side is ReadSide.PE
        elif name == "round_robin":  # the read side round robin too: PE on even decisions
            assert a.read_side is (ReadSide.DE if (state.assigned_total + i) % 2 else ReadSide.PE)
        elif room(pe.node_id, r) and room(de.node_id, r):  # the shorter queue, ties to the PE side
            assert a.read_side is (ReadSide.PE if q_pe <= q_de else ReadSide.DE)
        else:  # read admission: the side with room; never a node at the hold
            assert room(pe.node_id if a.read_side is ReadSide.PE else de.node_id, r)
        assert a.read_node == (pe.node_id if a.read_side is ReadSide.PE else de.node_id)
        tok[pe.engine_id] += r.miss_tokens
        free[de.engine_id] -= r.total_len
        queue[a.read_node] += r.hit_tokens
        opened[a.read_node] += r.hit_tokens
    if waiting:  # liveness: the head is placed whenever some PE and some DE can take it (and every node its read)
        head = waiting[0]
        pe_ok = any(e.tok <= th.beta_tokens for e in state.prefill_engines)
        de_ok = any(e.free_hbm_tokens >= head.total_len for e in state.decode_engines)
        every_room = all(not hold or not head.hit_tokens or min(n.read_q, n.reads_open) < hold for n in state.nodes.values())
        if every_room:
            assert bool(out) == (pe_ok and de_ok)
        else:
            assert not out or (pe_ok and de_ok)


def snapshot(state):
    return (
        [(e.seq, e.tok, e.free_hbm_tokens) for e in state.engines.values()],
        [(n.read_q, n.tok_sum) for n in state.nodes.values()],
        state.assigned_total,
        state.live_count,
    )


@SETTINGS
@given(scenarios(), st.sampled_from(POLICY_NAMES))
def test_every_policy_keeps_the_invariants_and_leaves_the_state_alone(scenario, name):
    state, th, waiting = scenario
    before = snapshot(state)
    out = get_policy(name, th).schedule(waiting, state)
    assert snapshot(state) == before
    check_invariants(name, waiting, state, th, out)
    for a in out:  # the decisions apply cleanly, and finishing them restores the state
        state.on_assigned(a)
    for a in out:
        state.on_finished(a.request_id)
    assert snapshot(state)[:2] == before[:2]


@SETTINGS
@given(scenarios())
def test_dualpath_matches_the_naive_reference(scenario):
    state, th, waiting = scenario
    out = get_policy("dualpath", th).schedule(waiting, state)
    assert [(a.request_id, a.prefill_engine, a.decode_engine, a.read_side) for a in out] == reference_dualpath(waiting, state, th)


@SETTINGS
@given(scenarios(), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1000)), max_size=30))
def test_dualpath_matches_the_reference_through_a_history_of_passes(scenario, steps):
    """Assignments and completions move the incremental indices; decisions stay exact."""
    state, th, waiting = scenario
    policy = get_policy("dualpath", th)
    live: list[int] = []
    queue = list(waiting)
    for action, pick in steps:
        if action == 0 or not live:
            out = policy.schedule(queue, state)
            assert [(a.request_id, a.prefill_engine, a.decode_engine, a.read_side) for a in out] == reference_dualpath(queue, state, th)
            for a in out:
                state.on_assigned(a)
                live.append(a.request_id)
            del queue[: len(out)]
        else:
            rid = live[pick % len(live)]
            (state.on_read_finished, state.on_prefill_finished, state.on_finished)[action - 1](rid)
            if action == 3:
                live.remove(rid)


@SETTINGS
@given(st.lists(st.integers(0, 50), min_size=1, max_size=20), st.lists(st.tuples(st.integers(0, 19), st.integers(0, 50)), max_size=60))
def test_lazy_index_walks_members_in_ascending_key_order(initial, changes):
    keys = dict(enumerate(initial))
    index = LazyIndex(keys, keys.__getitem__)
    for member, key in changes:
        if member in keys:
            keys[member] = key
            index.update(member)
    assert list(index.walk()) == sorted((k, m) for m, k in keys.items())


@SETTINGS
@given(
    st.dictionaries(st.integers(0, 5000), st.integers(-(10**12), 10**12), min_size=1, max_size=30),
    st.lists(st.tuples(st.integers(0, 29), st.integers(-(10**12), 10**12)), max_size=60),
)
def test_lazy_index_walk_order_holds_for_sparse_member_ids_and_negative_keys(initial, changes):
    keys = dict(initial)  # member ids far above the member count, keys either sign (a -free key)
    members = sorted(keys)
    index = LazyIndex(members, keys.__getitem__)
    for which, key in changes:
        member = members[which % len(members)]
        keys[member] = key
        index.update(member)
    assert list(index.walk()) == sorted((k, m) for m, k in keys.items())


def test_lazy_index_refuses_negative_member_ids():
    with pytest.raises(ValueError, match="non-negative"):
        LazyIndex([3, -1], lambda m: 0)


def test_lazy_index_stays_exact_across_many_in_place_moves():
    keys = {m: (m * 37) % 11 for m in range(40)}  # five levels: entries move several places up and down
    index = LazyIndex(keys, keys.__getitem__)
    for step in range(600):
        for member in (step % 40, (step * 7) % 40):  # some members change twice between walks
            keys[member] = (keys[member] * 31 + step) % 23  # ties are common: broken by member id
            index.update(member)
        if step % 3:
            continue  # several changes per flush
        assert list(index.walk()) == sorted((k, m) for m, k in keys.items())
        assert index.top() == min((k, m) for m, k in keys.items())
