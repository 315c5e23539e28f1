"""``dualpath bench index``'s figures: the load model and how headroom and per-core capacity follow
from what was measured (pure arithmetic; the benchmark itself is run by hand)."""

from __future__ import annotations

import pytest

from dualpath.bench.index import LOAD, _grouping, _report


def test_the_load_model_has_the_paper_s_per_turn_message_pattern() -> None:
    turn = LOAD["per_turn"]
    assert LOAD["lookups_per_s"] == pytest.approx(1381.6)
    assert LOAD["block_commits_per_s"] == pytest.approx(LOAD["lookups_per_s"] * (turn["prompt_blocks"] + turn["generated_commit_messages"]))
    assert LOAD["commit_requests_per_s"] / LOAD["lookups_per_s"] == pytest.approx(3.75)
    assert turn["hashes_per_lookup"] == LOAD["chain_blocks"] == 511


def test_headroom_is_the_smallest_ratio_and_the_projection_scales_one_replica_core() -> None:
    t = 10.0  # seconds measured; lookups at 2x the load, commits at 1.5x
    measured = {
        "elapsed_s": t,
        "lookups": 2 * LOAD["lookups_per_s"] * t,
        "commit_requests": 1.5 * LOAD["commit_requests_per_s"] * t,
        "block_commits": 1.5 * LOAD["block_commits_per_s"] * t,
    }
    r = _report(measured, {"kv-persistence-0": 3.0, "kv-persistence-1": 3.0, "nats-0": 1.5}, 2.0, 2, 1, 64)
    assert r["headroom"] == pytest.approx(1.5) and not r["headroom_ok"]
    assert r["replica_cores_for_load"] == pytest.approx(6.0 / 15.0)  # 6 CPU seconds for 15 seconds of the full load
    assert r["per_replica_core"]["headroom"] == pytest.approx(2.5)
    assert r["projected_headroom"] == pytest.approx(5.0)
    assert r["cores_used"]["driver"] == pytest.approx(0.2)


def test_stream_grouping_is_summed_from_each_replica_s_last_index_closed_line(tmp_path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = [
        '{"event": "index_closed", "records": 1, "ops": 1}',  # an earlier run of the replica
        '{"event": "index_loaded"}',
        '{"event": "index_closed", "records": 10, "ops": 300}',
    ]
    (logs / "kv-persistence-0.log").write_text("\n".join(lines) + "\n")
    (logs / "kv-persistence-1.log").write_text('{"event": "index_closed", "records": 5, "ops": 100}\n')
    assert _grouping(logs, 3) == {"records": 15, "ops": 400, "ops_per_record": pytest.approx(400 / 15)}  # replica 2 left no log
    assert _grouping(tmp_path / "none", 1) == {"records": 0, "ops": 0, "ops_per_record": None}
