"""The cluster simulator: conservation, determinism, hand-checked timings, the fluid network."""

from __future__ import annotations

import gc
from array import array

import pytest

from dualpath.cost import cost_model
from dualpath.sim import SimConfig, Simulation, Workload
from dualpath.sim.clock import EventLoop
from dualpath.sim.network import HIGH, LOW, FluidNetwork, Link
from dualpath.sim.report import run_figures
from dualpath.sim.workload import Agent, build_agents


def small(mode: str = "dualpath", **kw) -> Simulation:
    kw.setdefault("decode_ep", 4)  # EP over the 4 decode GPUs: what these cases were sized with
    cfg = SimConfig(target="ds27b", prefill_nodes=1, decode_nodes=2, engines_per_node=2, mode=mode, **kw)
    return Simulation(cfg, Workload(dataset="32k", agents=24, turns=5, start_at=0.5, seed=3))


@pytest.mark.parametrize("mode", ["basic", "dualpath", "dualpath-rr", "basic-nolw"])
def test_bytes_read_equal_hit_tokens_times_kv_bytes_and_every_turn_completes_once(mode):
    sim = small(mode)
    expected_turns = sum(a.turns for a in sim.agents)
    m = sim.run()
    assert m.turns_done == expected_turns
    assert sim.agents_done == len(sim.agents) and sim.agents_failed == 0
    read = sum(s.bytes_read for s in sim.storage.values())
    assert read == pytest.approx(m.hit_tokens * sim.kv_bytes_per_token, rel=1e-9)
    assert sum(s.hit_tokens_read for s in sim.storage.values()) == m.hit_tokens
    assert m.hit_tokens > 0.9 * m.prompt_tokens  # warm storage: the sets' ~95%+ hit rate
    assert all(s.read_q == 0 and not s.slots and s.buffer_used == 0 for s in sim.storage.values())  # nothing left behind
    assert sim.scheduler.core.running == 0 and sim.scheduler.core.queued == 0


def test_basic_reads_only_on_prefill_nodes_and_oracle_reads_nothing():
    basic = small("basic")
    basic.run()
    assert [n for n, s in basic.storage.items() if s.bytes_read] == ["p0"]
    oracle = small("oracle")
    oracle.run()
    assert sum(s.bytes_read + s.bytes_written for s in oracle.storage.values()) == 0


def test_the_same_seed_gives_the_same_run_and_another_seed_does_not():
    a, b = small(), small()
    a.run()
    b.run()
    assert a.end_time == b.end_time
    assert list(a.metrics.ttft) == list(b.metrics.ttft) and list(a.metrics.tpot) == list(b.metrics.tpot)
    assert a.loop.events == b.loop.events
    c = Simulation(a.cfg, Workload(dataset="32k", agents=24, turns=5, start_at=0.5, seed=4))
    c.run()
    assert c.end_time != a.end_time


def one_request(mode: str, *, hit: int, prompt: int, gen: int, **kw) -> tuple[Simulation, Agent]:
    cfg = SimConfig(target="ds27b", prefill_nodes=1, decode_nodes=1, engines_per_node=1, mode=mode, **kw)
    agent = Agent(0, prompt - 10, array("i", [10]), array("i", [gen]), 0.0)
    agent.persisted = hit
    return Simulation(cfg, Workload(agents=1), [agent]), agent


