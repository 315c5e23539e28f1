"""The prefill engine's batch-time prediction: the start-up profile of the torch backend and
the cost model of the modeled backend (which must predict exactly what the backend charges)."""

from __future__ import annotations

import time

import pytest
import torch

from dualpath.cost import cost_model
from dualpath.engine.profile import PrefillProfile, measure_prefill_profile, prefill_predictor
from dualpath.model import Decoder, make_tiny_model
from dualpath.testbed import ModeledDecoder


def test_the_fit_recovers_a_known_time_model_with_non_negative_terms():
    truth = PrefillProfile(fixed_s=2e-3, per_token_s=5e-6, per_pair_s=3e-9)
    points = [(c, n, truth([(c, n)])) for c, n in ((0, 16), (0, 128), (0, 512), (512, 128), (1536, 512), (4096, 64))]
    fitted = PrefillProfile.fit(points)
    for c, n, t in points:
        assert fitted([(c, n)]) == pytest.approx(t, rel=1e-6)
    assert fitted.fixed_s == pytest.approx(2e-3, rel=1e-4) and fitted.per_pair_s == pytest.approx(3e-9, rel=1e-4)


def test_a_term_that_would_fit_negative_is_dropped_so_predictions_never_shrink_with_more_tokens():
    points = [(0, 16, 0.010), (0, 128, 0.009), (0, 512, 0.011)]  # noise: flat, slightly decreasing
    fitted = PrefillProfile.fit(points)
    assert min(fitted.fixed_s, fitted.per_token_s, fitted.per_pair_s) >= 0
    assert fitted([(0, 64)]) <= fitted([(0, 65)]) <= fitted([(100, 65)])


def test_the_tiny_model_is_profiled_on_its_device_in_well_under_two_seconds(tmp_path):
    """The profile's cost in this process's CPU seconds (one torch thread): wall time on a
    shared CI host once read 2.04 s for work that takes well under a second here."""
    torch.set_num_threads(1)
    decoder = Decoder.load(make_tiny_model(tmp_path / "m"))
    t0 = time.process_time()
    predict, name = prefill_predictor(decoder, quota_s=0.3)
    cpu_s = time.process_time() - t0
    assert name == "profile" and cpu_s < 2.0, cpu_s
    assert isinstance(predict, PrefillProfile) and len(predict.points) >= 5
    assert predict([(0, 512)]) > predict([(0, 16)]) > 0
    assert predict([(0, 100), (0, 100)]) >= predict([(0, 100)])


def test_a_fast_device_is_profiled_with_larger_passes_until_they_reach_the_target(tmp_path):
    decoder = Decoder.load(make_tiny_model(tmp_path / "m", max_position=8192))
    prof = measure_prefill_profile(decoder, points=((0, 8), (0, 16)), repeats=1, reach_s=10.0, max_rounds=3)
    assert [(c, n) for c, n, _ in prof.points] == [(0, 8), (0, 16), (0, 32), (0, 64), (0, 128), (0, 256)]


@pytest.mark.parametrize("target", ["ds27b", "qwen32b"])
def test_the_modeled_backend_charges_exactly_the_predicted_batch_time(target):
    cost = cost_model(target)
    slowdown = 1e-4  # sleep almost nothing; modeled_s / slowdown is the charged modeled time
    dec = ModeledDecoder(cost, role="prefill", vocab_size=512, bytes_per_token_layer=4, slowdown=slowdown)
    predict, name = prefill_predictor(dec, quota_s=0.3)
    assert name == "cost_model"
    batch = [(4096, 429), (0, 700), (30000, 64)]
    n = sum(new for _, new in batch)
    hidden = dec.embed(torch.arange(n))
    positions = torch.cat([torch.arange(c, c + k) for c, k in batch])
    segments, off = [], 0
    for _, k in batch:
        segments.append((off, k))
        off += k
    past = [(torch.zeros(c, 1, 2), torch.zeros(c, 1, 2)) if c else None for c, _ in batch]
    for layer in range(dec.num_layers):
        hidden, _, _ = dec.forward_layer(layer, hidden, positions, segments, past)
    assert dec.modeled_s / slowdown == pytest.approx(predict(batch), rel=1e-9)
    assert dec.compute_charged_s == pytest.approx(predict(batch), rel=1e-12)  # what prefill.batch reports as charged_s
