"""``BatchLayerIO``: the prefill engine's ``LayerIO`` over the data plane.

Per layer, for every item of the batch:

- fetch: the Layer Block runs of its cached tokens ``[0, start)`` are read from their source
  slot (PE buffer on the PE read path, DE buffer on the DE read path or for later chunks) into
  an input window of the engine region, in one batch per source; the window is viewed as
  ``[start, width]`` and split into the model's ``(k, v)`` parts (``KvSpec``, no copy) and moved to the compute device;
- store: the new tokens' KV is copied into an output window and written to the DE buffer slot
  together with, on the PE read path's first chunk, the cached tokens it fetched (PE read
  path: hit + miss; DE read path: miss only).

A split read (``IoItem.de_from >= 0``, first chunk) fetches the cached tokens ``[0, de_from)``
from the PE buffer and ``[de_from, start)`` from the DE slot, and forwards only the former:
every layer's cached KV is complete before the layer computes, whichever side read it.

Windows rotate so that no transfer overwrites bytes still in use: ``run_prefill`` starts
``fetch(l+A)`` (A = ``FETCH_AHEAD``) before computing ``l`` and waits for ``store(l-2)`` before
``store(l)``; a store may still read the input window of its layer (forwarded hits) until
then, hence A + 3 input windows (``fetch(l+A)`` reuses the window of ``l-3``, whose store is
done) and two output ones. Without layer-wise prefill (``layerwise=False``, the ablation's
baseline) every layer has its own input and output window: the whole batch's KV is resident.

Tracing: with ``record=True`` every data-plane batch notes its layer, peer, bytes and epoch
times (two clock reads, no span on the hot path); ``emit_layer_spans`` turns them into one
``kv.fetch`` / ``kv.store`` span per layer per peer region after the batch, when the
compute loop's wait for each layer is known too.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import cast

import torch

from dualpath.engine.dataplane import EngineDataPlane
from dualpath.engine.layout import SlotLayout
from dualpath.engine.prefill import FETCH_AHEAD, PrefillItem
from dualpath.model.config import KvSpec
from dualpath.transfer import RegionDescriptor, TrafficClass, TransferEntry

__all__ = ["BatchLayerIO", "IoItem", "LayerStats"]

_IN_WINDOWS = FETCH_AHEAD + 3  # see the module docstring


@dataclass(frozen=True, slots=True, kw_only=True)
class IoItem:
    item: PrefillItem
    source: RegionDescriptor | None  # where tokens [0, start) are (None when start == 0)
    source_offset: int
    dest: RegionDescriptor  # the DE buffer slot
    dest_offset: int
    write_from: int  # first token to write to dest this chunk (0 on the PE path's first chunk)
    path: str = ""  # the request's read path (pe, de, none): a trace attribute
    de_engine: str = ""  # the request's decode engine: its CNIC serves the DE buffer (emulated NICs)
    de_from: int = -1  # split read: cached tokens [de_from, start) are in the DE slot (dest), not in source

    def fetch_ranges(self) -> list[tuple[RegionDescriptor, int, int, int]]:
        """(region, slot offset, first token, end token) of the cached tokens ``[0, start)``."""
        n = self.item.start
        if not n or self.source is None:
            return []
        if self.de_from < 0 or self.de_from >= n:
            return [(self.source, self.source_offset, 0, n)]
        return [(self.source, self.source_offset, 0, self.de_from), (self.dest, self.dest_offset, self.de_from, n)]

    @property
    def forward_end(self) -> int:
        """End of the cached tokens this chunk forwards to the DE slot (from ``write_from``)."""
        return self.item.start if self.de_from < 0 else max(self.write_from, min(self.item.start, self.de_from))


@dataclass(slots=True)
class LayerStats:
    fetch_bytes: int = 0
    store_bytes: int = 0
    fetch_s: float = 0.0
    store_s: float = 0.0


class BatchLayerIO:
    """Implements ``LayerIO`` for one batch; ``close()`` frees its windows."""

    def __init__(
        self,
        dp: EngineDataPlane,
        layout: SlotLayout,
        items: list[IoItem],
        *,
        dtype: torch.dtype,
        spec: KvSpec,
        device: torch.device,
        owner: str,
        oracle: bool = False,
        record: bool = False,
        layerwise: bool = True,
    ) -> None:
        self.dp, self.layout, self.items = dp, layout, items
        self._n_in = _IN_WINDOWS if layerwise else layout.layers
        self._n_out = 2 if layerwise else layout.layers
        self.oracle = oracle  # testbed upper bound: cached KV appears for free, nothing is sent
        self.dtype, self.spec, self.device = dtype, spec, device
        bpt = layout.bytes_per_token_layer
        self.in_bytes = sum(io.item.start for io in items) * bpt
        self.out_bytes = sum(io.item.end - io.item.start for io in items) * bpt
        self._owner = owner
        self._in, self._out = [], []
        try:
            for i in range(self._n_in):
                self._in.append(dp.pool.alloc(f"{owner}.in{i}", max(self.in_bytes, 1)).offset)
            for i in range(self._n_out):
                self._out.append(dp.pool.alloc(f"{owner}.out{i}", max(self.out_bytes, 1)).offset)
        except BaseException:
            self.close()  # the windows taken so far; the batch fails with the allocation error
            raise
        self.stats = LayerStats()
        self.record = record  # note each transfer for emit_layer_spans
        self._transfers: list[tuple[str, int, RegionDescriptor, int, int, int]] = []  # name, layer, peer, t0_ns, t1_ns, bytes

    def close(self) -> None:
        for i in range(len(self._in)):
            self.dp.pool.free(f"{self._owner}.in{i}")
        for i in range(len(self._out)):
            self.dp.pool.free(f"{self._owner}.out{i}")

    def _view(self, offset: int, tokens: int) -> torch.Tensor:
        bpt = self.layout.bytes_per_token_layer
        flat = self.dp.region.as_tensor(offset, tokens * bpt, self.dtype)
        return flat.view(tokens, self.spec.width)  # [tokens, width]

    def _free_past(self):
        zero = torch.zeros((1, self.spec.width), dtype=self.dtype, device=self.device)
        return [self.spec.unpack(zero.expand(io.item.start, -1)) if io.item.start else None for io in self.items]

    async def fetch(self, layer: int):
        if self.oracle:
            return self._free_past()
        t0 = time.perf_counter()
        base = self._in[layer % self._n_in]
        bpt, bb = self.layout.bytes_per_token_layer, self.layout.block_bytes
        by_source: dict[tuple[str, str], tuple[RegionDescriptor, list[TransferEntry]]] = {}  # (region, DE engine)
        local = base
        places = []
        for io in self.items:
            n = io.item.start
            places.append((local, n))
            for src, src_off, a, b in io.fetch_ranges():
                _, entries = by_source.setdefault((src.region_id, io.de_engine), (src, []))
                for slot_off, tok, cnt, count in self.layout.layer_strided(layer, a, b):
                    entries.append(TransferEntry(local + tok * bpt, src.region_id, src_off + slot_off, cnt * bpt, count, cnt * bpt, bb))
            local += n * bpt
        for (_, de_engine), (desc, entries) in by_source.items():
            t_ns = time.time_ns() if self.record else 0
            n = await self.dp.read(desc, entries, peer_engine=de_engine)
            self.stats.fetch_bytes += n
            if self.record:
                self._transfers.append(("kv.fetch", layer, desc, t_ns, time.time_ns(), n))
        past: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for off, n in places:
            if not n:
                past.append(None)
                continue
            past.append(self.spec.unpack(self._view(off, n).to(self.device, non_blocking=True)))
        self.stats.fetch_s += time.perf_counter() - t0
        return past

    async def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.oracle:
            return
        t0 = time.perf_counter()
        bpt = self.layout.bytes_per_token_layer
        bb = self.layout.block_bytes
        out_base, in_base = self._out[layer % self._n_out], self._in[layer % self._n_in]
        n_new = k.shape[0]
        if n_new:
            self.spec.pack_into(self._view(out_base, n_new), k, v)  # D2H on GPU
        # The placeholder desc is replaced by the item's own before the entry is used.
        by_dest: dict[tuple[str, str], tuple[RegionDescriptor, list[TransferEntry]]] = defaultdict(
            lambda: (cast(RegionDescriptor, None), [])
        )
        new_off, in_off = out_base, in_base
        for io in self.items:
            it = io.item
            desc, entries = by_dest[io.dest.region_id, io.de_engine]
            by_dest[io.dest.region_id, io.de_engine] = (io.dest, entries)
            # cached tokens this chunk must forward (PE read path, first chunk): from the input window
            for slot_off, tok, cnt, count in self.layout.layer_strided(layer, io.write_from, io.forward_end):
                entries.append(
                    TransferEntry(in_off + tok * bpt, io.dest.region_id, io.dest_offset + slot_off, cnt * bpt, count, cnt * bpt, bb)
                )
            for slot_off, tok, cnt, count in self.layout.layer_strided(layer, it.start, it.end):
                entries.append(
                    TransferEntry(
                        new_off + (tok - it.start) * bpt, io.dest.region_id, io.dest_offset + slot_off, cnt * bpt, count, cnt * bpt, bb
                    )
                )
            new_off += (it.end - it.start) * bpt
            in_off += it.start * bpt
        for (_, de_engine), (desc, entries) in by_dest.items():
            t_ns = time.time_ns() if self.record else 0
            n = await self.dp.write(desc, entries, peer_engine=de_engine)
            self.stats.store_bytes += n
            if self.record:
                self._transfers.append(("kv.store", layer, desc, t_ns, time.time_ns(), n))
        self.stats.store_s += time.perf_counter() - t0

    def emit_layer_spans(self, tracer, fetch_wait_s: tuple[float, ...], store_wait_s: tuple[float, ...]) -> int:
        """Spans of the recorded transfers, children of the current span; returns how many.

        Attributes: ``layer``, ``bytes``, ``src`` -> ``dst`` (node ids), ``path`` (the read paths
        of the requests whose KV moved), ``traffic_class``, ``transfer_s`` (the data-plane call)
        and ``wait_s`` (how long the layer loop waited for this layer's fetch or store).
        """
        me = self.dp.node_id
        for name, layer, peer, t0_ns, t1_ns, nbytes in self._transfers:
            fetch = name == "kv.fetch"
            waits = fetch_wait_s if fetch else store_wait_s
            span = tracer.start_span(
                name,
                start_time=t0_ns,
                attributes={
                    "layer": layer,
                    "bytes": nbytes,
                    "src": peer.node_id if fetch else me,
                    "dst": me if fetch else peer.node_id,
                    "region": peer.region_id,
                    "path": self._paths(fetch, peer.region_id),
                    "traffic_class": TrafficClass.KV.name.lower(),
                    "transfer_s": (t1_ns - t0_ns) / 1e9,
                    "wait_s": waits[layer] if layer < len(waits) else 0.0,
                },
            )
            span.end(end_time=t1_ns)
        return len(self._transfers)

    def _paths(self, fetch: bool, region_id: str) -> str:
        """Read paths of the items whose KV a transfer with ``region_id`` carried."""
        if fetch:
            moved = [io for io in self.items if any(r[0].region_id == region_id for r in io.fetch_ranges())]
        else:
            moved = [io for io in self.items if io.dest.region_id == region_id]
        return ",".join(sorted({io.path for io in moved}))