@pytest.mark.parametrize("mode", ["basic", "dualpath", "basic-nolw", "oracle"])
def test_one_requests_time_is_the_closed_form_sum_of_its_load_prefill_and_decode(mode):
    hit, prompt, gen = 8192, 8192 + 300, 40
    sim, _ = one_request(mode, hit=hit, prompt=prompt, gen=gen)
    m = sim.run()
    cost, kvb, cfg = sim.cost, sim.kv_bytes_per_token, sim.cfg
    snic, cnic, layers = cfg.snic_bytes_per_s(), cfg.cnic_bytes_per_s(), cost.target.layers
    compute = cost.prefill_time([(hit, prompt - hit)])
    oracle = mode == "oracle"
    read = 0.0 if oracle else hit * kvb / snic  # storage -> buffer, alone on the SNIC
    load = hit * kvb / cnic  # layer-wise loads into the prefill GPU
    store = (prompt - hit if mode == "dualpath" else prompt) * kvb / cnic  # KV to the decode side
    if oracle:
        prefill = compute
    elif mode == "basic-nolw":
        prefill = load + compute + store
    else:
        prefill = max(compute, load + compute / layers, store)
    h2d = 0.0 if oracle else prompt * kvb / cnic  # decode buffer -> HBM
    steps = [sim.decode_cost.decode_step_time([prompt + i]) for i in range(gen - 1)]
    ttft = m.ttft[0]
    assert ttft == pytest.approx(read + prefill, rel=1e-5)
    decode = m.e2e[0] - ttft - h2d
    assert decode == pytest.approx(sum(steps), rel=2e-3)  # aggregated steps: secant of a near-linear step time
    assert m.tpot[0] == pytest.approx((h2d + sum(steps)) / (gen - 1), rel=2e-3)
    assert m.ttst[0] == pytest.approx(h2d + steps[0], rel=2e-3)  # the hand-off to the decode engine, then its first step


def test_decode_host_time_adds_to_every_step_and_nothing_else():
    """SimConfig.decode_host_s / decode_host_per_request_s: each of a lone request's gen - 1
    steps takes fixed + per-request (batch 1) more; TTFT does not change."""
    hit, prompt, gen = 8192, 8192 + 300, 40
    base, _ = one_request("dualpath", hit=hit, prompt=prompt, gen=gen)
    slow, _ = one_request("dualpath", hit=hit, prompt=prompt, gen=gen, decode_host_s=0.004, decode_host_per_request_s=0.001)
    a, b = base.run(), slow.run()
    assert b.ttft[0] == a.ttft[0]
    assert b.e2e[0] - a.e2e[0] == pytest.approx((gen - 1) * 0.005, rel=1e-6)
    with pytest.raises(ValueError, match="host"):
        SimConfig(decode_host_s=-1e-3)


def test_a_slower_decode_side_read_path_slows_dualpath_and_shifts_its_reads_but_not_basics():
    """SimConfig.de_read_share: the decode nodes read storage at that share of the SNIC rate. The
    scheduler's read-path choice sees their longer queues and moves reads to the prefill side;
    Basic never reads there, so its run is the same to the event."""
    full, slow = small("dualpath"), small("dualpath", de_read_share=0.5)
    full.run()
    slow.run()
    assert slow.end_time > full.end_time

    def decode_side(sim: Simulation) -> float:
        return sum(s.bytes_read for n, s in sim.storage.items() if n.startswith("d")) / sum(s.bytes_read for s in sim.storage.values())

    assert decode_side(slow) < decode_side(full)
    util = run_figures(slow)["snic_read_utilisation"]  # of each node's own read rate
    for name in ("p0", "d0"):
        rate = slow.cfg.snic_bytes_per_s() * (1.0 if name == "p0" else 0.5)
        assert util[name] == pytest.approx(slow.storage[name].bytes_read / slow.end_time / rate)
    b_full, b_slow = small("basic"), small("basic", de_read_share=0.5)
    b_full.run()
    b_slow.run()
    assert (b_slow.end_time, b_slow.loop.events) == (b_full.end_time, b_full.loop.events)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="de_read_share"):
            SimConfig(de_read_share=bad)


def test_a_lone_dualpath_request_reads_on_the_prefill_side_when_both_queues_are_empty():
    """A tie goes to the prefill side (the classic path)."""
    sim, _ = one_request("dualpath", hit=4096, prompt=4200, gen=4)
    sim.run()
    assert sim.storage["p0"].bytes_read > 0 and sim.storage["d0"].bytes_read == 0


def test_decode_event_volume_does_not_grow_with_tokens_generated():
    short, _ = one_request("oracle", hit=0, prompt=2000, gen=10)
    long_, _ = one_request("oracle", hit=0, prompt=2000, gen=5000)
    short.run()
    long_.run()
    assert long_.loop.events == short.loop.events


