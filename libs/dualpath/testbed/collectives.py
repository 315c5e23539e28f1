"""Modeled model-parallel traffic: the expert-parallel all-to-all of MoE layers on the CNIC.

A MoE layer sends every token's hidden state to the GPUs holding its ``k`` routed experts
(dispatch, FP8: 1 byte per element) and brings the expert outputs back (combine, BF16: 2
bytes), so one token costs ``k * remote * hidden * 3`` bytes each way per MoE layer, where
``remote`` is the share of its experts on GPUs reached through the CNIC: experts on the same
node go over NVLink (``(ep - g) / ep`` when EP spans nodes of ``g`` GPUs, none when it fits
one node), or every other EP rank when ``spread`` asks for the all-to-all to cross the CNIC
(the isolation experiment: the paper's CNIC carries collectives on a high-priority lane).
With balanced routing a GPU receives as much as it sends, so both directions of its CNIC
carry the volume, in the ``MODEL`` traffic class.

``ModelTraffic`` is called from the compute thread: ``start`` queues a layer's all-to-all on
the engine's event loop, the layer computes meanwhile, and ``wait`` returns when the
all-to-all has completed (a layer takes the longer of the two, as with DeepEP's overlap). It
records each all-to-all's completion time on the links' own timeline (queued -> last chunk
sent) and its uncontended time (bytes / rate), whose ratio is the inflation KV traffic causes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import TYPE_CHECKING

from dualpath.cost import CostModel
from dualpath.transfer.nic import DuplexNic, reserve, sleep_until, withdraw
from dualpath.transfer.types import TrafficClass

if TYPE_CHECKING:
    from dualpath.config import EmulationConfig
    from dualpath.testbed.modeled import ModeledDecoder

__all__ = ["ModelTraffic", "alltoall_bytes_per_token_layer", "attach_model_traffic"]

_DISPATCH_BYTES, _COMBINE_BYTES = 1, 2  # FP8 dispatch, BF16 combine (DeepEP)


def alltoall_bytes_per_token_layer(cost: CostModel, *, gpus_per_node: int, spread: bool = False) -> float:
    """Bytes one token sends (and, balanced, receives) through the CNIC per MoE layer (0 for
    a dense model, or an EP group within one node unless ``spread``)."""
    t = cost.target
    if not t.routed_experts or cost.ep <= 1:
        return 0.0
    remote = (cost.ep - 1) / cost.ep if spread else max(0, cost.ep - gpus_per_node) / cost.ep
    return t.experts_per_token * remote * t.hidden * (_DISPATCH_BYTES + _COMBINE_BYTES)


class ModelTraffic:
    """One engine's modeled all-to-all traffic on its CNIC (see the module docstring)."""

    def __init__(
        self,
        nic: DuplexNic,
        loop: asyncio.AbstractEventLoop,
        *,
        bytes_per_token_layer: float,
        moe_layers: frozenset[int] | None = None,
        byte_scale: float = 1.0,
    ) -> None:
        """``bytes_per_token_layer``: the real cluster's volume; divided by ``byte_scale``
        like the KV bytes, so its time on the scaled NIC is the cluster's. ``moe_layers``:
        the layers that send it (None: every layer)."""
        self.nic = nic
        self.loop = loop
        self.per_token = bytes_per_token_layer / byte_scale
        self.moe_layers = moe_layers
        self.count = 0
        self.bytes = 0
        self.actual_s = 0.0  # sum of completion times (issue -> both directions sent)
        self.ideal_s = 0.0  # sum of uncontended times (bytes / rate)

    def start(self, layer: int | None, tokens: int, layers: int = 1) -> concurrent.futures.Future[None] | None:
        """Queue the all-to-all of ``tokens`` through ``layers`` MoE layers (``layer``: the
        layer index, None for a whole decode step); None when there is nothing to send."""
        if layer is not None and self.moe_layers is not None and layer not in self.moe_layers:
            return None
        nbytes = int(tokens * layers * self.per_token)
        if nbytes <= 0:
            return None
        return asyncio.run_coroutine_threadsafe(self._send(nbytes), self.loop)

    @staticmethod
    def wait(handle: concurrent.futures.Future[None] | None) -> None:
        """Block the compute thread until the all-to-all ``start`` queued has completed."""
        if handle is not None:
            handle.result()

    async def _send(self, nbytes: int) -> None:
        t0 = time.monotonic()
        links = (self.nic.tx, self.nic.rx)
        futures = reserve(links, nbytes, TrafficClass.MODEL)
        try:
            end = max([await f for f in futures])
        except BaseException:
            withdraw(links, futures)
            raise
        # Completion on the links' own timeline (queued -> last chunk sent): what the NIC's
        # scheduling costs it, without the host's timer latency that a wall clock would add.
        self.count += 1
        self.bytes += nbytes
        self.actual_s += max(end - t0, 0.0)
        self.ideal_s += nbytes / min(link.rate for link in links)
        await sleep_until(end)

    def stats(self) -> dict[str, float]:
        """What an engine reports: all-to-all count, bytes, completion and uncontended
        seconds, and the CNIC's bytes per class (both directions, every process's)."""
        nic = self.nic
        return {
            "model_xfers": self.count,
            "model_xfer_bytes": self.bytes,
            "model_xfer_s": self.actual_s,
            "model_xfer_ideal_s": self.ideal_s,
            "cnic_model_bytes": nic.rx.bytes_sent(TrafficClass.MODEL) + nic.tx.bytes_sent(TrafficClass.MODEL),
            "cnic_kv_bytes": nic.rx.bytes_sent(TrafficClass.KV) + nic.tx.bytes_sent(TrafficClass.KV),
        }


def attach_model_traffic(decoder: ModeledDecoder, nic: DuplexNic, emu: EmulationConfig) -> ModelTraffic | None:
    """Give a ``ModeledDecoder`` of a MoE target its all-to-all traffic on ``nic`` (from the
    engine's event loop); None when the target sends nothing through the CNIC."""
    cost = decoder.cost
    per_token = alltoall_bytes_per_token_layer(cost, gpus_per_node=emu.gpus_per_node, spread=emu.model_traffic == "on")
    if per_token <= 0:
        return None
    traffic = ModelTraffic(
        nic, asyncio.get_running_loop(), bytes_per_token_layer=per_token, moe_layers=cost.target.moe_layer_ids, byte_scale=emu.byte_scale()
    )
    decoder.traffic = traffic
    return traffic
