"""Thresholds, load-balance figures, the policy registry and the scheduler benchmark's
plumbing (its figures are printed by ``dualpath bench scheduler``, not asserted here)."""

from __future__ import annotations

import json

import pytest

from dualpath.bench.scheduler import format_report, run_bench
from dualpath.policy import (
    ClusterState,
    LoadAccumulator,
    PendingRequest,
    ReadPath,
    ReadSide,
    Thresholds,
    alpha_tokens,
    beta_tokens,
    get_policy,
    max_over_avg,
)
from dualpath.policy.errors import (
    EmptyValuesError,
    InvalidThresholdError,
    InvalidTopologyError,
    NegativeLoadError,
    UnknownMemberError,
    UnknownPolicyError,
)

OPEN = Thresholds(alpha_tokens=10**9, beta_tokens=10**9)


def test_alpha_is_three_seconds_of_storage_nic_in_tokens():
    # 400 Gbps = 50e9 B/s; DeepSeek-V3.2 FP8 MLA 656 B x 61 layers = 40,016 B/token.
    # 150e9 / 40,016 = 3,748,500.6 -> 3,748,500.
    assert alpha_tokens(50e9, 656 * 61) == 3_748_500
    assert alpha_tokens(50e9, 656 * 61, seconds=1.0) == 1_249_500


def test_beta_is_five_seconds_of_one_gpu_in_tokens():
    assert beta_tokens(12_000) == 60_000
    th = Thresholds.from_profile(snic_bytes_per_s=1000, kv_bytes_per_token=10, prefill_tokens_per_s=7, alpha_seconds=2, beta_seconds=3)
    assert (th.alpha_tokens, th.beta_tokens) == (200, 21)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_thresholds_refuse_non_positive_inputs(bad):
    with pytest.raises(InvalidThresholdError):
        alpha_tokens(bad, 100)
    with pytest.raises(InvalidThresholdError):
        beta_tokens(bad)
    with pytest.raises(InvalidThresholdError):
        Thresholds(alpha_tokens=-1, beta_tokens=0)


def test_max_over_avg_of_loads():
    assert max_over_avg([1, 2, 3]) == pytest.approx(1.5)
    assert max_over_avg([0, 0]) == 1.0  # nothing moved yet: balanced
    with pytest.raises(EmptyValuesError):
        max_over_avg([])
    with pytest.raises(NegativeLoadError):
        max_over_avg([1, -1])


def test_accumulator_counts_idle_members_in_the_average():
    acc = LoadAccumulator(["n0", "n1", "n2", "n3"], what="snic bytes")
    acc.add("n0", 300)
    acc.add("n1", 100)
    assert acc.max_over_avg() == pytest.approx(3.0)  # 300 / (400 / 4)
    assert acc.totals()["n3"] == 0.0
    acc.reset()
    assert acc.max_over_avg() == 1.0
    with pytest.raises(UnknownMemberError):
        acc.add("n9", 1)
    with pytest.raises(NegativeLoadError):
        acc.add("n0", -5)
    with pytest.raises(EmptyValuesError):
        LoadAccumulator([])


def test_unknown_policy_and_read_path_names_are_refused():
    with pytest.raises(UnknownPolicyError, match="dualpath"):
        get_policy("fastest", OPEN)
    with pytest.raises(UnknownPolicyError):
        get_policy("dualpath", OPEN, read_path="both")


def test_read_path_override_and_basic_semantics():
    state = ClusterState.from_topology(prefill_nodes=1, decode_nodes=1, gpus_per_node=1, decode_hbm_tokens=10**6)
    state.report_node(0, read_q=10**6)  # the PE side is far busier
    r = [PendingRequest(request_id=1, prompt_tokens=200, hit_tokens=128, total_len=300)]
    assert get_policy("dualpath", OPEN).schedule(r, state)[0].read_side is ReadSide.DE
    assert get_policy("dualpath", OPEN, read_path="pe").schedule(r, state)[0].read_side is ReadSide.PE
    assert get_policy("least_tokens", OPEN, read_path=ReadPath.DE).schedule(r, state)[0].read_side is ReadSide.DE
    basic = get_policy("basic", OPEN, read_path="de")  # basic is PE-only by definition
    assert basic.read_path is ReadPath.PE and basic.schedule(r, state)[0].read_side is ReadSide.PE


