"""The sampler at the edges of its parameters (found by fuzzing the gateway): a tiny top_p or
temperature must not make NaN probabilities and kill the engine."""

from __future__ import annotations

import torch

from dualpath.model.sampling import SamplingParams, sample


def test_a_top_p_that_rounds_to_zero_in_float32_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=5e-324)], [gen])
    assert out[0].token_id == 1


def test_a_vanishing_temperature_samples_greedily_instead_of_dividing_into_nan():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    for t in (5e-324, 1e-300, 1e-9):
        out = sample(logits, [SamplingParams(temperature=t)], [torch.Generator().manual_seed(0)])
        assert out[0].token_id == 1
