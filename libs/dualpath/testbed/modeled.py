"""``ModeledDecoder``: the decoder interface with no math — each call takes the cost model's time.

The engines call ``embed``/``forward_layer``/``logits`` exactly as with the torch decoder, so
batching, layer-wise transfers and KV bookkeeping are the real code. Here a prefill layer
sleeps ``CostModel.prefill_layer_time`` of the batch's ``(cached, new)`` pairs (the last layer
also the LM head's ``prefill_head_time``), so a whole batch takes ``CostModel.prefill_time``:
what the prefill engine's quota packer predicts. A decode step sleeps ``decode_step_time``
of the batch's context lengths (spread over its layers).
KV is ``uint8`` with ``bytes_per_token_layer`` scaled bytes (``[N, 2, 1, bpt/2]``), filled
with a token-derived pattern so transfers are real bytes. Sampling produces printable ASCII.

``slowdown`` (testbed slow motion) multiplies every modeled time.

``forward_layer_async`` / ``decode_step_async`` are the same calls awaited on the engine's event
loop (what the engines await, ``engine.decoder.EngineDecoder``): the modeled time is an
``asyncio.sleep``, so a layer or step costs no worker-thread hand-off (two wake-ups that a busy
host delays).

``overhead_s`` accumulates how much longer each call took than its modeled time: the
emulation's own cost (Python, scheduling), reported by the testbed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from dualpath.cost import CostModel
from dualpath.model.config import KvSpec
from dualpath.policy.intra import Predict

if TYPE_CHECKING:
    from dualpath.testbed.collectives import ModelTraffic

__all__ = ["HostPerStep", "ModeledDecoder", "fit_host_per_step"]

_MAX_DEBT_S = 0.02  # host seconds of lateness a decoder pays back at most (see ``_sleep``)
_MAX_LATE_S = 0.002  # the earliest a sleep aims before its deadline
_LATE_GAIN = 0.1  # weight of the newest sample in the running mean of time.sleep's lateness


class HostPerStep:
    """A decode engine's host time per step beyond the modeled GPU time, against batch size.

    The testbed attaches it to a decode engine as its ``StepObserver`` (``engine.decoder``):
    the engine loop calls ``started`` as a step begins and ``ran`` when the step and its result
    processing are done (``ran`` with the batch size) and ``idle`` when it waits for work; each
    call reads the decoder's ``modeled_s`` then (``modeled``). For two back-to-back steps, the first one's host time is
    the time from its start to the next one's start minus its modeled seconds: sampling,
    streaming, admission, persistence and late wake-ups of a loaded host, the part of a step
    period the modeled GPU does not account for. ``stats`` gives the sums of a least-squares
    line ``host = fixed + per_request * batch`` (``fit_host_per_step``), so that reports of
    several engines add up; the simulator's ``decode_host_s`` / ``decode_host_per_request_s``
    take its result (``dualpath sim validate``).
    """

    __slots__ = ("_m", "_modeled", "_open", "_t", "n", "sb", "sbb", "sbh", "sh")

    def __init__(self, modeled: Callable[[], float]) -> None:
        """``modeled``: the decoder's cumulative modeled seconds now (``ModeledDecoder.modeled_s``)."""
        self._modeled = modeled
        self.n = 0
        self.sb = self.sbb = self.sh = self.sbh = 0.0
        self._t = self._m = 0.0  # the current step's start and the decoder's modeled_s then
        self._open: tuple[float, int, float] | None = None  # (start, batch, modeled seconds) of the step before

    def started(self, t: float) -> None:
        modeled_s = self._modeled()
        if self._open is not None:
            t0, batch, modeled = self._open
            host = t - t0 - modeled
            self.n += 1
            self.sb += batch
            self.sbb += batch * batch
            self.sh += host
            self.sbh += batch * host
            self._open = None
        self._t, self._m = t, modeled_s

    def ran(self, batch: int) -> None:
        self._open = (self._t, batch, self._modeled() - self._m)

    def idle(self) -> None:
        self._open = None

    def stats(self) -> dict[str, float]:
        return {"host_steps": self.n, "host_sb": self.sb, "host_sbb": self.sbb, "host_sh": self.sh, "host_sbh": self.sbh}


