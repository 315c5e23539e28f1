"""The cluster simulator: the paper's experiments in virtual time, at full scale.

It drives the *same* decision code as the services — the scheduler core
(``dualpath.core.scheduler``, which runs the policy library), the prefill and decode engine
cores (``dualpath.core.prefill_batcher``, ``dualpath.core.decode_batcher``) and the roofline
cost model (``dualpath.cost``) — around a discrete-event model of the hardware: a fluid
fair-share network of storage and compute NICs (``network``), per-node storage read queues
and DRAM buffers (``storage``), layer-wise prefill (``prefill``) and decode steps aggregated
between batch membership changes (``decode``). ``Simulation`` wires them; ``experiments``
runs the paper's figures; ``dualpath sim`` is the command line.
"""

from dualpath.sim.config import ABLATION, MODES, SimConfig, SimMode, parse_topology
from dualpath.sim.simulation import Simulation
from dualpath.sim.workload import Workload

__all__ = ["ABLATION", "MODES", "SimConfig", "SimMode", "Simulation", "Workload", "parse_topology"]
