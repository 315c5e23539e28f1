"""The online experiment's sweep driver (the probes themselves are faked: each is a testbed run)."""

from __future__ import annotations

import json

from dualpath.cli.experiment import online, runner


def test_the_sweep_alternates_the_modes_probes_and_reports_each_modes_best_rate_and_their_ratio(tmp_path, monkeypatch):
    capacity = {"basic": 2.0, "dualpath": 3.5}  # highest passing APS of each mode
    order: list[tuple[str, float]] = []

    def fake_prepare(ns, prog, **fields):
        spec = runner.TestbedSpec(
            model="m", topology=None, target=ns.target, scale=1.0, gpus_per_node=8, snic_gbps=1.0, cnic_gbps=1.0,
            dataset="64k", agents=ns.agents, turns=ns.turns, seed=0, out=tmp_path, **fields,
        )  # fmt: skip
        return spec, ["basic", "dualpath"]

    def fake_probe(spec, mode, rate, index, k, say):
        order.append((mode, rate))
        ok = rate <= capacity[mode]
        return {"mode": mode, "rate": rate, "passed": ok, "failed_turns": 0, "attainment": 1.0 if ok else 0.5,
                "ttft_p50": 0.2 if ok else 6.0, "ttft_p99": 1.0 if ok else 9.0, "ttft_queue_share": 0.1, "hit_rate": 0.99}  # fmt: skip

    monkeypatch.setattr(online, "prepare", fake_prepare)
    monkeypatch.setattr(online, "_probe", fake_probe)
    assert online.main(["--sweep", "--rate", "1", "--sweep-probes", "4", "--out", str(tmp_path)]) == 0
    modes = [m for m, _ in order]
    assert modes[:6] == ["basic", "dualpath"] * 3  # interleaved while both still probe
    result = json.loads((tmp_path / "result.json").read_text())
    best = {m: r["max_aps"] for m, r in result["modes"].items()}
    assert 1.0 <= best["basic"] <= 2.0 and 2.0 <= best["dualpath"] <= 3.5
    assert result["aps_ratio"] == best["dualpath"] / best["basic"]
    assert (tmp_path / "online.png").stat().st_size > 0


def test_prefetch_runs_get_one_untimed_lead_in_turn_per_agent_on_the_measured_stack(tmp_path, monkeypatch):
    seen: dict[str, int] = {}

    def fake_prepare(ns, prog, **fields):
        seen["untimed"] = fields["untimed_turns"]
        return None  # stop before any stack starts

    monkeypatch.setattr(online, "prepare", fake_prepare)
    online.main(["--prefetch", "--out", str(tmp_path)])
    assert seen["untimed"] == 1  # a copy is staged when the previous turn ends: the first timed turn needs one
    online.main(["--out", str(tmp_path)])
    assert seen["untimed"] == 0  # without prefetch the regime is the one docs/results.md's online figures were measured in
    online.main(["--prefetch", "--untimed-turns", "0", "--out", str(tmp_path)])
    assert seen["untimed"] == 0
    assert online.main(["--untimed-turns", "-1", "--out", str(tmp_path)]) == 2