def test_two_flows_on_one_link_share_it_and_the_survivor_speeds_up():
    loop = EventLoop()
    net = FluidNetwork(loop)
    link = Link("l", 100.0)
    done: dict[str, float] = {}
    net.start((link,), 100.0, lambda k: done.__setitem__(k, loop.now), "a")
    net.start((link,), 300.0, lambda k: done.__setitem__(k, loop.now), "b")
    loop.run()
    # both at 50/s until a ends at 2 s (b has 200 left), then b alone at 100/s: 4 s
    assert done == {"a": pytest.approx(2.0), "b": pytest.approx(4.0)}
    assert link.moved == pytest.approx(400.0)


def test_max_min_gives_a_flow_the_capacity_its_bottlenecked_neighbour_cannot_use():
    loop = EventLoop()
    net = FluidNetwork(loop)
    narrow, wide = Link("narrow", 10.0), Link("wide", 100.0)
    f1 = net.start((narrow, wide), 1e6, lambda _: None)
    f2 = net.start((wide,), 1e6, lambda _: None)
    assert f1.rate == pytest.approx(10.0) and f2.rate == pytest.approx(90.0)


def test_kv_traffic_gets_only_what_high_priority_traffic_leaves():
    loop = EventLoop()
    net = FluidNetwork(loop)
    cnic, other = Link("cnic", 100.0), Link("other", 30.0)
    model = net.start((cnic, other), 1e6, lambda _: None, cls=HIGH)  # capped at 30 by its other link
    kv = net.start((cnic,), 1e6, lambda _: None, cls=LOW)
    assert model.rate == pytest.approx(30.0) and kv.rate == pytest.approx(70.0)


def test_the_workload_is_the_load_generators_set():
    from loadgen.dataset import load_dataset

    agents = build_agents(Workload(dataset="64k", agents=5, seed=2))
    trajectories = load_dataset("64k", agents=5, seed=2)
    assert [list(a.gens) for a in agents] == [list(t.gen_tokens) for t in trajectories]
    assert [a.system for a in agents] == [t.system_tokens for t in trajectories]


def test_decode_totals_give_the_same_step_time_as_context_lengths():
    cost = cost_model("ds660b")
    ctx = [500, 3000, 70000, 2047]
    totals = cost.decode_step_time_totals(len(ctx), sum(c + 1 for c in ctx), sum(min(c + 1, 2048) for c in ctx))
    assert totals == pytest.approx(cost.decode_step_time(ctx))


class _StubSim:
    """What ``DecodeEngineSim`` needs of a simulation: a loop, a cost model, a config."""

    def __init__(self) -> None:
        self.loop = EventLoop()
        self.decode_cost = cost_model("ds660b", ep=32)
        self.cfg = SimConfig(block_tokens=64)
        self.done: dict[int, float] = {}

    def decode_done(self, req, de) -> None:
        self.done[req.rid] = self.loop.now


def test_aggregated_decode_finishes_each_request_within_a_step_of_a_step_by_step_reference():
    from dualpath.sim.decode import DecodeEngineSim
    from dualpath.sim.request import SimRequest

    sim = _StubSim()
    de = DecodeEngineSim(sim, 0, "d0e0", 0, Link("in", 1.0), Link("out", 1.0), hbm_tokens=1 << 22)
    # (arrival s, prompt, tokens): joins and leaves at different times, contexts around top-k
    spec = [(0.0, 30000, 200), (0.5, 1500, 400), (1.2, 9000, 50), (2.0, 60000, 300), (2.1, 800, 2)]
    agent = Agent(0, 1, array("i", [1]), array("i", [1]), 0.0)
    for rid, (t, prompt, gen) in enumerate(spec):
        req = SimRequest(rid, agent, prompt, 0, gen, t)
        sim.loop.at(t, de.add, req)
    sim.loop.run()
    # step-by-step reference: a request joins at the first step boundary after it arrives
    cost, t, running, done, pending = sim.decode_cost, 0.0, {}, {}, list(enumerate(spec))
    while pending or running:
        while pending and pending[0][1][0] <= t:
            rid, (_, prompt, gen) = pending.pop(0)
            running[rid] = [prompt, gen - 1]
        if not running:
            t = pending[0][1][0]
            continue
        step = cost.decode_step_time([ctx for ctx, _ in running.values()])
        t += step
        for rid in list(running):
            running[rid][0] += 1
            running[rid][1] -= 1
            if running[rid][1] <= 0:
                done[rid] = t
                del running[rid]
    assert done.keys() == sim.done.keys()
    step = cost.decode_step_time([60000] * len(spec))  # the longest step (~41 ms at EP 32): joins fall between steps
    for rid, end in done.items():
        assert sim.done[rid] == pytest.approx(end, abs=step), rid
        assert sim.done[rid] == pytest.approx(end, rel=0.02), rid


