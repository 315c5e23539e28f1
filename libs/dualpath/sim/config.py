"""What a simulation runs: the cluster, the mode and the knobs, as one frozen value.

Hardware defaults are the paper's testbed (PAPER.md "Evaluation setup"): 8 Hopper GPUs per
node, one 400 Gbps compute NIC (CNIC) per GPU, one 400 Gbps storage NIC (SNIC) per node,
80 GB of DRAM buffer per node. A node simulated with fewer engines than GPUs
(``engines_per_node``, as the testbed runs one engine per node) keeps its SNIC and buffer
in proportion, exactly as ``dualpath.testbed.HardwareProfile`` does, so the storage bandwidth
per engine — what makes a workload I/O-bound — is the cluster's.

Modes mirror the testbed's (``dualpath.cli.experiment.runner.MODES``, not imported: that
module pulls in the stack launcher): ``basic`` (PE read path, round robin), ``dualpath``
(both paths, the paper's scheduler), ``oracle`` (no storage reads, no KV transfers), and the
ablation's steps ``basic-nolw`` (no layer-wise prefill) and ``dualpath-rr`` (both paths,
round-robin selection).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dualpath.cost.calibration import value
from dualpath.node.prefetch import PREFETCH_CACHE_GB

__all__ = ["ABLATION", "GBPS", "MODES", "SimConfig", "SimMode", "parse_topology"]

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True, slots=True)
class SimMode:
    """A system variant: the policy by name, its read-path rule, oracle and layer-wise switches."""

    policy: str
    read_path: str
    oracle: bool = False
    layerwise: bool = True
    label: str = ""
    prefetch: bool = False  # agent-aware prefetch (sim.prefetch)


MODES: dict[str, SimMode] = {
    "basic": SimMode("basic", "pe", label="Basic: PE read path, round robin, layer-wise prefill"),
    "dualpath": SimMode("dualpath", "auto", label="DualPath: both read paths, DualPath scheduler"),
    "oracle": SimMode("dualpath", "auto", oracle=True, label="Oracle: no storage reads, no KV transfers"),
    "basic-nolw": SimMode("basic", "pe", layerwise=False, label="Basic without layer-wise prefill"),
    "dualpath-rr": SimMode("round_robin", "auto", label="+ dual-path loading (round robin engines and read side)"),
    "split": SimMode("dualpath", "split", label="DualPath + split reads (--read-policy split, beyond the paper)"),
    "prefetch": SimMode("dualpath", "auto", prefetch=True, label="DualPath + agent-aware prefetch (--prefetch, beyond the paper)"),
}
ABLATION = ("basic-nolw", "basic", "dualpath-rr", "dualpath")

_TOPOLOGY = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)


def parse_topology(text: str) -> tuple[int, int]:
    """``"2P4D"`` -> ``(2, 4)``.

    Raises:
        ValueError: not of the form xPyD with x, y >= 1.
    """
    m = _TOPOLOGY.match(text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"topology {text!r} must look like 1P1D or 2P4D (at least one prefill and one decode node)")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """One simulated cluster and system mode.

    Raises:
        ValueError: an unknown mode, or a non-positive count or rate.
    """

    target: str = "ds660b"
    gpu: str = "h800"
    prefill_nodes: int = 1
    decode_nodes: int = 1
    # hardware and scheduler defaults: the calibration table (dualpath.cost.calibration) and its sources
    gpus_per_node: int = int(value("gpus_per_node"))
    engines_per_node: int = 0  # 0 = gpus_per_node
    snic_gbps: float = value("snic_gbps")
    cnic_gbps: float = value("cnic_gbps")
    dram_buffer_gb: float = value("dram_buffer_gb")
    mode: str = "dualpath"
    block_tokens: int = int(value("block_tokens"))
    quota_s: float = value("quota_s")  # the intra-engine compute quota (paper §6.2)
    storage_parallel: int = int(value("storage_parallel"))  # concurrent block reads per node (the traffic manager's StorageIO)
    max_running: int = 1024  # decode: most requests batched together (the paper: "batch everything")
    hbm_tokens: int = 0  # decode KV capacity per engine in tokens; 0 = the cost model's
    decode_ep: int = -1  # decode expert parallelism: -1 = the target's default (the testbed's), 0 = auto (decode_ep_size)
    pass_interval_s: float = value("pass_interval_s")  # the scheduler's loop period: passes at most this often
    report_interval_s: float = value("report_interval_s")  # traffic managers report read_q this often (the services' default)
    collective_share: float = value("model_traffic_share")  # prefill: CNIC time of the model collectives (high priority) per compute s
    persist: bool = True  # decode persists full blocks (next turn's hits); False: hits are free
    prefetch_gb: float = PREFETCH_CACHE_GB  # mode prefetch: the prefetch cache per node, GB, in DRAM beside the buffer
    prefetch_ttl_s: float = 60.0  # mode prefetch: seconds a staged copy waits for its agent's next turn
    # decode: host time per step the GPU waits for (scheduling, sampling, streaming), fixed + per
    # running request; 0 = steps back to back (the cost model's calibration). Validate sets it
    # from the testbed's measured figure (dualpath.testbed.HostPerStep).
    decode_host_s: float = value("decode_step_host_s")
    decode_host_per_request_s: float = 0.0
    # the decode nodes' storage read rate as a share of the SNIC's (the DE read path); 1 = the line
    # rate. ``sim paper`` sets the calibration's fitted ``de_snic_read_share``.
    de_read_share: float = 1.0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if min(self.prefill_nodes, self.decode_nodes, self.gpus_per_node, self.block_tokens, self.storage_parallel, self.max_running) < 1:
            raise ValueError("node, GPU, block, storage-parallel and max-running counts must be at least 1")
        if min(self.snic_gbps, self.cnic_gbps, self.dram_buffer_gb, self.prefetch_gb, self.quota_s, self.pass_interval_s) <= 0:
            raise ValueError("bandwidths, buffer and prefetch cache sizes, quota and pass interval must be positive")
        if min(self.decode_host_s, self.decode_host_per_request_s) < 0:
            raise ValueError("decode host times must be >= 0")
        if not 0 < self.de_read_share <= 1:
            raise ValueError(f"de_read_share must be in (0, 1], got {self.de_read_share}")
        if not 0 <= self.collective_share < 1:
            raise ValueError(f"collective_share must be in [0, 1), got {self.collective_share}")
        if self.engines_per_node < 0 or self.engines_per_node > self.gpus_per_node:
            raise ValueError("engines_per_node must be between 0 (all GPUs) and gpus_per_node")

    def decode_ep_size(self, default_ep: int, routed_experts: int) -> int:
        """The decode side's expert-parallel group: the target's default (``decode_ep`` -1),
        the given size, or ``auto`` (0): every decode GPU (capped at one routed expert per GPU)
        for a target whose default group already spans nodes (its KV room grows with the group,
        and the cross-node all-to-all is paid either way), else the target's default, which
        keeps a model that fits in one node off the cross-node all-to-all."""
        if self.decode_ep < 0:
            return default_ep
        if self.decode_ep == 0:
            if default_ep <= self.gpus_per_node:
                return default_ep
            return max(1, min(self.decode_nodes * self.engines, routed_experts or 1))
        return self.decode_ep

    @property
    def sim_mode(self) -> SimMode:
        return MODES[self.mode]

    @property
    def engines(self) -> int:
        """Engines (GPUs) simulated per node."""
        return self.engines_per_node or self.gpus_per_node

    @property
    def node_share(self) -> float:
        """The fraction of a node's SNIC and buffer its simulated engines get."""
        return self.engines / self.gpus_per_node

    def snic_bytes_per_s(self) -> float:
        return self.snic_gbps * GBPS * self.node_share

    def cnic_bytes_per_s(self) -> float:
        return self.cnic_gbps * GBPS

    def buffer_bytes(self) -> float:
        return self.dram_buffer_gb * 1e9 * self.node_share

    @property
    def topology(self) -> str:
        return f"{self.prefill_nodes}P{self.decode_nodes}D"
