"""GPU profiles: peak rates, HBM capacity and the efficiency factors of the roofline.

Every value comes from the calibration table (``dualpath.cost.calibration``, where each one's
source is given): the datasheet peaks of an H800/H100 SXM, the achieved fractions of them
(``MFU_DENSE`` for GEMMs, ``MFU_ATTENTION`` for attention and the indexer, ``HBM_EFFICIENCY``),
the fixed time per layer (``LAYER_OVERHEAD_S``) and ``DEEPEP_LOW_LATENCY_US``, a decode step's
expert-parallel all-to-all once the EP group spans nodes (more GPUs than ``NVLINK_DOMAIN``):
DeepEP's low-latency dispatch + combine over RDMA, per MoE layer, as its README measures them
on H800 with CX7 400 Gb/s NICs (128 tokens per rank, hidden 7168, top-8, FP8 dispatch, BF16
combine). It is latency, not bandwidth: at decode batch sizes it barely changes with the
batch, and it is what puts the paper's 660B TPOT at 36-39 ms where the roofline alone gives
~15-20 ms. H800 and H100 SXM differ only in NVLink/NIC bandwidth, which this model does not use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dualpath.cost.calibration import value
from dualpath.cost.errors import UnknownGpuError

__all__ = ["DEEPEP_LOW_LATENCY_US", "GPUS", "NVLINK_DOMAIN", "GpuProfile", "get_gpu"]

MFU_DENSE = value("gemm_fraction")
MFU_ATTENTION = value("attention_fraction")
HBM_EFFICIENCY = value("hbm_fraction")
LAYER_OVERHEAD_S = value("layer_overhead_s")
NVLINK_DOMAIN = int(value("nvlink_domain_gpus"))  # GPUs per node joined by NVLink (HGX H800/H100)
# (EP size, dispatch us, combine us): DeepEP README, low-latency kernels with pure RDMA, H800 + CX7 400G.
DEEPEP_LOW_LATENCY_US = ((8, 77, 114), (16, 118, 195), (32, 155, 273), (64, 173, 314), (128, 192, 369), (256, 194, 360))


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuProfile:
    """Peak rates of one GPU and the fractions of them the roofline assumes."""

    name: str
    bf16_flops: float  # dense BF16 tensor-core FLOP/s
    fp8_flops: float  # dense FP8 tensor-core FLOP/s
    hbm_bytes_per_s: float
    hbm_capacity_bytes: int
    mfu_dense: float = MFU_DENSE
    mfu_attention: float = MFU_ATTENTION
    hbm_efficiency: float = HBM_EFFICIENCY
    layer_overhead_s: float = LAYER_OVERHEAD_S
    nvlink_domain: int = NVLINK_DOMAIN
    ep_all_to_all_us: tuple[tuple[int, int, int], ...] = DEEPEP_LOW_LATENCY_US

    def decode_all_to_all_s(self, ep: int) -> float:
        """Seconds of one MoE layer's dispatch + combine in a decode step with expert
        parallelism over ``ep`` GPUs: 0 within one NVLink domain (overlapped, as the rest of
        the model's communication), else ``ep_all_to_all_us`` interpolated in log2(ep) (the
        table's last row beyond its end)."""
        if ep <= self.nvlink_domain:
            return 0.0
        table = self.ep_all_to_all_us
        x = math.log2(ep)
        for (e0, d0, c0), (e1, d1, c1) in zip(table, table[1:], strict=False):
            if ep <= e1:
                f = (x - math.log2(e0)) / (math.log2(e1) - math.log2(e0)) if ep > e0 else 0.0
                return ((d0 + c0) + f * ((d1 + c1) - (d0 + c0))) * 1e-6
        _, d, c = table[-1]
        return (d + c) * 1e-6


def _hopper_sxm(name: str) -> GpuProfile:
    return GpuProfile(
        name=name,
        bf16_flops=value("gpu_bf16_flops"),
        fp8_flops=value("gpu_fp8_flops"),
        hbm_bytes_per_s=value("gpu_hbm_bytes_per_s"),
        hbm_capacity_bytes=int(value("gpu_hbm_bytes")),
    )


GPUS: dict[str, GpuProfile] = {"h800": _hopper_sxm("H800 SXM"), "h100": _hopper_sxm("H100 SXM")}


def get_gpu(name: str) -> GpuProfile:
    """Return the GPU profile called ``name`` (a key of ``GPUS``).

    Raises:
        UnknownGpuError: ``name`` is not a key of ``GPUS``; the message lists them.
    """
    try:
        return GPUS[name]
    except KeyError:
        raise UnknownGpuError(name, list(GPUS)) from None
