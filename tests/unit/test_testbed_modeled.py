"""The modeled backend's clock: short modeled steps keep their average rate without spinning
(a spin would steal a core from the other services of a small emulation host)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from dualpath.cost import cost_model
from dualpath.testbed import HostPerStep, ModeledDecoder, fit_host_per_step


def test_sub_millisecond_steps_keep_the_modeled_rate_while_the_thread_mostly_sleeps():
    """Within 10% on one of three tries: a shared host that stalls the thread for longer than
    the bounded debt in a try loses that time for good (by design); a clock that is always late
    or always spins misses every try."""
    step, steps = 0.0007, 300  # sub-millisecond steps: kept on rate by sleeping and paying back lateness, never by spinning
    modeled = step * steps
    tries = []
    for _ in range(3):
        dec = ModeledDecoder(cost_model("ds27b"), role="decode", vocab_size=512, bytes_per_token_layer=4)
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            dec._sleep(step, time.perf_counter())
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        assert wall >= modeled - 0.03, (wall, modeled)  # never faster than modeled
        tries.append((wall, cpu))
        # every step's lateness is paid back by the next ones; at most the bounded debt is left over
        if abs(wall - modeled) < 0.03 + 0.1 * modeled and cpu < 0.5 * wall:
            return
    raise AssertionError(f"three tries missed {modeled:.3f} s modeled (wall, cpu): {tries}")


def test_a_host_stall_is_paid_back_only_up_to_the_bounded_debt():
    dec = ModeledDecoder(cost_model("ds27b"), role="decode", vocab_size=512, bytes_per_token_layer=4)
    t0 = time.perf_counter()
    time.sleep(0.2)  # the step's work outran its 1 ms by far: a stalled host
    dec._sleep(0.001, t0)
    t1 = time.perf_counter()
    dec._sleep(0.05, t1)  # pays back at most the bound, not the whole stall
    assert time.perf_counter() - t1 > 0.05 - 0.02 - 0.005


def _batch(dec):
    batch = [(4096, 429), (0, 700)]
    n = sum(new for _, new in batch)
    hidden = dec.embed(torch.arange(n))
    positions = torch.cat([torch.arange(c, c + k) for c, k in batch])
    segments = [(0, 429), (429, 700)]
    past = [(torch.zeros(c, 1, 2), torch.zeros(c, 1, 2)) if c else None for c, _ in batch]
    return batch, hidden, positions, segments, past


def test_the_awaited_layer_charges_the_same_time_and_gives_the_same_kv_as_the_threaded_one():
    slowdown = 1e-4
    sync, awaited = (
        ModeledDecoder(cost_model("ds27b"), role="prefill", vocab_size=512, bytes_per_token_layer=4, slowdown=slowdown) for _ in range(2)
    )
    batch, hidden, positions, segments, past = _batch(sync)

    async def run_awaited():
        outs = []
        for layer in range(awaited.num_layers):
            outs.append(await awaited.forward_layer_async(layer, hidden, positions, segments, past))
        return outs

    outs = asyncio.run(run_awaited())
    for layer, (_, k, v) in enumerate(outs):
        _, k0, v0 = sync.forward_layer(layer, hidden, positions, segments, past)
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert awaited.modeled_s == pytest.approx(sync.modeled_s, rel=1e-12)
    assert awaited.modeled_s / slowdown == pytest.approx(cost_model("ds27b").prefill_time(batch), rel=1e-9)


def test_an_awaited_decode_step_keeps_the_event_loop_free_while_it_lasts():
    dec = ModeledDecoder(cost_model("ds27b"), role="decode", vocab_size=512, bytes_per_token_layer=4, slowdown=20.0)
    ticks = []

    async def main():
        async def tick():
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(tick())
        t0 = time.perf_counter()
        logits = await dec.decode_step_async([torch.empty(0)] * 8, [31999] * 8, list(range(8)))  # context 32000 each
        elapsed = time.perf_counter() - t0
        ticker.cancel()
        return logits, elapsed

    logits, elapsed = asyncio.run(main())
    assert logits.shape == (8, 512)
    assert elapsed >= 0.8 * dec.modeled_s  # the step took its modeled (slowed) time ...
    assert len(ticks) >= 3  # ... during which the loop ran other tasks


def test_host_time_per_step_is_the_period_beyond_the_modeled_time_fitted_against_batch_size():
    """Back-to-back steps of batch b and host time 1 ms + 0.2 ms * b (period = modeled + host)
    give that line back, in modeled seconds (divided by the slowdown); a step followed by an
    idle wait counts for nothing; two engines' sums add up."""
    engines = []
    for batches in ([1, 4, 9, 2, 7], [3, 3, 8, 5]):
        total = [3.0]  # the decoder's cumulative modeled_s
        h, t = HostPerStep(lambda: total[0]), 100.0  # noqa: B023 - read during this iteration only
        for b in batches:
            h.started(t)
            modeled = 0.01 * b
            total[0] += modeled
            h.ran(b)
            t += modeled + 0.001 + 0.0002 * b
        h.idle()  # the engine waits: the last step's period is not a host time
        h.started(t + 5.0)
        total[0] += 0.01
        h.ran(1)
        engines.append(h.stats())
    assert [e["host_steps"] for e in engines] == [4, 3]
    fit = fit_host_per_step(engines, scale=4.0)
    assert fit["steps"] == 7
    assert fit["fixed_s"] == pytest.approx(0.001 / 4) and fit["per_request_s"] == pytest.approx(0.0002 / 4)
    assert fit_host_per_step([]) is None and fit_host_per_step([HostPerStep(lambda: 0.0).stats()]) is None


def test_a_host_time_falling_with_batch_size_fits_a_constant_not_a_negative_slope():
    h, t = HostPerStep(lambda: 0.0), 0.0
    for b in (1, 2, 3, 4, 5, 6):
        h.started(t)
        h.ran(b)
        t += 0.002 - 0.0002 * b
    h.started(t)
    fit = fit_host_per_step([h.stats()])
    assert fit["per_request_s"] == 0.0 and fit["fixed_s"] == pytest.approx(fit["mean_s"])


def test_the_testbed_attaches_host_time_per_step_to_a_decode_engine_and_the_decoder_reports_its_modeled_time():
    """The observer reads the decoder's modeled seconds itself: a step of 10 ms modeled and
    12 ms wall, followed back to back by the next, has 2 ms of host time."""
    from dualpath.config import EmulationConfig
    from dualpath.engine.common import _modeled

    emu = EmulationConfig(compute="modeled", target="ds27b")
    prefill_decoder, none = _modeled(emu, "prefill", 512)
    assert none is None and set(prefill_decoder.stats()) == {"modeled_s", "attention_s"}
    decoder, observer = _modeled(emu, "decode", 512)
    assert isinstance(observer, HostPerStep) and set(decoder.stats()) == {"modeled_s"}
    observer.started(1.0)
    decoder.modeled_s += 0.010
    observer.ran(4)
    observer.started(1.012)
    stats = observer.stats()
    assert stats["host_steps"] == 1 and stats["host_sb"] == 4 and stats["host_sh"] == pytest.approx(0.002)
