"""``run_prefill`` reports, per layer, how long the layer loop waited for each transfer (trace attributes)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dualpath.engine.prefill import PrefillItem, run_prefill

LAYERS = 4


class FakeDecoder:
    device = torch.device("cpu")
    num_layers = LAYERS

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.float().unsqueeze(1)  # [N, 1]

    def forward_layer(self, layer, hidden, positions, segments, past):
        return hidden + 1, hidden.clone(), hidden.clone()

    async def forward_layer_async(self, layer, hidden, positions, segments, past):
        return await asyncio.to_thread(self.forward_layer, layer, hidden, positions, segments, past)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.repeat(1, 3)  # [n, vocab=3]


class SlowIO:
    """Layer 2's fetch and layer 3's store take ``delay`` seconds; everything else is instant."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def fetch(self, layer: int):
        if layer == 2:
            await asyncio.sleep(self.delay)
        return [None]

    async def store(self, layer: int, k, v) -> None:
        if layer == 3:
            await asyncio.sleep(self.delay)


@pytest.mark.anyio
async def test_a_slow_fetch_and_a_slow_last_store_show_up_on_their_own_layers():
    item = PrefillItem(request_id="r", tokens=[1, 2, 3], start=0, end=3)
    result = await run_prefill(
        FakeDecoder(), [item], SlowIO(1.0)
    )  # 1 s: a layer that waits >= 0.6 s, the others < 0.5 (a host stall is not a slow layer)
    assert len(result.fetch_wait_s) == LAYERS and len(result.store_wait_s) == LAYERS
    assert result.fetch_wait_s[2] >= 0.6 and max(result.fetch_wait_s[:2] + result.fetch_wait_s[3:]) < 0.5
    assert result.store_wait_s[3] >= 0.6 and max(result.store_wait_s[:3]) < 0.5
    assert result.wait_s == pytest.approx(sum(result.fetch_wait_s))
    assert result.logits.shape == (1, 3)


class RecordingIO:
    """Records the order of fetches, computes and stores."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def fetch(self, layer: int):
        await asyncio.sleep(0.01)
        self.events.append(f"fetch{layer}")
        return [None]

    async def store(self, layer: int, k, v) -> None:
        self.events.append(f"store{layer}")


class RecordingDecoder(FakeDecoder):
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def forward_layer(self, layer, hidden, positions, segments, past):
        self.events.append(f"compute{layer}")
        return super().forward_layer(layer, hidden, positions, segments, past)


@pytest.mark.anyio
@pytest.mark.parametrize("layerwise", [True, False])
async def test_layerwise_off_loads_every_layer_first_and_sends_after_the_last(layerwise):
    events: list[str] = []
    item = PrefillItem(request_id="r", tokens=[1, 2, 3], start=0, end=3)
    result = await run_prefill(RecordingDecoder(events), [item], RecordingIO(events), layerwise=layerwise)
    first_compute, last_fetch = events.index("compute0"), max(events.index(f"fetch{i}") for i in range(LAYERS))
    first_store = min(events.index(f"store{i}") for i in range(LAYERS))
    last_compute = events.index(f"compute{LAYERS - 1}")
    assert sorted(events) == sorted([f"{e}{i}" for e in ("fetch", "compute", "store") for i in range(LAYERS)])
    if layerwise:  # layer l+1's fetch overlaps compute: compute starts before the last fetch lands
        assert first_compute < last_fetch and first_store < last_compute
    else:
        assert last_fetch < first_compute and last_compute < first_store
    assert result.logits.shape == (1, 3)
