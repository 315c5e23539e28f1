"""``HardwareProfile``: the emulated cluster's node, NIC and memory figures, in one place.

Defaults follow the paper's testbed (PAPER.md "Evaluation setup"): 8 Hopper GPUs per node,
one 400 Gbps compute NIC (CNIC) per GPU, one 400 Gbps storage NIC (SNIC) per node, 80 GB of
node DRAM buffer (and, for agent-aware prefetch, a cache of ``PREFETCH_CACHE_GB`` beside it).
``scale`` divides bytes and bandwidths together, so transfer *times* are preserved while the
machine running the emulation moves ``1/scale`` of the bytes.

``slowdown`` runs the whole emulated cluster in slow motion: modeled compute times are
multiplied by it and every NIC rate divided by it, so each emulated second lasts ``slowdown``
host seconds while the host's own per-request cost (Python, the bus, syscalls) stays the same
— its share of the run shrinks by that factor. Reported times are divided back.

Every GPU's compute NIC is full duplex (``cnic``: separate rx and tx links of the CNIC rate) and
shared across the host's processes under ``cnic_prefix(namespace)``, so a transfer is charged at
both of its ends whichever process starts it; each node's SNIC is two links too (reads into the
buffer, writes to storage).

When a node runs fewer engine processes than it has GPUs (``engines_per_node < gpus_per_node``,
to fit a laptop), the node's SNIC is shrunk in the same proportion so that storage bandwidth
per engine — the ratio that makes a workload I/O-bound — stays the cluster's.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.node.prefetch import PREFETCH_CACHE_GB

__all__ = ["HardwareProfile", "cnic_prefix", "scaled_bytes_per_token_layer"]

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    gpus_per_node: int = 8
    cnic_gbps: float = 400.0
    snic_gbps: float = 400.0
    dram_buffer_gb: float = 80.0
    prefetch_cache_gb: float = PREFETCH_CACHE_GB  # beside the buffer, for agent-aware prefetch (mode prefetch)
    scale: float = 1000.0
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.scale < 1:
            raise ValueError(f"scale must be >= 1, got {self.scale}")
        if self.slowdown <= 0:
            raise ValueError(f"slowdown must be positive, got {self.slowdown}")
        if min(self.gpus_per_node, self.cnic_gbps, self.snic_gbps, self.dram_buffer_gb) <= 0:
            raise ValueError("hardware figures must be positive")

    def snic_real_bytes_per_s(self, engines_per_node: int) -> float:
        """The modeled cluster's SNIC rate for a node of ``engines_per_node`` engines (unscaled)."""
        share = min(1.0, engines_per_node / self.gpus_per_node)
        return self.snic_gbps * GBPS * share

    def snic_bytes_per_s(self, engines_per_node: int) -> float:
        """Emulated SNIC rate of one node running ``engines_per_node`` engines (scaled, slowed)."""
        return self.snic_real_bytes_per_s(engines_per_node) / self.scale / self.slowdown

    def cnic_bytes_per_s(self) -> float:
        """Emulated CNIC rate of one GPU (scaled, slowed)."""
        return self.cnic_gbps * GBPS / self.scale / self.slowdown

    def nic_chunk_bytes(self, rate: float) -> int:
        """Chunk size for an emulated NIC of ``rate``: ~2 ms of *modeled* link time (not of the
        slowed one), so slow motion does not multiply the host's per-chunk work."""
        from dualpath.transfer.nic import chunk_bytes_for

        return chunk_bytes_for(rate * self.slowdown)

    def cnic(self, namespace: str, engine_id: str, *, one_class: bool = False):
        """The emulated full-duplex CNIC of GPU ``engine_id``, shared with the host's other
        processes (they find it through ``NicDirectory(cnic_prefix(namespace))``);
        ``one_class``: model and KV traffic share one FIFO queue (no isolation)."""
        from dualpath.transfer.nic import DuplexNic, NicDirectory

        rate = self.cnic_bytes_per_s()
        return DuplexNic.create(
            rate,
            name=f"{engine_id}-cnic",
            chunk_bytes=self.nic_chunk_bytes(rate),
            shared=NicDirectory.key(cnic_prefix(namespace), engine_id),
            one_class=one_class,
        )

    def buffer_bytes(self, engines_per_node: int) -> int:
        return self._node_dram_bytes(self.dram_buffer_gb, engines_per_node)

    def prefetch_cache_bytes(self, engines_per_node: int) -> int:
        """The prefetch cache of a node of ``engines_per_node`` engines (scaled as the buffer)."""
        return self._node_dram_bytes(self.prefetch_cache_gb, engines_per_node)

    def _node_dram_bytes(self, gb: float, engines_per_node: int) -> int:
        """``gb`` of an 8-GPU node's DRAM for a node of ``engines_per_node`` engines, scaled."""
        share = min(1.0, engines_per_node / self.gpus_per_node)
        return int(gb * 1e9 * share / self.scale)


def cnic_prefix(namespace: str) -> str:
    """Prefix of the shared CNIC keys of a stack's engines (one stack per namespace)."""
    return f"dualpath.{namespace}.cnic"


def scaled_bytes_per_token_layer(kv_bytes_per_token_layer: int, scale: float) -> int:
    """KV bytes per token per layer after scaling: even (K and V halves), at least 2."""
    b = max(2, round(kv_bytes_per_token_layer / scale))
    return b + (b % 2)
