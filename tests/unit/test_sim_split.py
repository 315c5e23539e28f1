"""Split reads in the simulator (mode ``split``): both storage NICs read one request's hits,
bytes are conserved, and a lone long request's read time halves (less the CNIC hop share)."""

from __future__ import annotations

import pytest

from tests.unit.test_sim import one_request, small


def test_split_mode_reads_every_hit_token_once_and_leaves_nothing_behind():
    sim = small("split")
    m = sim.run()
    assert m.turns_done == sum(a.turns for a in sim.agents) and sim.agents_failed == 0
    assert sum(s.hit_tokens_read for s in sim.storage.values()) == m.hit_tokens
    assert sum(s.bytes_read for s in sim.storage.values()) == pytest.approx(m.hit_tokens * sim.kv_bytes_per_token, rel=1e-9)
    assert all(s.read_q == 0 and not s.slots and s.buffer_used == 0 for s in sim.storage.values())


def test_a_lone_long_request_is_read_by_both_nodes_and_its_first_token_comes_sooner():
    hit, prompt, gen = 64 * 512, 64 * 512 + 300, 4
    whole, _ = one_request("dualpath", hit=hit, prompt=prompt, gen=gen)
    split, _ = one_request("split", hit=hit, prompt=prompt, gen=gen)
    tw, ts = whole.run().ttft[0], split.run().ttft[0]
    pe, de = split.storage["p0"].bytes_read, split.storage["d0"].bytes_read
    assert pe > 0 and de > 0 and pe + de == pytest.approx(hit * split.kv_bytes_per_token)
    assert pe > de  # the DE share pays the CNIC hop
    read_whole = hit * whole.kv_bytes_per_token / whole.cfg.snic_bytes_per_s()
    assert ts < tw - 0.4 * read_whole  # about half the storage read time saved
