"""Worked examples of the DualPath inter-engine policy, each checked by hand against the
paper's rules (§6.1). Numbers in the comments are the hand computation."""

from __future__ import annotations

from dualpath.policy import ClusterState, NodeSpec, PendingRequest, ReadSide, Role, Thresholds, get_policy

BIG = 10**9


def cluster(pe_nodes: list[int], de_nodes: list[int], hbm: int = 1_000_000) -> ClusterState:
    """PE nodes then DE nodes with the given engine counts; node ids 0.., engine ids 0.. in order."""
    specs, eid = [], 0
    for node_id, (role, count) in enumerate([(Role.PREFILL, c) for c in pe_nodes] + [(Role.DECODE, c) for c in de_nodes]):
        specs.append(
            NodeSpec(node_id=node_id, role=role, engine_ids=tuple(range(eid, eid + count)), hbm_tokens=hbm if role is Role.DECODE else 0)
        )
        eid += count
    return ClusterState(specs)


def req(rid: int, miss: int = 100, hit: int = 0, total: int | None = None) -> PendingRequest:
    prompt = hit + miss
    return PendingRequest(request_id=rid, prompt_tokens=prompt, hit_tokens=hit, total_len=prompt if total is None else total)


def dualpath(alpha: int = BIG, beta: int = BIG):
    return get_policy("dualpath", Thresholds(alpha_tokens=alpha, beta_tokens=beta))


# -- prefill engine selection ------------------------------------------------------------


def test_short_read_queue_node_wins_even_with_more_tokens():
    # PE0 on node 0 (read_q 1000 > alpha 500), PE1 on node 1 (read_q 10 <= 500).
    state = cluster([1, 1], [1])
    state.report_node(0, read_q=1000)
    state.report_node(1, read_q=10)
    state.report_engine(0, seq=1, tok=100)
    state.report_engine(1, seq=3, tok=900)
    [a] = dualpath(alpha=500).schedule([req(1)], state)
    assert a.prefill_engine == 1  # short queue first, although tok 900 > 100


def test_engine_over_beta_is_skipped_for_one_on_a_long_queue_node():
    state = cluster([1, 1], [1])
    state.report_node(0, read_q=1000)  # long
    state.report_node(1, read_q=10)  # short, but its only PE is overloaded
    state.report_engine(0, seq=1, tok=4000)
    state.report_engine(1, seq=3, tok=6000)
    [a] = dualpath(alpha=500, beta=5000).schedule([req(1)], state)
    assert a.prefill_engine == 0  # 6000 > beta; 4000 <= beta on the long node


def test_engine_exactly_at_beta_still_qualifies():
    state = cluster([1], [1])
    state.report_engine(0, seq=1, tok=5000)
    [a] = dualpath(beta=5000).schedule([req(1)], state)
    assert a.prefill_engine == 0  # skipped only when tok_e > beta


def test_no_assignment_when_every_prefill_engine_is_over_beta():
    state = cluster([2], [1])
    state.report_engine(0, seq=1, tok=5001)
    state.report_engine(1, seq=1, tok=9000)
    assert dualpath(beta=5000).schedule([req(1), req(2)], state) == []


def test_tok_e_grows_after_each_assignment_within_a_pass():
    # tok: PE0 0, PE1 100; each request computes 300.
    # r1 -> PE0 (0 < 100), PE0 = 300; r2 -> PE1 (100 < 300), PE1 = 400; r3 -> PE0 (300 < 400).
    state = cluster([2], [1])
    state.report_engine(1, seq=1, tok=100)
    out = dualpath().schedule([req(1, miss=300), req(2, miss=300), req(3, miss=300)], state)
    assert [a.prefill_engine for a in out] == [0, 1, 0]


def test_pass_stops_at_the_first_request_that_cannot_be_placed():
    # One PE, beta 250: r1 goes (0 <= 250) and lifts tok_e to 300; r2 finds none; r3 must
    # wait behind r2 even though it is tiny (FIFO).
    state = cluster([1], [1])
    out = dualpath(beta=250).schedule([req(1, miss=300), req(2, miss=300), req(3, miss=1)], state)
    assert [a.request_id for a in out] == [1]