def test_a_shared_link_finishes_flows_when_the_max_min_network_does():
    import random

    from dualpath.sim.sharedlink import SharedLink

    rng = random.Random(7)
    flows = [(rng.uniform(0, 5), rng.uniform(1, 400)) for _ in range(40)]  # (start s, bytes)
    ends: dict[str, dict[int, float]] = {"net": {}, "ps": {}}
    loop_a, loop_b = EventLoop(), EventLoop()
    net, link = FluidNetwork(loop_a), Link("l", 100.0)
    shared = SharedLink(loop_b, "s", 100.0)
    for i, (t, size) in enumerate(flows):
        loop_a.at(t, lambda i, size=size: net.start((link,), size, lambda k: ends["net"].__setitem__(k, loop_a.now), i), i)
        loop_b.at(t, lambda i, size=size: shared.start(size, lambda k: ends["ps"].__setitem__(k, loop_b.now), i), i)
    loop_a.run()
    loop_b.run()
    assert ends["ps"].keys() == ends["net"].keys() == set(range(40))
    for i, end in ends["net"].items():
        assert ends["ps"][i] == pytest.approx(end, rel=1e-9, abs=1e-9)
    assert shared.moved == pytest.approx(link.moved) == pytest.approx(sum(size for _, size in flows))
    assert loop_b.events < loop_a.events


@pytest.mark.parametrize("mode", ["basic", "dualpath"])
def test_with_tight_decode_buffers_few_reservations_are_refused_and_every_turn_completes(mode):
    """Nodes report their free buffer and the policy ranks full ones last, so a reservation is
    refused (back-pressure) mostly when every decode node looked full: before, a full node was
    chosen while others had room, over two refusals per turn here. The buffer places slots
    first fit (``NodeBuffer``), so a few more are refused where its free bytes lie apart."""
    sim = small(mode, dram_buffer_gb=4.0)  # 1 GB per node: a few slots of 32k-token prompts
    m = sim.run()
    assert m.turns_done == sum(a.turns for a in sim.agents) and sim.agents_failed == 0
    assert sim.scheduler.back_pressure < 1.25 * m.turns_done
    assert all(not s.slots and s.buffer_used == 0 for s in sim.storage.values())


@pytest.mark.parametrize("mode", ["basic-nolw", "basic", "dualpath-rr", "dualpath", "oracle", "split", "prefetch"])
def test_a_run_leaves_no_cyclic_garbage_so_the_collector_can_stay_off(mode):
    """``Simulation.run`` turns the cyclic collector off while it runs: that loses nothing
    only while no object of a run is freed by the collector alone (a cycle: a compiled
    closure and its environment were one, on every scheduling pass)."""
    cfg = SimConfig(target="ds27b", prefill_nodes=1, decode_nodes=2, engines_per_node=2, decode_ep=4, mode=mode, dram_buffer_gb=4.0)
    sim = Simulation(cfg, Workload(dataset="32k", agents=24, turns=5, start_at=0.5, seed=3, tool_gap_s=2.0))
    expected_turns = sum(a.turns for a in sim.agents)
    gc.collect()
    assert gc.isenabled()
    sim.run()
    assert gc.isenabled()  # on again after the run
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        found = gc.collect()
        kinds = sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert sim.metrics.turns_done == expected_turns
    assert found == 0, f"a run left {found} objects in reference cycles: {kinds[:8]}"