def fit_host_per_step(stats: Sequence[dict], scale: float = 1.0) -> dict[str, float] | None:
    """The line ``host = fixed_s + per_request_s * batch`` through the steps that ``stats``
    (``HostPerStep.stats`` of one or more engines) summed, in seconds divided by ``scale``
    (the testbed's slowdown: modeled seconds), with the steps' count and mean; None without
    steps. Both coefficients stay non-negative: where the best line has a negative one, the
    other alone is fitted."""
    n = sum(s.get("host_steps", 0) for s in stats)
    if not n:
        return None
    sb, sbb, sh, sbh = (sum(s.get(k, 0.0) for s in stats) for k in ("host_sb", "host_sbb", "host_sh", "host_sbh"))
    det = n * sbb - sb * sb
    fixed, per = sh / n, 0.0
    if det > 1e-9 * n * sbb:
        per = (n * sbh - sb * sh) / det
        fixed = (sh - per * sb) / n
        if per < 0:
            fixed, per = sh / n, 0.0
        elif fixed < 0:
            fixed, per = 0.0, (sbh / sbb if sbb else 0.0)
    return {
        "steps": n,
        "mean_s": sh / n / scale,
        "fixed_s": max(0.0, fixed) / scale,
        "per_request_s": max(0.0, per) / scale,
        "mean_batch": sb / n,
    }


class _ModeledConfig:
    """The slice of ``ModelConfig`` the engines read."""

    def __init__(self, vocab_size: int, bytes_per_token_layer: int, max_position: int) -> None:
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position
        self._bpt = bytes_per_token_layer

    def kv_bytes_per_token_layer(self, dtype: torch.dtype) -> int:
        return self._bpt


