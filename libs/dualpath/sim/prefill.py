"""A prefill engine in virtual time: the engine core packs batches, the simulator times them.

``dualpath.core.prefill_batcher.PrefillBatcher`` (the service's own core) decides every
batch: FIFO under the compute quota, the request that would exceed it cut to a block-aligned
chunk. The simulator only times what the core chose:

- compute: ``CostModel.prefill_time`` of the batch's ``(cached, new)`` pairs (C seconds over
  L layers);
- loads: a chunk whose request has not loaded its hit KV yet brings it in — PE read path:
  the engine's own node buffer to its HBM (its CNIC in); DE read path: the decode node's
  buffer to this GPU over the compute network (the DE's CNIC out, this CNIC in);
- stores: the KV the decode side needs, written after each layer — PE read path: hit and new
  tokens; DE read path: only the new ones (this CNIC out, the DE's CNIC in).

With ``collective_share`` > 0 the batch also puts high-priority traffic (the model's
collectives) on this GPU's CNIC, in both directions: ``share x capacity x C`` bytes, which the
KV flows yield to (the paper's CNIC QoS, §5).

Layer-wise prefill overlaps them: layer l computes once its load is in, so the batch ends at
``max(t0 + C, last load + C/L, last store)`` — per layer ``max(load, compute)`` with the
pipeline's first/last layer exposed. Without layer-wise prefill (the ablation's first step)
every load precedes compute and every store follows it: ``loads + C + stores``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dualpath.core.prefill_batcher import PrefillBatch, PrefillBatcher
from dualpath.policy import ReadSide
from dualpath.sim.network import HIGH, Link
from dualpath.sim.request import SimRequest
from dualpath.sim.series import Series

if TYPE_CHECKING:
    from dualpath.sim.simulation import Simulation

__all__ = ["PrefillEngineSim"]


def _ignore(_: object) -> None:
    pass


class _Batch:
    __slots__ = ("batch", "compute_s", "pending", "stores")

    def __init__(self, batch: PrefillBatch, compute_s: float) -> None:
        self.batch = batch
        self.compute_s = compute_s
        self.pending = 0
        self.stores: list[tuple[tuple[Link, ...], float]] = []


class PrefillEngineSim:
    """One prefill GPU: its batcher core, its CNIC links and the batch in flight."""

    __slots__ = ("attention", "batcher", "busy", "busy_s", "cnic_in", "cnic_out", "engine_id", "name", "node_id", "reqs", "sim")

    def __init__(self, sim: Simulation, engine_id: int, name: str, node_id: int, cnic_in: Link, cnic_out: Link) -> None:
        self.sim = sim
        self.engine_id, self.name, self.node_id = engine_id, name, node_id
        self.cnic_in, self.cnic_out = cnic_in, cnic_out
        cfg = sim.cfg
        self.batcher = PrefillBatcher(sim.predict, quota_s=cfg.quota_s, block_tokens=cfg.block_tokens)
        self.reqs: dict[str, SimRequest] = {}
        self.busy = False
        self.busy_s = 0.0
        self.attention = Series()  # predicted attention seconds over time (load balance, §7)

    def add(self, req: SimRequest) -> None:
        """The request's hit KV is ready (read, or nothing to read): queue it."""
        self.reqs[req.key] = req
        self.batcher.add(req.key, cached=req.hit, total=req.prompt)
        if not self.busy:
            self._next()

    def _next(self) -> None:
        batch = self.batcher.next_batch()
        if batch is None:
            self.busy = False
            return
        self.busy = True
        sim = self.sim
        now, kvb, oracle = sim.loop.now, sim.kv_bytes_per_token, sim.oracle
        compute = sim.cost.prefill_time(batch.pairs())
        self.busy_s += compute
        self.attention.add(now, now + compute, batch.predicted_s)
        b = _Batch(batch, compute)
        # A batch's transfers between the same two endpoints are one flow, as the data plane
        # posts them as one work-request list (doorbell batching); the batch waits for the last.
        loads: dict[tuple[Link, ...], float] = {}
        stores: dict[tuple[Link, ...], float] = {}
        for it in batch.items:
            req = self.reqs[it.request_id]
            if req.t_batch < 0:
                req.t_batch = now
            first = not req.loaded
            req.loaded = True
            if oracle:
                continue
            de = req.de
            pe_path = req.read_side != ReadSide.DE
            own = req.hit - req.split_de  # hits in this node's buffer (PE read path; a split read's PE share)
            if first and req.hit:
                links: tuple[Link, ...] = (self.cnic_in,) if pe_path else (de.cnic_out, self.cnic_in)
                loads[links] = loads.get(links, 0.0) + (own if pe_path else req.hit) * kvb
                if pe_path and req.split_de:  # the DE share comes over the decode GPU's CNIC
                    links = (de.cnic_out, self.cnic_in)
                    loads[links] = loads.get(links, 0.0) + req.split_de * kvb
            store = it.new + (own if first and pe_path else 0)
            links = (self.cnic_out, de.cnic_in)
            stores[links] = stores.get(links, 0.0) + store * kvb
        b.stores = list(stores.items())
        net = sim.net
        share = sim.cfg.collective_share
        if share > 0:  # model collectives (EP all-to-all) on this GPU's CNIC, high priority, not waited for
            nbytes = share * self.cnic_in.capacity * compute
            net.start((self.cnic_in,), nbytes, _ignore, None, cls=HIGH)
            net.start((self.cnic_out,), nbytes, _ignore, None, cls=HIGH)
        if sim.layerwise:
            b.pending = 1 + len(loads) + len(b.stores)
            sim.loop.at(now + compute, self._part, b)
            for links, nbytes in loads.items():
                net.start(links, nbytes, self._load_done, b)
            for links, nbytes in b.stores:
                net.start(links, nbytes, self._part, b)
        elif loads:
            b.pending = len(loads)
            for links, nbytes in loads.items():
                net.start(links, nbytes, self._nolw_loaded, b)
        else:
            b.pending = 1
            sim.loop.at(now + compute, self._nolw_computed, b)

    # -- layer-wise: one part per compute, load and store; the batch ends with the last ----
    def _load_done(self, b: _Batch) -> None:
        self.sim.loop.at(self.sim.loop.now + b.compute_s / self.sim.layers, self._part, b)

    def _part(self, b: _Batch) -> None:
        b.pending -= 1
        if b.pending == 0:
            self._finish(b)

    # -- without layer-wise: loads, then compute, then stores ----------------------------
    def _nolw_loaded(self, b: _Batch) -> None:
        b.pending -= 1
        if b.pending == 0:
            b.pending = 1
            self.sim.loop.at(self.sim.loop.now + b.compute_s, self._nolw_computed, b)

    def _nolw_computed(self, b: _Batch) -> None:
        if not b.stores:
            self._finish(b)
            return
        b.pending = len(b.stores)
        for links, nbytes in b.stores:
            self.sim.net.start(links, nbytes, self._part, b)

    def _finish(self, b: _Batch) -> None:
        sim = self.sim
        for key in self.batcher.finish_batch():
            sim.prefill_done(self.reqs.pop(key))
        self._next()
