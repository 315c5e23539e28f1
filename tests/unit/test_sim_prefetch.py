"""Agent-aware prefetch in the simulator (mode ``prefetch``): the traffic manager's own
``PrefetchCache`` beside each node's ``NodeBuffer``; staged and retained runs serve next
turns, never take a request's room, and leave nothing behind."""

from __future__ import annotations

import json
from dataclasses import replace

from dualpath.cli.sim import main
from dualpath.sim import SimConfig, Simulation, Workload


def gapped(mode: str, **kw) -> Simulation:
    """Agents with a tool-call gap between turns (the prefetch's window)."""
    cfg = SimConfig(target="ds27b", prefill_nodes=1, decode_nodes=2, engines_per_node=2, mode=mode, **kw)
    return Simulation(cfg, Workload(dataset="32k", agents=24, turns=5, start_at=0.5, seed=3, rate=2.0, tool_gap_s=3.0))


def test_staged_copies_serve_next_turns_and_every_turn_completes():
    sim = gapped("prefetch")
    m = sim.run()
    assert m.turns_done == sum(a.turns for a in sim.agents) and sim.agents_failed == 0
    pf = sim.prefetch.summary()
    kept = pf["staged_bytes"] + pf["retained_bytes"]  # read from storage while idle, or kept from the turn's own read
    assert pf["staged_bytes"] > 0 and pf["retained_bytes"] > 0 and pf["used_bytes"] > 0.5 * kept
    assert kept == pf["used_bytes"] + pf["dropped_bytes"] + sim.prefetch.cached_bytes()  # every kept byte is accounted for
    # the hits a run served were not read from storage again
    assert sum(s.hit_tokens_read for s in sim.storage.values()) == m.hit_tokens
    assert sum(s.bytes_read for s in sim.storage.values()) + pf["used_bytes"] == m.hit_tokens * sim.kv_bytes_per_token
    assert all(s.read_q == 0 and not s.slots for s in sim.storage.values())


def test_the_node_that_read_a_turn_keeps_it_so_the_next_turns_read_less_from_storage():
    """Retained copies (no storage read) lower the storage bytes a run reads, staging included."""
    base, pf = gapped("dualpath"), gapped("prefetch")
    base.run(), pf.run()
    summary = pf.prefetch.summary()

    def storage_bytes(sim: Simulation) -> float:  # requests' reads and staging: all the SNIC read
        return sum(s.read_link.series.total() for s in sim.storage.values())

    assert summary["retained_bytes"] > summary["staged_bytes"]
    assert storage_bytes(pf) < 0.7 * storage_bytes(base)


def test_a_small_buffer_still_completes_every_turn_and_copies_stay_within_the_cache():
    roomy, tight = gapped("prefetch"), gapped("prefetch", dram_buffer_gb=2.0, prefetch_gb=1.0)
    roomy.run(), tight.run()
    assert tight.metrics.turns_done == roomy.metrics.turns_done
    pf = tight.prefetch.summary()
    assert 1.0e9 * tight.cfg.node_share - 4096 < pf["cap_bytes_per_node"] <= 1.0e9 * tight.cfg.node_share  # whole pages
    assert 0 < pf["peak_cache_bytes"] <= pf["cap_bytes_per_node"]


def test_staged_runs_sit_beside_the_buffer_and_never_take_a_requests_room():
    sim = gapped("prefetch", prefetch_gb=80.0)
    node, storage = sim.prefetch.nodes["d0"], sim.storage["d0"]
    blocks = int(0.3 * storage.buffer_bytes / storage.block_bytes)
    for agent in (1, 2, 3):  # three runs as large as 90% of the request buffer
        node.stage(agent, blocks)
    sim.loop.run(60.0)
    cache = storage.cache
    assert cache.ready_bytes() == 3 * blocks * storage.block_bytes and cache.stats.staged_bytes == cache.ready_bytes()
    assert storage.buffer_used == 0 and storage.buffer_report() == (storage.buffer_bytes, storage.buffer_bytes)
    assert storage.reserve("r", storage.buffer_bytes)  # the whole request buffer, and no run given up
    assert cache.stats.evictions == 0 and cache.stats.dropped_bytes == 0
    assert not storage.reserve("r2", 1.0)  # the request buffer is full: the cache does not lend it room


def test_a_read_takes_the_staged_leading_blocks_and_reads_only_the_rest():
    sim = gapped("prefetch")
    node, storage = sim.prefetch.nodes["p0"], sim.storage["p0"]
    node.stage(7, 10)
    sim.loop.run(60.0)
    bb = storage.block_bytes
    assert storage.cache.ready_bytes() == 10 * bb and storage.buffer_used == 0
    req = sim.agents[7]  # a turn of agent 7 with 20 hit blocks, read on the PE path
    from dualpath.sim.request import SimRequest

    turn = SimRequest(999, req, prompt=64 * 21, hit=64 * 20, gen=8, now=sim.loop.now)
    before, done = storage.bytes_read, []
    storage._on_read = done.append  # this read alone: not handed to a prefill engine
    storage.read(turn, 20 * bb, into_buffer=True, staged=True)
    assert storage.buffer_used >= 20 * bb and storage.cache.ready_bytes() == 0  # the run moved into the request's slot
    sim.loop.run(sim.loop.now + 60.0)
    assert done == [turn] and storage.bytes_read - before == 10 * bb and storage.cache.stats.used_bytes == 10 * bb


def test_staging_waits_while_the_node_reads_for_a_request():
    sim = gapped("prefetch")
    node, storage = sim.prefetch.nodes["p0"], sim.storage["p0"]
    storage.active = 1  # a request's read is running
    node.stage(1, 100)
    sim.loop.run(1.0)
    assert not node.busy and storage.cache.ready_bytes() == 0 and storage.read_link.active == 0
    storage.active = 0
    node.pump()
    assert node.busy and storage.read_link.active == 1


def test_the_budget_bounds_the_cache_runs_hold():
    sim = gapped("prefetch", prefetch_gb=0.5)
    sim.run()
    assert 0 < sim.prefetch.summary()["peak_cache_bytes"] <= 0.5e9 * sim.cfg.node_share


def test_prefetch_off_is_dualpath_unchanged():
    a, b = gapped("dualpath"), gapped("dualpath")
    assert a.prefetch is None and a.run().ttft == b.run().ttft
    assert replace(a.cfg, mode="prefetch").sim_mode.prefetch


def test_sim_online_prefetch_runs_the_prefetch_mode_next_to_dualpath_and_reports_its_buffer(capsys):
    argv = ["online", "--target", "ds27b", "--topology", "1P1D", "--dataset", "32k", "--turns", "3", "--start-at", "0.5"]
    argv += ["--rate", "2", "--duration", "5", "--tool-gap", "2", "--modes", "dualpath", "--prefetch", "--prefetch-gb", "4", "--json"]
    assert main(argv) == 0
    modes = json.loads(capsys.readouterr().out)["modes"]
    assert list(modes) == ["dualpath", "prefetch"] and modes["dualpath"]["prefetch"] is None
    pf = modes["prefetch"]["prefetch"]
    assert pf["staged_bytes"] > 0 and 0 < pf["used_fraction"] <= 1 and 0 < pf["peak_cache_bytes"] <= 4e9