class ModeledDecoder:
    """The ``EngineDecoder`` of the testbed (see the module docstring)."""

    def __init__(
        self, cost: CostModel, *, role: str, vocab_size: int, bytes_per_token_layer: int, max_position: int = 1 << 20, slowdown: float = 1.0
    ) -> None:
        self.cost = cost
        self.slowdown = slowdown
        self.role = role
        self.device = torch.device("cpu")
        self.dtype = torch.uint8
        self.num_layers = cost.target.layers
        # Bytes stand for the target's KV: the two parts fill bytes_per_token_layer exactly.
        half = bytes_per_token_layer // 2
        self.kv_spec = KvSpec("modeled", (1, half), (1, bytes_per_token_layer - half))
        self.config = _ModeledConfig(vocab_size, bytes_per_token_layer, max_position)
        self.modeled_s = 0.0  # time the cost model asked for (times slowdown: host seconds)
        self.busy_s = 0.0  # time the calls actually took
        self.attention_s = 0.0  # modeled attention time (load-balance figure)
        self.compute_charged_s = 0.0  # cost-model compute seconds charged (no slow motion, no communication waits)
        self.traffic: ModelTraffic | None = None  # testbed.collectives.ModelTraffic of a MoE target (set by attach_model_traffic)
        self._debt = 0.0  # host seconds the modeled schedule is behind (paid back by the next sleeps)
        self._late = 0.0  # running mean of how late time.sleep wakes (slept that much earlier)

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.busy_s - self.modeled_s)

    def _sleep(self, seconds: float, t0: float) -> float:
        """Sleep until ``t0 + seconds * slowdown``; returns the host seconds asked for.

        Never spins (a spin steals a core from the other services of a small host): it sleeps
        to just before the deadline, by the sleep's usual lateness (a running mean), and
        carries what it still missed (lateness, or work that outran the step) as a debt that the
        next calls' deadlines pay back; so single steps jitter by a sleep's granularity but the
        modeled GPU's average rate is exact. The debt is bounded (``_MAX_DEBT_S``): a host stall
        of seconds is not paid back as a burst of zero-time steps.
        """
        seconds, deadline, left = self._plan(seconds, t0)
        if left > 0:
            time.sleep(left)
        self._woke(deadline, left)
        return seconds

    async def _sleep_async(self, seconds: float, t0: float) -> float:
        """``_sleep`` on the event loop (``asyncio.sleep``): no worker thread to hand off to."""
        seconds, deadline, left = self._plan(seconds, t0)
        if left > 0:
            await asyncio.sleep(left)
        self._woke(deadline, left)
        return seconds

    def _plan(self, seconds: float, t0: float) -> tuple[float, float, float]:
        """(host seconds, the modeled deadline, how long to sleep now)."""
        seconds *= self.slowdown
        deadline = t0 + seconds
        return seconds, deadline, deadline - self._debt - self._late - time.perf_counter()

    def _woke(self, deadline: float, left: float) -> None:
        """Update the sleep's mean lateness and the debt after a sleep of ``left`` (if positive)."""
        woke = time.perf_counter()
        if left > 0:
            lateness = woke - (deadline - self._debt - self._late)
            self._late = min(_MAX_LATE_S, max(0.0, self._late + _LATE_GAIN * (lateness - self._late)))
        self._debt = min(_MAX_DEBT_S, max(-_MAX_DEBT_S, self._debt + woke - deadline))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return token_ids.to(torch.float32).unsqueeze(1)  # [N, 1]: the token id rides along

    def forward_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        past: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
    ):
        t0 = time.perf_counter()
        seconds, comm, out = self._layer(layer, hidden, positions, segments, past)
        self.modeled_s += self._sleep(seconds, t0)
        self.modeled_s += self._wait_comm(comm)
        self.busy_s += time.perf_counter() - t0
        return out

    async def forward_layer_async(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        past: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
    ):
        """``forward_layer`` awaited on the engine's event loop (the modeled time is an
        ``asyncio.sleep``): no worker-thread hand-off per layer, the emulation's main per-layer
        host cost. With model traffic attached (its wait blocks) it runs in a worker thread."""
        if self.traffic is not None:
            return await asyncio.to_thread(self.forward_layer, layer, hidden, positions, segments, past)
        t0 = time.perf_counter()
        seconds, _, out = self._layer(layer, hidden, positions, segments, past)
        self.modeled_s += await self._sleep_async(seconds, t0)
        self.busy_s += time.perf_counter() - t0
        return out

    def _layer(self, layer, hidden, positions, segments, past):
        """A layer's modeled seconds, its all-to-all (started) and its outputs (hidden, k, v)."""
        cached = [0 if p is None else p[0].shape[0] for p in past]
        if self.role == "decode":
            seconds = self.cost.decode_step_time([c + 1 for c in cached]) / self.num_layers
        else:
            batch = [(c, n) for c, (_, n) in zip(cached, segments)]
            seconds = self.cost.prefill_layer_time(batch, layer=layer)
            if layer == 0:
                self.attention_s += self.cost.attention_time(batch)
            if layer == self.num_layers - 1:  # the LM head rides on the last layer: a batch costs prefill_time
                seconds += self.cost.prefill_head_time(batch)
        n = hidden.shape[0]
        comm = self.traffic.start(layer, n) if self.traffic is not None else None  # MoE all-to-all, overlapped
        pattern = (positions.to(torch.int64) * 31 + layer) % 251  # [N]
        k, v = self.kv_spec.unpack(pattern.to(torch.uint8).view(n, 1).expand(n, self.kv_spec.width).contiguous())
        self.compute_charged_s += seconds
        return seconds, comm, (hidden, k, v)

    def decode_step(self, kvs: Sequence[torch.Tensor], kv_lens: Sequence[int], inputs: Sequence[int]) -> torch.Tensor:
        """One decode step of the whole batch in one call: the modeled time of its context
        lengths (``kv_lens[i] + 1``), then the logits. The KV buffers are left as they are
        (their content is irrelevant here)."""
        t0 = time.perf_counter()
        seconds = self.cost.decode_step_time([n + 1 for n in kv_lens])
        comm = self.traffic.start(None, len(kv_lens), self.cost.target.moe_layers) if self.traffic is not None else None
        logits = self.logits(torch.tensor(inputs, dtype=torch.float32).unsqueeze(1))
        self.modeled_s += self._sleep(seconds, t0)
        self.modeled_s += self._wait_comm(comm)
        self.busy_s += time.perf_counter() - t0
        return logits

    async def decode_step_async(self, kvs: Sequence[torch.Tensor], kv_lens: Sequence[int], inputs: Sequence[int]) -> torch.Tensor:
        """``decode_step`` awaited on the engine's event loop (see ``forward_layer_async``)."""
        if self.traffic is not None:
            return await asyncio.to_thread(self.decode_step, kvs, kv_lens, inputs)
        t0 = time.perf_counter()
        seconds = self.cost.decode_step_time([n + 1 for n in kv_lens])
        logits = self.logits(torch.tensor(inputs, dtype=torch.float32).unsqueeze(1))
        self.modeled_s += await self._sleep_async(seconds, t0)
        self.busy_s += time.perf_counter() - t0
        return logits

    def _wait_comm(self, comm) -> float:
        """Wait for an all-to-all still in flight after the compute (modeled time, not overhead)."""
        if comm is None:
            return 0.0
        t0 = time.perf_counter()
        cast("ModelTraffic", self.traffic).wait(comm)  # comm is only set when traffic is
        return time.perf_counter() - t0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A peaked distribution over printable letters, varying with the input token."""
        m = hidden.shape[0]
        out = torch.zeros((m, self.config.vocab_size), dtype=torch.float32)
        ids = (hidden[:, 0].to(torch.int64) * 7 + 3) % 26 + ord("a")
        out[torch.arange(m), ids] = 20.0
        return out

    def prefill_time_model(self) -> Predict:
        """The cost model's ``prefill_time``: exactly what ``forward_layer`` charges a batch."""
        return self.cost.prefill_time

    def stats(self) -> dict[str, float]:
        """Modeled seconds (a prefill engine's also its modeled attention time) and the model
        traffic's figures, for the engine's report."""
        out = {"modeled_s": self.modeled_s}
        if self.role != "decode":
            out["attention_s"] = self.attention_s
        if self.traffic is not None:
            out.update(self.traffic.stats())
        return out
