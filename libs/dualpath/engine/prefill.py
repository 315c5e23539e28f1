"""Layer-wise prefill of a batch: bring each layer's cached KV in just before the layer,
compute only the new tokens, send the layer's KV out, with layer ``l+1`` in flight while
layer ``l`` computes.

``run_prefill`` is transport-agnostic: a ``LayerIO`` moves bytes (``fetch`` cached KV of one
layer into local memory and return tensor views of it; ``store`` the layer's KV to the decode
side). Each layer is awaited (``EngineDecoder.forward_layer_async``: the torch decoder computes
in a worker thread, a modeled one sleeps on the loop), so the event loop keeps serving the bus.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dualpath.engine.decoder import EngineDecoder

__all__ = ["FETCH_AHEAD", "LayerIO", "PrefillItem", "PrefillResult", "run_prefill"]

FETCH_AHEAD = 3  # layers whose cached KV may be in flight ahead of the computing layer


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillItem:
    """One request's part of a batch: compute tokens ``[start, end)`` of ``tokens``.

    Tokens ``[0, start)`` are cached: their KV comes from outside (storage hits or earlier
    chunks). ``last`` marks the chunk that ends the prompt (its logits give the first token).
    """

    request_id: str
    tokens: Sequence[int]
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillResult:
    logits: torch.Tensor  # [n_last, vocab] float32, one row per item with ``last`` (in batch order)
    compute_s: float
    wait_s: float  # time the compute thread waited for cached KV to arrive
    # Per layer, how long the layer loop stood still for that layer's transfer: its fetch
    # (cached KV not there yet) and its store (the output window still in flight, or the
    # batch's last stores); what layer-wise overlap failed to hide. Trace attributes.
    fetch_wait_s: tuple[float, ...] = ()
    store_wait_s: tuple[float, ...] = ()


class LayerIO(Protocol):
    async def fetch(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Cached KV of ``layer`` per item (``(k, v)`` shaped as the model's ``KvSpec`` says, ``start`` tokens) or None."""

    async def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Send the layer's KV of the batch's new tokens (``k [N, *k_shape]``, ``v [N, *v_shape]``)."""


async def run_prefill(decoder: EngineDecoder, items: Sequence[PrefillItem], io: LayerIO, *, layerwise: bool = True) -> PrefillResult:
    """Prefill ``items`` together through all layers; see the module docstring.

    ``layerwise=False`` is the ablation baseline: every layer's cached KV is loaded before the
    first layer computes, and the KV goes out after the last one (no overlap; the whole
    context's KV resident at once).

    Raises whatever ``io`` raises (a lost peer fails the batch; the caller reports it).
    """
    loop = asyncio.get_running_loop()
    ids = [t for it in items for t in it.tokens[it.start : it.end]]
    positions = [p for it in items for p in range(it.start, it.end)]
    segments, off = [], 0
    for it in items:
        segments.append((off, it.end - it.start))
        off += it.end - it.start
    device = decoder.device
    token_t = torch.tensor(ids, dtype=torch.long, device=device)
    pos_t = torch.tensor(positions, dtype=torch.long, device=device)
    hidden = await asyncio.to_thread(decoder.embed, token_t)

    compute_s = wait_s = 0.0
    fetch_wait = [0.0] * decoder.num_layers
    store_wait = [0.0] * decoder.num_layers
    stores: list[asyncio.Task] = []
    deferred: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    n_layers = decoder.num_layers
    # Up to FETCH_AHEAD layers' cached KV in flight while a layer computes: on a link whose
    # round trip exceeds one layer's compute (TCP, a busy host) one layer ahead is not enough.
    ahead = FETCH_AHEAD if layerwise else n_layers
    pending = deque(asyncio.ensure_future(io.fetch(j)) for j in range(min(ahead, n_layers)))
    try:
        if not layerwise:
            t0 = loop.time()
            await asyncio.gather(*pending)
            fetch_wait[0] = loop.time() - t0
            wait_s += fetch_wait[0]
        for layer in range(n_layers):
            t0 = loop.time()
            past = await pending.popleft()
            dt = loop.time() - t0
            fetch_wait[layer] += dt
            wait_s += dt
            if layer + ahead < n_layers:
                pending.append(asyncio.ensure_future(io.fetch(layer + ahead)))
            t1 = loop.time()
            hidden, k, v = await decoder.forward_layer_async(layer, hidden, pos_t, segments, past)
            compute_s += loop.time() - t1
            if not layerwise:
                deferred.append((layer, k, v))
                continue
            if len(stores) >= 2:  # double-buffered output: layer l-2's send must be done
                t2 = loop.time()
                await stores[-2]
                store_wait[layer - 2] = loop.time() - t2
            stores.append(asyncio.ensure_future(io.store(layer, k, v)))
        stores.extend(asyncio.ensure_future(io.store(layer, k, v)) for layer, k, v in deferred)
        t_tail = loop.time()
        awaited = 2 if layerwise else len(stores)
        for layer in range(max(0, len(stores) - awaited), len(stores)):  # the stores not awaited above
            await stores[layer]
            store_wait[layer] = loop.time() - t_tail
    except BaseException:
        for task in (*stores, *pending):
            task.cancel()
        await asyncio.gather(*stores, *pending, return_exceptions=True)
        raise
    last_rows = [s + n - 1 for (s, n), it in zip(segments, items) if it.last]
    logits = await asyncio.to_thread(decoder.logits, hidden[last_rows]) if last_rows else torch.empty(0)
    return PrefillResult(logits=logits, compute_s=compute_s, wait_s=wait_s, fetch_wait_s=tuple(fetch_wait), store_wait_s=tuple(store_wait))
