"""The modeled backend's clock: short modeled steps keep their average rate without spinning
(a spin would steal a core from the other services of a small emulation host)."""

from __future__ import annotations

import time

from dualpath.cost import cost_model
from dualpath.testbed import ModeledDecoder


def test_sub_millisecond_steps_keep_the_modeled_rate_while_the_thread_mostly_sleeps():
    dec = ModeledDecoder(cost_model("ds27b"), role="decode", vocab_size=512, bytes_per_token_layer=4)
    step, steps = 0.0007, 300  # shorter than the old spin threshold (2 ms)
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        dec._sleep(step, time.perf_counter())
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    modeled = step * steps
    # every step's lateness is paid back by the next ones; at most the bounded debt is left over
    assert abs(wall - modeled) < 0.03 + 0.1 * modeled, (wall, modeled)
    assert cpu < 0.5 * wall, (cpu, wall)


def test_a_host_stall_is_paid_back_only_up_to_the_bounded_debt():
    dec = ModeledDecoder(cost_model("ds27b"), role="decode", vocab_size=512, bytes_per_token_layer=4)
    t0 = time.perf_counter()
    time.sleep(0.2)  # the step's work outran its 1 ms by far: a stalled host
    dec._sleep(0.001, t0)
    t1 = time.perf_counter()
    dec._sleep(0.05, t1)  # pays back at most the bound, not the whole stall
    assert time.perf_counter() - t1 > 0.05 - 0.02 - 0.005