def _reference_max_min(links: list[Link], flows: list) -> dict:
    """Progressive filling by a linear scan for the least share at every step (one class)."""
    residual = {link: link.capacity for link in links}
    active = list(flows)
    rates = {}
    while active:
        shares = []
        for i, link in enumerate(links):
            n = sum(1 for f in active if link in f.links)
            if n:
                shares.append((residual[link] / n, i))
        share, bottleneck = min(shares)
        for f in [f for f in active if links[bottleneck] in f.links]:
            rates[f] = share
            active.remove(f)
            for link in f.links:
                residual[link] -= share
    return rates


@pytest.mark.parametrize("n_links", [8, 40])
@pytest.mark.parametrize("seed", range(20))
def test_max_min_rates_equal_a_plain_progressive_filling(seed, n_links):
    """The network's max-min against the textbook loop, on random flows over one to three
    links of mixed capacities: a scan for the bottleneck over a few links, a heap of link
    shares over many (more than ``_SCAN_LINKS``)."""
    import random

    from dualpath.sim import network

    rng = random.Random(seed)
    links = [Link(f"l{i}", rng.choice([1.0, 2.0, 3.0, 5.0])) for i in range(n_links)]
    net = FluidNetwork(EventLoop())
    flows = []
    for _ in range(rng.randint(2, 14) * n_links // 8):
        path = tuple(rng.sample(links, rng.randint(1, 3)))
        flows.append(net.start(path, 1e9, lambda _: None))
    expected = _reference_max_min(links, flows)
    assert (sum(1 for link in links if link.flows) > network._SCAN_LINKS) == (n_links == 40)  # one case for each fill
    net._max_min([link for link in links if link.flows], flows, any_high=False)
    assert [f.rate for f in flows] == pytest.approx([expected[f] for f in flows], rel=1e-12)
    for link in links:  # feasible: no link over its capacity
        assert sum(f.rate for f in link.flows) <= link.capacity * (1 + 1e-12)


def test_a_run_stopped_at_a_time_goes_on_from_there():
    """``run(until)`` twice is one run: the agents start once (their turns are not submitted again)."""
    whole, halves = small("dualpath"), small("dualpath")
    m = whole.run()
    halves.run(until=whole.end_time / 2)
    assert 0 < halves.metrics.turns_done < m.turns_done
    m2 = halves.run()
    assert m2.turns_done == m.turns_done and halves.end_time == pytest.approx(whole.end_time)
    assert halves.scheduler.core.queued == 0 and halves.scheduler.core.running == 0


def test_a_deadline_moved_later_keeps_its_event_and_runs_in_the_place_it_took():
    """``Deadline``: moving later re-arms when the old event fires (no event per move); the
    owner acts once, at the last time set; moved earlier, the one event moves up in place."""
    from dualpath.sim.clock import Deadline

    loop = EventLoop()
    ran: list[tuple[str, float]] = []
    d = Deadline(loop, lambda: ran.append(("owner", loop.now)))
    d.set(1.0)
    d.set(3.0)  # later: the event at 1.0 stays and re-arms at 3.0
    loop.at(3.0, lambda _: ran.append(("other", loop.now)))
    d.set(2.0)  # later than 1.0 still: no new event
    d.set(2.5)
    loop.run()
    assert ran == [("owner", 2.5), ("other", 3.0)]
    assert loop.events == 3  # the event at 1.0, its re-arm at 2.5, the other one
    d.set(4.0)
    loop.at(3.7, lambda _: ran.append(("other", loop.now)))
    d.set(3.5)  # earlier than the scheduled 4.0: the event moves up (nothing stale is left)
    assert loop.pending == 2
    loop.run()
    assert ran == [("owner", 2.5), ("other", 3.0), ("owner", 3.5), ("other", 3.7)]
    d.set(5.0)
    d.clear()  # and then nothing is due: the 5.0 event fires and is dropped
    loop.run()
    assert ran[-1] == ("other", 3.7) and loop.pending == 0


def test_the_event_heap_runs_events_in_time_then_scheduling_order():
    """The loop's own heap, moves in place (earlier and later) included, against a sort by
    (time, seq). The events are ``Deadline``s moved by ``schedule`` (compiled, the loop's
    ``Event`` takes no interpreted subclass)."""
    import random

    from dualpath.sim.clock import Deadline

    rnd = random.Random(7)
    loop = EventLoop()
    ran: list[int] = []
    expect: dict[int, tuple[float, int]] = {}
    events = [Deadline(loop, lambda i=i: ran.append(i)) for i in range(300)]
    for i, ev in enumerate(events):
        ev.set(float(rnd.randint(0, 40)))  # many same-instant events
        expect[i] = (ev.t, ev.seq)
    for i in rnd.sample(range(300), 150):  # moved either way, in place
        ev, seq = events[i], loop.reserve()
        ev.at = t = max(0.0, ev.t + rnd.randint(-10, 10))
        loop.schedule(ev, t, seq)
        expect[i] = (t, seq)
    assert loop.pending == 300
    loop.run()
    assert ran == sorted(expect, key=expect.__getitem__)
    assert loop.pending == 0 and all(ev.pos == -1 for ev in events)


def test_the_min_heap_gives_entries_in_end_then_seq_order():
    """``minheap.MinHeap`` (the decode batches' and storage links' heap), pushes and pops
    interleaved, with many equal ends, against a sort by (end, seq)."""
    import random

    from dualpath.sim.minheap import Entry, MinHeap

    rnd = random.Random(11)
    heap, out, pushed = MinHeap(), [], []
    for seq in range(1, 2001):
        e = Entry(float(rnd.randint(0, 60)), seq)
        heap.push(e)
        pushed.append(e)
        if rnd.random() < 0.4:
            out.append(heap.pop())
    while len(heap):
        out.append(heap.pop())
    assert sorted(id(e) for e in out) == sorted(id(e) for e in pushed)  # each entry once
    # every pop took the least (end, seq) of what was in the heap then: replay with a sort
    rnd = random.Random(11)
    live: list[tuple[float, int]] = []
    expected = []
    for seq in range(1, 2001):
        live.append((float(rnd.randint(0, 60)), seq))
        if rnd.random() < 0.4:
            live.sort()
            expected.append(live.pop(0))
    expected += sorted(live)
    assert [(e.end, e.seq) for e in out] == expected
    with pytest.raises(IndexError):
        heap.pop()


def test_a_parallel_sweep_brackets_the_same_knee_in_fewer_rounds() -> None:
    """``sweep_online(jobs=2)`` probes two rates per round in two processes: it must find the
    serial sweep's knee (to the tolerance) and spend no more rounds."""
    from dualpath.sim.experiments import sweep_online

    cfg = SimConfig(target="ds27b", prefill_nodes=1, decode_nodes=1, mode="basic")
    w = Workload(dataset="64k", agents=1 << 12, turns=2, start_at=0.5, duration_s=40.0)
    kw = {"slo_ttft": 4.0, "slo_tpot": 0.05, "start_rate": 20.0, "probes": 10, "tolerance": 0.05, "step": 1.5}  # knee ~41 APS
    serial = sweep_online(cfg, w, **kw)
    parallel = sweep_online(cfg, w, jobs=2, **kw)
    for sweep in (serial, parallel):
        points = sweep["points"]
        assert any(p["passed"] for p in points) and any(not p["passed"] for p in points), points
    lo, hi = sorted((serial["max_aps"], parallel["max_aps"]))
    assert hi / lo <= 1.05**2, (serial["max_aps"], parallel["max_aps"])
    assert -(-len(parallel["points"]) // 2) < len(serial["points"])  # rounds of two probes
    assert parallel["cpu_s"] == pytest.approx(sum(p["cpu_s"] for p in parallel["points"]))
