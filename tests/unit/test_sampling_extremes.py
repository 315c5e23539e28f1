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


def test_an_all_greedy_batch_chooses_as_the_row_loop_does():
    """The batched path (every row greedy, unconstrained, no top logprobs) against the row
    loop (the same rows asking for one top logprob): ties to the lowest id, EOS suppressed
    per row, rows all -inf or with a NaN."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        batch, vocab = int(torch.randint(1, 9, (1,), generator=g)), [3, 5, 50, 600][trial % 4]
        logits = torch.randint(-2, 3, (batch, vocab), generator=g).float()  # many ties
        if trial % 7 == 0:
            logits[0] = float("-inf")
        if trial % 11 == 0:
            logits[-1, trial % vocab] = float("nan")
        suppress = (torch.rand(batch, generator=g) < 0.5).tolist()
        eos = set(torch.randint(0, vocab, (trial % 3,), generator=g).tolist())
        fast = sample(logits, [SamplingParams(temperature=0.0)] * batch, [None] * batch, suppress_eos=suppress, eos_ids=eos)
        loop = sample(logits, [SamplingParams(temperature=0.0, top_logprobs=1)] * batch, [None] * batch, suppress_eos=suppress, eos_ids=eos)
        assert [t.token_id for t in fast] == [t.token_id for t in loop], trial
        for f, lp in zip(fast, loop):
            assert f.logprob == lp.logprob or (f.logprob != f.logprob and lp.logprob != lp.logprob), trial
            assert f.top_logprobs == ()
