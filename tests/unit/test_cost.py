"""Tests of the roofline cost model (dualpath.cost)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.cost import (
    GPUS,
    TARGETS,
    CostModelError,
    InvalidWorkloadError,
    ModelDoesNotFitError,
    UnknownGpuError,
    UnknownTargetError,
    cost_model,
    get_gpu,
    get_target,
)
from dualpath.cost.model import _span_sum

K = 1024

# PAPER.md's cache-compute table (GB/PFLOP, append 429, context 16K-64K). KV bytes grow
# linearly with the context while prefill FLOPs grow as fixed + slope * context, so the
# ratio rises with context for dense and sparse attention alike: the low end of each range
# belongs to 16K and the high end to 64K (the test below checks the direction).
PAPER_RATIOS = [
    ("qwen32b", 16 * K, 117.0),
    ("qwen32b", 64 * K, 267.0),
    ("ds660b", 16 * K, 13.0),
    ("ds660b", 64 * K, 36.0),
    ("dsv3", 16 * K, 4.8),
    ("dsv3", 64 * K, 5.8),
]


@pytest.mark.parametrize(("target", "context", "paper"), PAPER_RATIOS)
def test_cache_compute_ratio_matches_the_paper_within_15_percent(target, context, paper):
    ratio = cost_model(target).cache_compute_ratio(context, 429)
    assert ratio == pytest.approx(paper, rel=0.15)


@pytest.mark.parametrize("target", ["qwen32b", "ds660b", "dsv3", "ds27b"])
def test_cache_compute_ratio_rises_with_context(target):
    model = cost_model(target)
    ratios = [model.cache_compute_ratio(c) for c in (16 * K, 32 * K, 64 * K)]
    assert ratios[0] < ratios[1] < ratios[2]


def test_deepseek_v32_ratio_at_32k_is_near_the_papers_22():
    assert cost_model("ds660b").cache_compute_ratio(32 * K) == pytest.approx(22.0, rel=0.15)


@pytest.mark.parametrize(
    ("target", "total", "active"),
    [
        ("qwen32b", 32.5e9, 32.5e9),
        ("ds660b", 671e9, 37e9),
        ("dsv3", 671e9, 37e9),
        ("ds27b", 27e9, None),
    ],
)
def test_parameter_counts_match_the_published_model_sizes(target, total, active):
    t = get_target(target)
    assert t.total_params() == pytest.approx(total, rel=0.04)
    if active is not None:
        assert t.active_params() == pytest.approx(active, rel=0.04)


def test_kv_bytes_per_token_follow_the_cache_formats():
    assert get_target("qwen32b").kv_bytes_per_token() == 64 * 2 * 8 * 128 * 2
    assert get_target("ds660b").kv_bytes_per_token() == 61 * 656
    assert get_target("ds27b").kv_bytes_per_token() == 30 * 656
    assert cost_model("ds660b").kv_bytes(64) == 64 * 61 * 656


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_prefill_time_grows_with_new_and_with_cached_tokens(target):
    model = cost_model(target)
    base = model.prefill_time([(8 * K, 429)])
    assert model.prefill_time([(8 * K, 2 * K)]) > base
    assert model.prefill_time([(32 * K, 429)]) > base
    assert model.prefill_time([(8 * K, 429)] * 4) > base


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_decode_step_time_grows_with_context_and_batch(target):
    model = cost_model(target)
    base = model.decode_step_time([16 * K] * 8)
    assert model.decode_step_time([64 * K] * 8) > base
    assert model.decode_step_time([16 * K] * 32) > base


def test_sparse_attention_cost_grows_far_slower_with_context_than_dense():
    """V3.2's top-2048 attention plus indexer vs V3's dense MLA, 16K -> 64K cached."""
    sparse, dense = cost_model("ds660b"), cost_model("dsv3")
    growth_sparse = sparse.attention_time([(64 * K, 429)]) / sparse.attention_time([(16 * K, 429)])
    growth_dense = dense.attention_time([(64 * K, 429)]) / dense.attention_time([(16 * K, 429)])
    assert growth_dense > 3.5
    assert growth_sparse < 2.5


def test_mean_layer_time_times_layers_is_the_prefill_time():
    model = cost_model("ds660b")
    batch = [(32 * K, 429), (1000, 3000)]
    assert model.prefill_layer_time(batch) * 61 == pytest.approx(model.prefill_time(batch))
    attention = model.attention_time(batch)
    assert 0 < attention < model.prefill_time(batch)


def test_moe_layers_take_longer_than_the_dense_first_layers_for_a_small_batch():
    """A small batch reads its share of routed experts, which the dense layers do not have."""
    model = cost_model("ds660b")
    batch = [(4 * K, 64)]
    assert model.prefill_layer_time(batch, layer=10) > model.prefill_layer_time(batch, layer=0)
    with pytest.raises(InvalidWorkloadError):
        model.prefill_layer_time(batch, layer=61)


def test_empty_batches_take_no_time():
    model = cost_model("qwen32b")
    assert model.prefill_time([]) == 0.0
    assert model.attention_time([]) == 0.0
    assert model.decode_step_time([]) == 0.0


def test_hbm_capacity_of_qwen32b_is_what_remains_beside_bf16_weights():
    """Data-parallel Qwen2.5-32B: ~65.5 GB of bf16 weights leave ~13 GB, i.e. ~50K tokens."""
    model = cost_model("qwen32b")
    assert model.weight_bytes_per_gpu() == pytest.approx(65.5e9, rel=0.02)
    assert 40_000 < model.hbm_kv_capacity_tokens() < 60_000


def test_more_expert_parallelism_frees_hbm_for_kv_cache():
    ep16 = cost_model("ds660b").hbm_kv_capacity_tokens()
    assert cost_model("ds660b", ep=32).hbm_kv_capacity_tokens() > ep16 > 100_000
    with pytest.raises(ModelDoesNotFitError, match="ep"):
        cost_model("ds660b", ep=1).hbm_kv_capacity_tokens()


def test_qwen32b_prefill_throughput_matches_a_roofline_worked_by_hand():
    """Qwen2.5-32B, 16 turns of 429 new tokens on 32K cached ones, one H800: GEMMs are
    2 x 32.76e9 FLOP per token at 65% of 989 TFLOPS, attention 4 x 64 layers x (40 x 128) x
    the mean context (32,768 + 429/2) FLOP per token at 55%: ~5,500 tokens/s, compute-bound."""
    gemm_s = 2 * 32.76e9 / (989e12 * 0.65)
    attention_s = 4 * 64 * 40 * 128 * (32768 + 429 / 2) / (989e12 * 0.55)
    assert cost_model("qwen32b").prefill_tokens_per_s() == pytest.approx(1 / (gemm_s + attention_s), rel=0.10)


def test_prefill_throughput_orders_the_targets_by_their_work_per_token():
    """Fewest FLOPs per token first: DS 27B (4.4B active, sparse attention) beats Qwen-32B,
    and dense-MLA V3 at 32K context (~630 GFLOP per token) is the slowest of all."""
    rate = {t: cost_model(t).prefill_tokens_per_s() for t in TARGETS}
    assert rate["ds27b"] > rate["ds660b"] > rate["qwen32b"] > rate["dsv3"]
    assert rate["ds27b"] > 5 * rate["qwen32b"]


def test_unknown_target_error_lists_the_valid_names():
    with pytest.raises(UnknownTargetError) as info:
        get_target("nope")
    assert isinstance(info.value, CostModelError)
    assert isinstance(info.value, LookupError)
    for name in TARGETS:
        assert name in str(info.value)


def test_unknown_gpu_error_lists_the_valid_names():
    with pytest.raises(UnknownGpuError, match="h800") as info:
        cost_model("ds27b", gpu="a100")
    assert all(name in str(info.value) for name in GPUS)
    assert get_gpu("h100").hbm_capacity_bytes == 80 * 2**30


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.prefill_time([(-1, 10)]),
        lambda m: m.prefill_time([(10, 0)]),
        lambda m: m.decode_step_time([0]),
        lambda m: m.kv_bytes(-5),
        lambda m: m.hbm_kv_capacity_tokens(reserve_fraction=1.0),
        lambda m: m.prefill_tokens_per_s(requests=0),
    ],
)
def test_impossible_workloads_raise_invalid_workload_error(call):
    with pytest.raises(InvalidWorkloadError):
        call(cost_model("ds27b"))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 600), st.sampled_from([0, 1, 64, 2048]))
def test_span_sum_matches_a_brute_force_sum(cached, new, cap):
    brute = sum(min(cached + i, cap) if cap else cached + i for i in range(1, new + 1))
    assert _span_sum(cached, new, cap) == brute


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 100_000), st.integers(1, 4096)), min_size=1, max_size=8),
    st.sampled_from(sorted(TARGETS)),
)
def test_adding_a_request_never_makes_prefill_faster(batch, target):
    model = cost_model(target)
    assert model.prefill_time([*batch, (1000, 100)]) > model.prefill_time(batch)


def test_a_decode_step_pays_the_expert_all_to_all_only_when_the_group_spans_nodes():
    from dataclasses import replace

    from dualpath.cost.model import CostModel

    h800 = get_gpu("h800")
    one_domain = replace(h800, nvlink_domain=1 << 20)  # the same GPU if every EP group stayed on NVLink
    ctx = [60_000] * 8
    for target, ep, per_layer_us in (("ds660b", 16, 118 + 195), ("ds660b", 32, 155 + 273), ("ds660b", 256, 194 + 360)):
        t = get_target(target)
        extra = CostModel(t, h800, ep=ep).decode_step_time(ctx) - CostModel(t, one_domain, ep=ep).decode_step_time(ctx)
        assert extra == pytest.approx(t.moe_layers * per_layer_us * 1e-6)  # DeepEP's low-latency dispatch + combine
    # EP 24 lies between the measured 16 and 32 (log2 interpolation); within one node nothing is added
    assert 313e-6 < h800.decode_all_to_all_s(24) < 428e-6
    assert h800.decode_all_to_all_s(8) == 0.0
    t27 = get_target("ds27b")
    assert CostModel(t27, h800, ep=8).decode_step_time(ctx) == CostModel(t27, one_domain, ep=8).decode_step_time(ctx)
    # prefill is unchanged: its all-to-all is bandwidth-bound and overlapped
    assert CostModel(get_target("ds660b"), h800, ep=32).prefill_time([(30_000, 429)]) == CostModel(
        get_target("ds660b"), one_domain, ep=32
    ).prefill_time([(30_000, 429)])


def test_the_660b_decode_step_lands_near_the_papers_tpot():
    """The paper's 2P4D online run reports TPOT 39 ms (44P88D: 36 ms); a decode GPU of 2P4D
    (EP 32) with a few long-context requests should be within 15% of it, not the ~16 ms the
    roofline alone gave."""
    step = cost_model("ds660b", ep=32).decode_step_time([50_000] * 8)
    assert step == pytest.approx(0.039, rel=0.15)
