"""GPU profiles: peak rates, HBM capacity and the efficiency factors of the roofline.

The efficiency factors live here and nowhere else. They turn datasheet peaks into rates a
well-tuned serving kernel sustains on Hopper:

- ``MFU_DENSE`` 0.65: large FP8/BF16 GEMMs (DeepGEMM reaches ~1,500 of 1,979 FP8 TFLOP/s
  on big shapes; serving shapes are smaller and ragged).
- ``MFU_ATTENTION`` 0.55: FlashAttention-3 / FlashMLA prefill kernels reach 60-65% of BF16
  peak on long sequences; variable-length batches of short appends lose some of that.
- ``HBM_EFFICIENCY`` 0.85: FlashMLA's memory-bound decode reaches ~3,000 of 3,350 GB/s.
- ``LAYER_OVERHEAD_S`` 10 us: launch gaps, norms, RoPE and routing per layer that no
  roofline term covers (small; CUDA graphs hide most of it in decode).

HBM capacity is 80 GiB (nvidia-smi reports 81,559 MiB on an H100/H800 SXM "80 GB").
H800 and H100 SXM differ only in NVLink/NIC bandwidth, which this model does not use.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.cost.errors import UnknownGpuError

__all__ = ["GPUS", "GpuProfile", "get_gpu"]

MFU_DENSE = 0.65
MFU_ATTENTION = 0.55
HBM_EFFICIENCY = 0.85
LAYER_OVERHEAD_S = 10e-6


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


def _hopper_sxm(name: str) -> GpuProfile:
    return GpuProfile(name=name, bf16_flops=989e12, fp8_flops=1979e12, hbm_bytes_per_s=3.35e12, hbm_capacity_bytes=80 * 2**30)


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