def test_lowest_tok_breaks_ties_by_lowest_engine_id():
    state = cluster([3], [1])
    state.report_engine(0, seq=1, tok=50)
    [a] = dualpath().schedule([req(1)], state)
    assert a.prefill_engine == 1  # PE1 and PE2 both at 0; PE1 has the lower id


# -- decode engine selection ---------------------------------------------------------------


def test_phase_one_picks_the_group_with_the_smallest_token_sum_and_updates_it():
    # Groups: node 1 (DE 1) Σtok 10000, node 2 (DE 2) Σtok 4000. Requests of 1000 and 7000:
    # r1 -> node 2 (4000 -> 5000); r2 -> node 2 (5000 < 10000 -> 12000); r3 -> node 1.
    state = cluster([1], [1, 1])
    state.report_engine(1, seq=1, tok=10_000)
    state.report_engine(2, seq=1, tok=4000)
    out = dualpath().schedule([req(1, total=1000), req(2, total=7000), req(3, miss=10, total=10)], state)
    assert [a.decode_engine for a in out] == [2, 2, 1]


def test_phase_one_skips_a_group_without_room():
    state = cluster([1], [1, 1])
    state.report_engine(1, seq=1, tok=10_000)
    state.report_engine(2, seq=0, tok=0, free_hbm_tokens=500)
    [a] = dualpath().schedule([req(1, total=600)], state)
    assert a.decode_engine == 1  # node 2 has the smaller sum but 500 < 600 free


def test_phase_two_prefers_the_fewest_sequences_under_z():
    # tok [1000, 1200, 3000], seq [5, 1, 2], one request of len 500:
    # Z = 1.05 * (500 + 5200) / 3 = 1995. tok+len: 1500 ok, 1700 ok, 3500 no.
    # Among DE1 (seq 5) and DE2 (seq 1): DE2.
    state = cluster([1], [3])
    for eid, (seq, tok) in zip((1, 2, 3), [(5, 1000), (1, 1200), (2, 3000)]):
        state.report_engine(eid, seq=seq, tok=tok)
    [a] = dualpath().schedule([req(1, miss=400, total=500)], state)
    assert a.decode_engine == 2


def test_phase_two_z_excludes_a_low_sequence_engine_that_would_go_over():
    # tok [1000, 2000, 3000], seq [5, 1, 2], len 1500: Z = 1.05 * 7500 / 3 = 2625.
    # tok+len: 2500 ok, 3500 no, 4500 no -> DE1 despite its 5 sequences.
    state = cluster([1], [3])
    for eid, (seq, tok) in zip((1, 2, 3), [(5, 1000), (1, 2000), (2, 3000)]):
        state.report_engine(eid, seq=seq, tok=tok)
    [a] = dualpath().schedule([req(1, miss=1000, total=1500)], state)
    assert a.decode_engine == 1


def test_phase_two_breaks_a_sequence_tie_by_fewer_tokens():
    # tok [300, 200, 1000], seq [1, 1, 0], len 100: Z = 1.05 * 1600 / 3 = 560.
    # DE1 400 ok, DE2 300 ok, DE3 1100 no; DE1 and DE2 tie on seq -> fewer tokens: DE2.
    state = cluster([1], [3])
    for eid, (seq, tok) in zip((1, 2, 3), [(1, 300), (1, 200), (0, 1000)]):
        state.report_engine(eid, seq=seq, tok=tok)
    [a] = dualpath().schedule([req(1, total=100)], state)
    assert a.decode_engine == 2


def test_the_five_percent_slack_of_z_admits_an_engine_just_above_average():
    # tok [1000, 1000], seq [3, 0], len 100: Z = 1.05 * 2100 / 2 = 1102.5; both at 1100 are
    # under it, so the fewer sequences win: DE2. (Without the slack Z = 1050, neither is
    # under, and the fallback would take DE1.)
    state = cluster([1], [2])
    state.report_engine(1, seq=3, tok=1000)
    state.report_engine(2, seq=0, tok=1000)
    [a] = dualpath().schedule([req(1, total=100)], state)
    assert a.decode_engine == 2


