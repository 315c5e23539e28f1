"""Held out from every table: the simulator against the emulated testbed on a cluster and a trajectory
set that neither ``dualpath sim paper`` nor ``dualpath sim validate`` runs (DS 27B, 2P2D, the 48K set).

The testbed runs the real services with modeled compute and emulated NICs; the simulator is set up as
the testbed runs (``dualpath.sim.validate.testbed_config``) and takes the decode host time per step
the testbed measured, nothing else from it. A simulator whose storage, network, prefill or decode
timing drifted from the services' would miss these bounds."""

from __future__ import annotations

import pytest

from dualpath.sim import validate

pytestmark = pytest.mark.slow

TOPOLOGY, DATASET, AGENTS, TURNS, SLOWDOWN = "2P2D", "48k", 24, 2, 6.0


@pytest.mark.timeout(1500)
def test_simulator_agrees_with_the_testbed_on_a_held_out_cluster(tmp_path):
    modes = ["basic", "dualpath"]
    testbed = validate.testbed_runs(
        TOPOLOGY, modes, agents=AGENTS, turns=TURNS, out=tmp_path, slowdown=SLOWDOWN, stagger_ms=validate.STAGGER_MS, dataset=DATASET
    )
    hosts = {m: testbed[m].get("decode_host_per_step") for m in modes}
    sim = validate.sim_jcts(TOPOLOGY, modes, agents=AGENTS, turns=TURNS, hosts=hosts, stagger_ms=validate.STAGGER_MS, dataset=DATASET)
    tb = {m: testbed[m]["jct_s"] for m in modes}
    print(f"held-out {TOPOLOGY} {DATASET}: testbed {tb}, simulator {sim}")
    for mode in modes:
        assert abs(sim[mode] / tb[mode] - 1) <= 0.15, (mode, sim[mode], tb[mode])
    speedup_sim, speedup_tb = sim["basic"] / sim["dualpath"], tb["basic"] / tb["dualpath"]
    assert speedup_tb > 1.08, tb  # storage-bound enough that the read paths matter
    assert abs(speedup_sim / speedup_tb - 1) <= 0.10, (speedup_sim, speedup_tb)
