"""The calibration table: one place for every constant, each with its source, and the code reads it."""

from __future__ import annotations

import json

from dualpath.cost import calibration, cost_model, get_gpu
from dualpath.cost.calibration import CALIBRATION, KINDS, value
from dualpath.policy.thresholds import ALPHA_SECONDS, BETA_SECONDS
from dualpath.sim import paper
from dualpath.sim.config import SimConfig


def test_every_constant_names_its_source_and_at_most_three_are_fitted_to_a_row():
    for c in CALIBRATION.values():
        assert c.kind in KINDS and c.source.strip() and c.what.strip() and c.unit.strip(), c
    fitted = calibration.fitted()
    assert len(fitted) <= 3
    assert all(c.row for c in fitted)
    json.dumps(calibration.table())  # what `sim paper --json` prints


def test_the_gpu_profile_the_cost_model_and_the_simulator_read_the_table():
    gpu = get_gpu("h800")
    assert gpu.bf16_flops == value("gpu_bf16_flops") and gpu.fp8_flops == value("gpu_fp8_flops")
    assert gpu.hbm_bytes_per_s == value("gpu_hbm_bytes_per_s") and gpu.hbm_capacity_bytes == value("gpu_hbm_bytes")
    assert (gpu.mfu_dense, gpu.mfu_attention, gpu.hbm_efficiency) == (
        value("gemm_fraction"),
        value("attention_fraction"),
        value("hbm_fraction"),
    )
    assert gpu.layer_overhead_s == value("layer_overhead_s")
    ep32 = [d + c for e, d, c in gpu.ep_all_to_all_us if e == 32]
    assert ep32 == [value("decode_all_to_all_us")]
    cfg = SimConfig()
    assert (cfg.snic_gbps, cfg.cnic_gbps, cfg.dram_buffer_gb, cfg.gpus_per_node) == (
        value("snic_gbps"),
        value("cnic_gbps"),
        value("dram_buffer_gb"),
        value("gpus_per_node"),
    )
    assert (cfg.quota_s, cfg.block_tokens, cfg.decode_host_s) == (value("quota_s"), value("block_tokens"), value("decode_step_host_s"))
    assert (ALPHA_SECONDS, BETA_SECONDS) == (value("alpha_s"), value("beta_s"))
    assert cost_model("ds660b").target.kv_bytes_per_token_layer == value("mla_kv_bytes_per_token_layer")
    table_run = paper._config("ds27b", 1, 2, 0)  # every row of `sim paper` runs this cluster config
    assert table_run.de_read_share == value("de_snic_read_share") < 1 == cfg.de_read_share
    assert table_run.decode_host_per_request_s == value("ds27b_decode_per_request_s")


def test_reserving_more_hbm_leaves_less_for_kv():
    m = cost_model("ds660b", ep=32)
    assert m.hbm_kv_capacity_tokens(reserve_fraction=0.2) < m.hbm_kv_capacity_tokens()
