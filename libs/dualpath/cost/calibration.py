"""The calibration: every constant of the cost model and the simulated hardware, with its source.

One table (``CALIBRATION``), the same for every experiment the simulator runs and every row
``dualpath sim paper`` prints. Each constant says where its value comes from (``kind``):

- ``datasheet``: a vendor's published figure (NVIDIA H100/H800 SXM, ConnectX-7);
- ``paper``: the DualPath paper's own setup or numbers (PAPER.md);
- ``measurement``: a published measurement of the kernels or system the paper runs on
  (DeepSeek's DeepGEMM, FlashMLA, DeepEP, 3FS and inference-system figures on H800);
- ``design``: how this project's services run (the traffic manager, the scheduler), which the
  simulator mirrors;
- ``assumed``: no source pins it; the text says what bounds it;
- ``fitted``: chosen so that one paper row comes out right (``row`` names it). At most three.

The modules that use a constant read it from here (``value(key)``): ``dualpath.cost.gpu``
(the GPU profile and the roofline's efficiency factors), ``dualpath.cost.model`` (HBM reserve),
``dualpath.sim.config`` (nodes, NICs, buffers, the scheduler's periods). ``table()`` is what
``dualpath sim paper --json`` prints beside the rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["CALIBRATION", "KINDS", "Constant", "fitted", "table", "value"]

KINDS = ("datasheet", "paper", "measurement", "design", "assumed", "fitted")


@dataclass(frozen=True, slots=True, kw_only=True)
class Constant:
    """One calibrated value: what it is, its unit, where it comes from."""

    key: str
    value: float
    unit: str
    what: str
    kind: str
    source: str
    row: str = ""  # kind "fitted": the paper row it was chosen to match

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.key}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.kind == "fitted") != bool(self.row):
            raise ValueError(f"{self.key}: a fitted constant names the row it matches, and only a fitted one")


_H100 = "NVIDIA H100 Tensor Core GPU datasheet, SXM column (H800 SXM: same SMs, clocks and HBM3; only NVLink and NIC differ)"

_CONSTANTS = (
    # -- the GPU (H800 SXM) ------------------------------------------------------------------
    Constant(
        key="gpu_bf16_flops",
        value=989e12,
        unit="FLOP/s",
        what="dense BF16 tensor-core peak (attention runs here)",
        kind="datasheet",
        source=f"{_H100}: 1,979 TFLOPS BF16 with sparsity, 989 dense",
    ),
    Constant(
        key="gpu_fp8_flops",
        value=1979e12,
        unit="FLOP/s",
        what="dense FP8 tensor-core peak (FP8 weights' GEMMs and the V3.2 indexer)",
        kind="datasheet",
        source=f"{_H100}: 3,958 TFLOPS FP8 with sparsity, 1,979 dense",
    ),
    Constant(
        key="gpu_hbm_bytes_per_s",
        value=3.35e12,
        unit="B/s",
        what="HBM3 bandwidth",
        kind="datasheet",
        source=f"{_H100}: 3.35 TB/s",
    ),
    Constant(
        key="gpu_hbm_bytes",
        value=80 * 2**30,
        unit="B",
        what="HBM capacity",
        kind="datasheet",
        source=f"{_H100}: 80 GB (nvidia-smi reports 81,559 MiB)",
    ),
    Constant(
        key="gemm_fraction",
        value=0.65,
        unit="of peak",
        what="achieved share of the GEMM peak (projections, MLPs, experts, LM head)",
        kind="measurement",
        source="DeepGEMM README: FP8 GEMMs 'up to 1550 TFLOPS on H800' (0.78 of 1,979) on its largest shapes; serving "
        "batches are smaller and ragged, so the model takes 0.65 (the 660B's TPOT and JCT do not move it: decode is "
        "memory- and latency-bound, prefill is bound by attention and the indexer at 16K-64K contexts)",
    ),
    Constant(
        key="attention_fraction",
        value=0.55,
        unit="of peak",
        what="achieved share of the BF16 peak in attention (and of the FP8 peak in the indexer)",
        kind="measurement",
        source="FlashMLA README: sparse MLA prefill 'up to 640 TFlops' on H800 SXM5 (0.65 of 989), dense decode 660 "
        "TFLOPS compute-bound, sparse FP8 decode 410 TFLOPS (0.41); 0.55 for variable-length batches of short appends",
    ),
    Constant(
        key="hbm_fraction",
        value=0.85,
        unit="of peak",
        what="achieved share of HBM bandwidth (weights, KV and indexer reads)",
        kind="measurement",
        source="FlashMLA README: memory-bound MLA decode 'up to 3000 GB/s' on H800 (0.90 of 3,350); 0.85 for the "
        "weight and expert reads around it",
    ),
    Constant(
        key="layer_overhead_s",
        value=10e-6,
        unit="s per layer",
        what="fixed time per layer no roofline term covers (launch gaps, norms, RoPE, routing)",
        kind="assumed",
        source="no published figure; bounded by the paper's 660B TPOT (39 ms at 2P4D): 61 layers x 100 us would put it "
        "6 ms (15%) higher; CUDA graphs hide most of it in decode",
    ),
    Constant(
        key="decode_step_host_s",
        value=0.0,
        unit="s per decode step",
        what="host time per decode step the GPU waits for (scheduling, sampling, streaming)",
        kind="assumed",
        source="0: a production engine overlaps it (CUDA graphs, an overlapped scheduler); sim validate instead takes "
        "the testbed's measured figure (dualpath.testbed.HostPerStep), whose Python host does not overlap it",
    ),
    Constant(
        key="ds27b_decode_per_request_s",
        value=0.30e-3,
        unit="s per running request per decode step",
        what="the DS 27B's decode step time beyond its roofline, per request in the batch (the paper table's 27B runs "
        "add it to every step)",
        kind="fitted",
        row="ds27b_1p1d_dualpath_over_oracle",
        source="the paper gives no TPOT or compute figure for its internal 27B; its roofline step (1.8 ms for one "
        "40K-context request, 5.5 ms for 64 of 32K, EP 8 inside one node) makes Oracle ~3x faster than the paper's "
        "1.09-1.85x DualPath/Oracle range allows (the row 3.18-5.74x over 128-1,024 agents). A fixed time per step "
        "cannot bring the whole range in (20 ms: 1.01-1.77x; the smallest batch stays decode-latency-bound); a time per "
        "request in the batch (sampling, streaming, each token's expert dispatch) can. With de_snic_read_share 0.78: "
        "0.27 ms gives 1.68-1.89x, 0.30 ms 1.60-1.76x, 0.33 ms 1.53-1.66x. It also moves the other 27B rows, which it "
        "was not chosen for",
    ),
    Constant(
        key="hbm_reserve_fraction",
        value=0.08,
        unit="of HBM",
        what="HBM kept from the KV cache for activations, the CUDA context, communication buffers and slack",
        kind="assumed",
        source="no published figure for the paper's engine; it sets the decode engines' KV capacity (845K tokens per "
        "GPU for the 660B at EP 32), which binds the simulated DualPath online (docs/paper.md)",
    ),
    Constant(
        key="nvlink_domain_gpus",
        value=8,
        unit="GPUs",
        what="GPUs joined by NVLink (one HGX node)",
        kind="datasheet",
        source="NVIDIA HGX H800/H100: 8 GPUs per NVLink domain",
    ),
    # -- all-to-all ------------------------------------------------------------------------------
    Constant(
        key="decode_all_to_all_us",
        value=428,
        unit="us per MoE layer at EP 32 (dispatch + combine)",
        what="a decode step's expert-parallel all-to-all, per MoE layer, once the EP group spans nodes; the full table "
        "by EP size is dualpath.cost.gpu.DEEPEP_LOW_LATENCY_US (EP 16: 313 us, EP 32: 428, EP 64: 487, EP 128: 561)",
        kind="measurement",
        source="DeepEP README (V1), low-latency kernels, pure RDMA, H800 + CX7 400 Gb/s, 128 tokens per rank, hidden "
        "7168, top-8: dispatch 155 us + combine 273 us at EP 32. Two-micro-batch overlap cannot hide it at decode "
        "batch sizes: it is what puts the 660B's TPOT at the paper's 36-39 ms (the roofline alone gives ~15 ms)",
    ),
    Constant(
        key="intranode_all_to_all_us",
        value=0.0,
        unit="us per MoE layer",
        what="the all-to-all of an EP group within one NVLink domain (decode) and of every prefill batch",
        kind="measurement",
        source="DeepSeek profile-data README: prefill and decode overlap all-to-all with computation in two "
        "micro-batches; DeepEP README: normal kernels move 153-158 GB/s over NVLink and 43-58 GB/s over RDMA, so "
        "a 660B prefill token's dispatch and combine (~21 KB to the other node per MoE layer at EP 16) take ~0.5 us "
        "of the ~2.5 us its layer computes",
    ),
    # -- nodes and NICs ----------------------------------------------------------------------
    Constant(
        key="gpus_per_node",
        value=8,
        unit="GPUs",
        what="GPUs per node",
        kind="paper",
        source="PAPER.md, evaluation setup: nodes of 8 Hopper GPUs",
    ),
    Constant(
        key="snic_gbps",
        value=400.0,
        unit="Gbit/s per node",
        what="storage NIC (SNIC) rate, each direction",
        kind="paper",
        source="PAPER.md: 1 x 400 Gbps SNIC per node to 3FS, which 'saturates the SNIC' (no DRAM cache); "
        "ConnectX-7 datasheet: 400 Gb/s NDR",
    ),
    Constant(
        key="cnic_gbps",
        value=400.0,
        unit="Gbit/s per GPU",
        what="compute NIC (CNIC) rate per GPU, each direction; every transfer into or out of a GPU crosses it",
        kind="paper",
        source="PAPER.md: 8 x 400 Gbps CNIC per node (InfiniBand), CNIC-centric traffic (§5)",
    ),
    Constant(
        key="model_traffic_share",
        value=0.0,
        unit="of CNIC",
        what="CNIC time the model's own collectives take from KV traffic (SimConfig.collective_share)",
        kind="paper",
        source="PAPER.md §5: collectives on the high-priority lane; KV uses the rest and all idle time. The prefill "
        "all-to-all's RDMA share is ~0.2 of the CNIC while a 660B batch computes (intranode_all_to_all_us) and KV "
        "flows are far below the CNIC's rate, so it is left out",
    ),
    Constant(
        key="de_snic_read_share",
        value=0.78,
        unit="of the SNIC rate",
        what="the storage read rate of a decode node (the DE read path: storage -> DE buffer, then RDMA to the PE) "
        "as a share of its SNIC's line rate; a prefill node reads at the line rate",
        kind="fitted",
        row="pd_speedup_max",
        source="no published figure: the paper names the DE read path but gives no rate for it. Its storage-bound 27B "
        "figures put it below the line rate: DualPath 1P1D over Basic up to 1.78x where one PE and one DE SNIC at the "
        "line rate allow 2x (a share of 0.78), 1P2D up to 2.46x where three allow 3x (0.73), online 1P1D 1.67x (0.67). "
        "Fitted to the P/D table's maximum (2.46x, 1P2D at 1,024 agents): 0.78 gives 2.46x, 1.0 gave 2.86x. "
        "Applied by every row of sim paper; the other sim commands read at the line rate unless --de-read-share is given",
    ),
    Constant(
        key="dram_buffer_gb",
        value=80.0,
        unit="GB per node",
        what="DRAM buffer per node (PE buffer or DE buffer)",
        kind="paper",
        source="PAPER.md: 80 GB per node for the DeepSeek models (320 GB for Qwen-32B)",
    ),
    Constant(
        key="host_dram_bytes_per_s",
        value=500e9,
        unit="B/s per node",
        what="host memory bandwidth M; not simulated",
        kind="paper",
        source="PAPER.md §4.2: M ~ 500 GB/s; its bound P/D <= (M/(B s) - 3)/2 = 3.5 holds for every simulated "
        "P/D (at most 2), so DRAM bandwidth never binds and is not a simulated resource",
    ),
    Constant(
        key="storage_parallel",
        value=4,
        unit="reads",
        what="block reads a node's traffic manager keeps in flight (they share the SNIC)",
        kind="design",
        source="dualpath.node StorageIO default (4 worker reads)",
    ),
    # -- KV and scheduling --------------------------------------------------------------------
    Constant(
        key="block_tokens",
        value=64,
        unit="tokens",
        what="Full Block size",
        kind="paper",
        source="PAPER.md §A.5: one trie node per Full Block of 64 tokens",
    ),
    Constant(
        key="mla_kv_bytes_per_token_layer",
        value=656,
        unit="B",
        what="KV of one token in one MLA layer (DeepSeek targets)",
        kind="measurement",
        source="FlashMLA README: the FP8 KV cache format, 656 bytes per token (512 FP8 NoPE, 4 FP32 scales, 64 BF16 "
        "RoPE); the paper's cache-compute ratios (4.8-5.8 GB/PFLOP for V3) match it, not BF16",
    ),
    Constant(
        key="quota_s",
        value=0.300,
        unit="s",
        what="intra-engine compute quota of a prefill batch (attention time)",
        kind="paper",
        source="PAPER.md §6.2: compute quota 300 ms",
    ),
    Constant(
        key="alpha_s",
        value=3.0,
        unit="s of storage reads",
        what="alpha: a read queue is short below the tokens the SNIC reads in this long",
        kind="paper",
        source="PAPER.md §6.1: tokens readable from storage in 3 s",
    ),
    Constant(
        key="beta_s",
        value=5.0,
        unit="s of prefill",
        what="beta: a prefill engine is overloaded beyond the tokens it prefills in this long",
        kind="paper",
        source="PAPER.md §6.1: tokens one GPU processes in 5 s",
    ),
    Constant(
        key="pass_interval_s",
        value=0.002,
        unit="s",
        what="the scheduler's loop period",
        kind="design",
        source="dualpath.core scheduler service: passes at most every 2 ms",
    ),
    Constant(
        key="report_interval_s",
        value=0.2,
        unit="s",
        what="how often a node reports its read queue",
        kind="design",
        source="the traffic manager's report period (0.2 s)",
    ),
)

CALIBRATION: dict[str, Constant] = {c.key: c for c in _CONSTANTS}


def value(key: str) -> float:
    """The calibrated value of ``key`` (raises ``KeyError`` for an unknown key)."""
    return CALIBRATION[key].value


def fitted() -> list[Constant]:
    """The constants chosen to make one row match (at most three)."""
    return [c for c in CALIBRATION.values() if c.kind == "fitted"]


def table() -> list[dict]:
    """Every constant as a plain dict (key, value, unit, what, kind, source, row), in table order."""
    return [asdict(c) for c in CALIBRATION.values()]