def test_round_robin_cursor_follows_the_decisions_applied():
    state = ClusterState.from_topology(prefill_nodes=1, decode_nodes=1, gpus_per_node=3, decode_hbm_tokens=10**6)
    rr = get_policy("round_robin", OPEN)
    reqs = [PendingRequest(request_id=i, prompt_tokens=10, hit_tokens=0, total_len=10) for i in range(4)]
    assert [a.prefill_engine for a in rr.schedule(reqs, state)] == [0, 1, 2, 0]
    assert [a.prefill_engine for a in rr.schedule(reqs, state)] == [0, 1, 2, 0]  # nothing applied: same
    state.on_assigned(rr.schedule(reqs[:1], state)[0])
    assert [a.prefill_engine for a in rr.schedule(reqs[1:3], state)] == [1, 2]
    assert [a.decode_engine for a in rr.schedule(reqs[1:3], state)] == [4, 5]


def test_round_robin_alternates_the_read_side_whatever_the_read_queues_say():
    state = ClusterState.from_topology(prefill_nodes=1, decode_nodes=1, gpus_per_node=2, decode_hbm_tokens=10**6)
    state.report_node(0, read_q=10**6)  # the prefill node's queue is far longer: round robin does not look
    reqs = [PendingRequest(request_id=i, prompt_tokens=200, hit_tokens=128, total_len=300) for i in range(4)]
    rr = get_policy("round_robin", OPEN)
    assert [a.read_side for a in rr.schedule(reqs, state)] == [ReadSide.PE, ReadSide.DE, ReadSide.PE, ReadSide.DE]
    state.on_assigned(rr.schedule(reqs[:1], state)[0])  # the cursor moves with the decisions applied
    assert [a.read_side for a in rr.schedule(reqs[1:3], state)] == [ReadSide.DE, ReadSide.PE]
    assert {a.read_side for a in get_policy("round_robin", OPEN, read_path="pe").schedule(reqs, state)} == {ReadSide.PE}
    assert get_policy("basic", OPEN).schedule(reqs, state)[1].read_side is ReadSide.PE


def test_least_tokens_ignores_read_queues_and_groups():
    state = ClusterState.from_topology(prefill_nodes=2, decode_nodes=2, gpus_per_node=1, decode_hbm_tokens=10**6)
    state.report_node(1, read_q=10**6)  # PE1's node is far over alpha, yet PE1 has fewer tokens
    state.report_engine(0, seq=1, tok=50)
    state.report_engine(3, seq=0, tok=10)
    [a] = get_policy("least_tokens", Thresholds(alpha_tokens=10, beta_tokens=10**9)).schedule(
        [PendingRequest(request_id=1, prompt_tokens=10, hit_tokens=0, total_len=10)], state
    )
    assert (a.prefill_engine, a.decode_engine) == (1, 2)


def test_bench_drives_the_core_at_the_offered_rate_and_dispatches_every_request_it_admits():
    d = run_bench(engines=24, seconds=4.0, seed=1, warmup_s=0.5)
    assert d["topology"].startswith("1P2D")
    # Poisson arrivals at the offered rate (29/s for 24 GPUs): 4 s gives ~115 submissions
    assert d["submitted"] == pytest.approx(d["offered_requests_per_s"] * 4.0, rel=0.25)
    assert d["failed"] == 0 and d["max_queued"] == 0  # a 1P2D group absorbs this load: nothing waits
    # each admitted request gets one DE buffer slot and one dispatch
    assert d["commands_per_s"]["Dispatch"] == d["commands_per_s"]["ReserveSlot"] > 0
    assert d["requests_per_s"] > 0
    json.dumps(d)
    text = format_report(d)
    assert "requests/s" in text and "submitted" in text
    with pytest.raises(InvalidTopologyError):
        run_bench(engines=100)


def test_bench_feeds_every_report_and_tick_at_its_real_rate():
    d = run_bench(engines=24, seconds=1.0, seed=2, warmup_s=1.0)
    ev = d["events_per_s"]
    assert ev["EngineReported"] == pytest.approx(24 / 0.2, rel=0.05)  # every engine every 0.2 s
    assert ev["NodeReported"] == pytest.approx(3 / 0.2, rel=0.1)  # every traffic manager every 0.2 s
    assert ev["TimeAdvanced"] == pytest.approx(1 / d["tick_s"], rel=0.01)
    assert ev["SlotReserved"] > 0 and ev["DispatchAnswered"] > 0
    assert 0 < d["core_utilisation"]


def test_bench_cli_refuses_a_cluster_size_it_cannot_build_with_one_line_and_status_2(capsys):
    from dualpath.bench import main

    assert main(["scheduler", "--engines", "10000", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "multiple of 24" in out.err
