"""Per-turn metrics: TPOT from the first token and the decode pace after the second (the paper's TPOT)."""

from __future__ import annotations

import pytest

from dualpath.sim.metrics import Metrics


def test_the_pace_after_the_second_token_leaves_the_hand_off_out_of_tpot():
    m = Metrics()
    # first token at 1.0 s, second 0.2 s later (the hand-off), then 10 more tokens 0.04 s apart
    m.turn(submit=0.0, first=1.0, batch=0.5, ttst=0.2, end=1.0 + 0.2 + 10 * 0.04, gen=12, prompt=100, hit=64)
    m.turn(submit=0.0, first=1.0, batch=0.5, ttst=0.3, end=1.3, gen=2, prompt=100, hit=64)  # no third token: no pace
    assert m.tpot[0] == pytest.approx(0.6 / 11)
    assert m.pace[0] == pytest.approx(0.04)
    assert m.pace[1] == -1.0 and m.tpot[1] == pytest.approx(0.3)
    # a 50 ms bound: counted from the first token, the hand-off fails both turns (54.5 ms, 300 ms);
    # the pace after the second token meets it (40 ms; the second turn has none)
    assert m.slo_attainment(4.0, 0.05) == 0.0
    assert m.slo_attainment(4.0, 0.05, after_second=True) == 1.0
    window = m.window_latency()
    assert window["pace"]["n"] == 1 and window["tpot"]["n"] == 2
