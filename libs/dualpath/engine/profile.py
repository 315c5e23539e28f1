"""How long a prefill batch takes on this engine: the prediction the compute quota is checked against.

- modeled backend: the target's roofline cost model, ``CostModel.prefill_time`` of the
  batch's ``(cached, new)`` pairs: exactly what ``ModeledDecoder`` then charges (modeled
  seconds, before the testbed's slow motion);
- torch backend: a profile measured at start-up on the engine's own device: a few timed
  forward passes (all layers and the LM head) of single requests over ``(cached, new)``
  sizes, fitted by non-negative least squares to

      t(batch) = fixed + per_token * sum(new_i) + per_pair * sum(pairs_i),
      pairs_i = new_i * (cached_i + new_i)   (the query-key scores attention computes: a causal
                                             mask over the full block, as ``Decoder._attend`` does)

  Non-negative coefficients keep the prediction non-decreasing in every ``new``, which the
  quota packer's binary search relies on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dualpath.engine.decoder import EngineDecoder
from dualpath.policy.intra import Predict

__all__ = ["PROFILE_POINTS", "PrefillProfile", "measure_prefill_profile", "prefill_predictor"]

# (cached, new) of the timed passes: short and long prompts, with and without a cached prefix.
PROFILE_POINTS: tuple[tuple[int, int], ...] = ((0, 16), (0, 128), (0, 512), (512, 128), (1536, 512))


def _pairs(cached: int, new: int) -> int:
    return new * (cached + new)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillProfile:
    """A fitted prefill time model (seconds); ``points`` are the measured ``(cached, new, s)``."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float
    points: tuple[tuple[int, int, float], ...] = ()

    def __call__(self, batch: Sequence[tuple[int, int]]) -> float:
        if not batch:
            return 0.0
        tokens = sum(n for _, n in batch)
        pairs = sum(_pairs(c, n) for c, n in batch)
        return self.fixed_s + self.per_token_s * tokens + self.per_pair_s * pairs

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, float]]) -> PrefillProfile:
        """Non-negative least squares (errors weighted by 1/sqrt(t)) over every subset of the three terms
        (three unknowns: enumerating the 7 subsets is exact and cheap).

        Raises:
            ValueError: fewer than one point, or a non-positive time.
        """
        if not points or any(t <= 0 for _, _, t in points):
            raise ValueError(f"need measured points with positive times, got {list(points)}")
        rows = torch.tensor([[1.0, float(n), float(_pairs(c, n))] for c, n, _ in points], dtype=torch.float64)
        y = torch.tensor([t for _, _, t in points], dtype=torch.float64)
        w = y.rsqrt()  # error weighted by 1/sqrt(t): between relative and absolute; long passes matter most near the quota
        a, b = rows * w[:, None], y * w
        best: tuple[float, list[float]] | None = None
        for k in (1, 2, 3):
            for cols in itertools.combinations(range(3), k):
                sol = torch.linalg.lstsq(a[:, cols], b[:, None]).solution[:, 0]
                if bool((sol < 0).any()):
                    continue
                coef = [0.0, 0.0, 0.0]
                for j, col in enumerate(cols):
                    coef[col] = float(sol[j])
                err = float(((a @ torch.tensor(coef, dtype=torch.float64)) - b).square().sum())
                if best is None or err < best[0]:
                    best = (err, coef)
        assert best is not None  # the fixed term alone is always feasible: times are positive
        fixed, per_token, per_pair = best[1]
        return cls(fixed_s=fixed, per_token_s=per_token, per_pair_s=per_pair, points=tuple(points))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _timed_pass(decoder: EngineDecoder, cached: int, new: int) -> float:
    """Seconds of one prefill pass (embed, every layer, LM head) of ``new`` tokens on ``cached``."""
    device = decoder.device
    ids = torch.arange(new, device=device) % max(1, decoder.config.vocab_size - 1)
    positions = torch.arange(cached, cached + new, device=device)
    spec = decoder.kv_spec
    past = [spec.unpack(torch.zeros((cached, spec.width), dtype=decoder.dtype, device=device)) if cached else None]
    _sync(device)
    t0 = time.perf_counter()
    hidden = decoder.embed(ids)
    for layer in range(decoder.num_layers):
        hidden, _, _ = decoder.forward_layer(layer, hidden, positions, [(0, new)], past)
    decoder.logits(hidden[-1:])
    _sync(device)
    return time.perf_counter() - t0


def _fit_context(points: Sequence[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """``points`` with those longer than the model's context scaled down to fit it."""
    out = []
    for cached, new in points:
        if cached + new > limit:
            f = limit / (cached + new)
            cached, new = int(cached * f), max(1, int(new * f))
        out.append((cached, new))
    return out


def measure_prefill_profile(
    decoder: EngineDecoder,
    points: Sequence[tuple[int, int]] = PROFILE_POINTS,
    *,
    repeats: int = 2,
    reach_s: float = 0.0,
    max_rounds: int = 4,
) -> PrefillProfile:
    """Time ``points`` on ``decoder`` (best of ``repeats``, after one warm-up pass) and fit.

    ``reach_s``: while the longest pass takes less than this (a fast device), time the points
    again at 4x their size (up to ``max_rounds`` rounds, within the model's context) so the
    fit covers batches near the quota rather than extrapolating from launch overheads.
    """
    limit = decoder.config.max_position_embeddings
    todo = _fit_context(points, limit)
    _timed_pass(decoder, *todo[0])  # warm-up: kernels, allocator, caches
    measured: list[tuple[int, int, float]] = []
    for _ in range(max_rounds):
        measured += [(c, n, min(_timed_pass(decoder, c, n) for _ in range(repeats))) for c, n in todo]
        longest = max(c + n for c, n in todo)
        if max(t for _, _, t in measured) >= reach_s or longest >= limit:
            break
        todo = _fit_context([(4 * c, 4 * n) for c, n in todo], limit)
    return PrefillProfile.fit(measured)


def prefill_predictor(decoder: EngineDecoder, quota_s: float) -> tuple[Predict, str]:
    """The batch-time predictor of ``decoder`` and its name: ``cost_model`` (modeled backend)
    or ``profile`` (torch backend, measured now on the decoder's device, with passes reaching
    a quarter of ``quota_s`` where the device is fast enough to need larger ones)."""
    own = decoder.prefill_time_model()
    if own is not None:
        return own, "cost_model"
    return measure_prefill_profile(decoder, reach_s=quota_s / 4), "profile"