def test_phase_two_falls_back_to_smallest_tok_when_none_is_under_z():
    # tok [0, 0, 0], len 3000: Z = 1.05 * 3000 / 3 = 1050 < 3000 for all -> smallest tok,
    # tie -> lowest id.
    state = cluster([1], [3])
    state.report_engine(1, seq=4, tok=0)
    [a] = dualpath().schedule([req(1, miss=3000)], state)
    assert a.decode_engine == 1


def test_phase_two_z_counts_every_request_the_group_receives_in_the_pass():
    # Two DEs at 0, two requests of 1000: Z = 1.05 * 2000 / 2 = 1050.
    # r1 -> DE1 (tie), DE1 = 1000; r2: DE1 2000 > 1050, DE2 1000 <= 1050 -> DE2.
    state = cluster([1], [2])
    out = dualpath().schedule([req(1, miss=1000), req(2, miss=1000)], state)
    assert [a.decode_engine for a in out] == [1, 2]


def test_decode_engine_without_hbm_room_is_never_chosen():
    state = cluster([1], [2])
    state.report_engine(1, seq=0, tok=0, free_hbm_tokens=100)  # under Z, but no room
    state.report_engine(2, seq=9, tok=5000)
    [a] = dualpath().schedule([req(1, total=500)], state)
    assert a.decode_engine == 2


def test_no_assignment_when_no_decode_engine_has_room():
    state = cluster([1], [2], hbm=400)
    assert dualpath().schedule([req(1, total=500), req(2, miss=10, total=10)], state) == []


def test_a_request_larger_than_any_decode_engine_blocks_the_queue():
    state = cluster([1], [1], hbm=1000)
    assert state.max_decode_hbm_tokens == 1000
    assert dualpath().schedule([req(1, total=1001), req(2, miss=10, total=10)], state) == []


# -- read side -----------------------------------------------------------------------------


def test_read_side_is_the_node_with_the_shorter_queue():
    state = cluster([1], [1])
    state.report_node(0, read_q=100)
    state.report_node(1, read_q=50)
    [a] = dualpath().schedule([req(1, hit=640)], state)
    assert (a.read_side, a.read_node, a.read_tokens) == (ReadSide.DE, 1, 640)


def test_equal_queues_read_on_the_prefill_side():
    state = cluster([1], [1])
    state.report_node(0, read_q=70)
    state.report_node(1, read_q=70)
    [a] = dualpath().schedule([req(1, hit=64)], state)
    assert (a.read_side, a.read_node) == (ReadSide.PE, 0)


def test_reads_within_a_pass_alternate_as_queues_grow():
    # Queues 0/0: r1 reads on PE (tie) -> PE queue 1000; r2: 1000 > 0 -> DE; r3: 1000 = 1000 -> PE.
    state = cluster([1], [1])
    out = dualpath().schedule([req(i, hit=1000) for i in (1, 2, 3)], state)
    assert [a.read_side for a in out] == [ReadSide.PE, ReadSide.DE, ReadSide.PE]


def test_basic_reads_everything_on_the_prefill_side():
    state = cluster([1], [1])
    state.report_node(0, read_q=10**6)
    policy = get_policy("basic", Thresholds(alpha_tokens=BIG, beta_tokens=BIG))
    out = policy.schedule([req(i, hit=1000) for i in (1, 2)], state)
    assert [a.read_side for a in out] == [ReadSide.PE, ReadSide.PE]


def test_assignment_carries_the_charges_of_its_request():
    state = cluster([1], [1])
    [a] = dualpath().schedule([PendingRequest(request_id=7, prompt_tokens=1000, hit_tokens=896, total_len=1300)], state)
    assert (a.prefill_tokens, a.decode_tokens, a.read_tokens) == (104, 1300, 896)


def test_schedule_does_not_modify_the_state():
    state = cluster([2], [2])
    before = [(e.seq, e.tok, e.free_hbm_tokens) for e in state.engines.values()]
    dualpath().schedule([req(i, hit=64) for i in range(5)], state)
    assert [(e.seq, e.tok, e.free_hbm_tokens) for e in state.engines.values()] == before
    assert state.live_count == 0
