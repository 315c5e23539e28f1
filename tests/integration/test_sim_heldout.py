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

TOPOLOGY, DATASET, AGENTS, TURNS, SLOWDOWN = "2P2D", "48k", 48, 2, 6.0


def _agreement(tmp_path) -> tuple[dict, dict]:
    """The testbed's and the simulator's JCT per mode, the simulator fed the testbed's decode host time."""
    modes = ["basic", "dualpath"]
    testbed = validate.testbed_runs(
        TOPOLOGY, modes, agents=AGENTS, turns=TURNS, out=tmp_path, slowdown=SLOWDOWN, stagger_ms=validate.STAGGER_MS, dataset=DATASET
    )
    hosts = {m: testbed[m].get("decode_host_per_step") for m in modes}
    sim = validate.sim_jcts(TOPOLOGY, modes, agents=AGENTS, turns=TURNS, hosts=hosts, stagger_ms=validate.STAGGER_MS, dataset=DATASET)
    return {m: testbed[m]["jct_s"] for m in modes}, sim


@pytest.mark.timeout(2400)
def test_simulator_agrees_with_the_testbed_on_a_held_out_cluster(tmp_path):
    """48 agents keep the cluster storage-bound (dual-path about 1.3x over basic), so the 10% band
    on the speedup separates a simulator that models the second read path from one that does not
    (1.0x). The bounds are checked on a second run when the first misses them: one closed-loop
    testbed run on a shared 2-core host can stall for part of a second; a simulator that drifted
    misses both runs."""
    for run in range(2):
        tb, sim = _agreement(tmp_path / f"run-{run}")
        print(f"held-out {TOPOLOGY} {DATASET}, run {run}: testbed {tb}, simulator {sim}")
        speedup_sim, speedup_tb = sim["basic"] / sim["dualpath"], tb["basic"] / tb["dualpath"]
        misses = [f"{m}: simulator {sim[m]:.2f} s vs testbed {tb[m]:.2f} s" for m in tb if abs(sim[m] / tb[m] - 1) > 0.15]
        if speedup_tb <= 1.15:  # storage-bound enough that a simulator without the second path would miss
            misses.append(f"testbed speedup {speedup_tb:.3f} <= 1.15")
        if abs(speedup_sim / speedup_tb - 1) > 0.10:
            misses.append(f"speedups: simulator {speedup_sim:.3f} vs testbed {speedup_tb:.3f}")
        if not misses:
            break
    else:
        raise AssertionError(f"two runs missed the bounds; the last: {misses}")
