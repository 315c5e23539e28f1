"""The DualPath scheduling policy as a pure library: cluster state in, decisions out.

No I/O and no clock: the scheduler service, the testbed and the simulator run the same
code. A pass looks like::

    policy = get_policy("dualpath", Thresholds.from_profile(...))
    for a in policy.schedule(waiting, state):   # FIFO prefix that fits
        state.on_assigned(a)                    # the caller applies each decision
    ...
    state.on_read_finished(rid); state.on_prefill_finished(rid); state.on_finished(rid)

Modules: ``values`` (value types and the token accounting), ``state`` (cluster state),
``inter`` (the paper's PE/DE/read-side selection), ``baselines`` (round robin, least
tokens), ``registry`` (policies by name), ``intra`` (prefill batch packing with chunked
prefill), ``thresholds`` (α, β), ``balance`` (max/avg figures), ``errors``. The scheduler core
(``dualpath.core``) drives this library in the service, the testbed and the simulator;
``dualpath bench scheduler`` measures that core.
"""

from dualpath.policy.balance import LoadAccumulator, max_over_avg
from dualpath.policy.intra import Chunk, PrefillBatch, PrefillWork, pack_prefill_batch
from dualpath.policy.registry import POLICY_NAMES, Policy, get_policy
from dualpath.policy.state import ClusterState, EngineState, NodeState
from dualpath.policy.thresholds import Thresholds, alpha_tokens, beta_tokens
from dualpath.policy.values import (
    Assignment,
    NodeSpec,
    PendingRequest,
    ReadPath,
    ReadSide,
    Role,
)

__all__ = [
    "POLICY_NAMES",
    "Assignment",
    "Chunk",
    "ClusterState",
    "EngineState",
    "LoadAccumulator",
    "NodeSpec",
    "NodeState",
    "PendingRequest",
    "Policy",
    "PrefillBatch",
    "PrefillWork",
    "ReadPath",
    "ReadSide",
    "Role",
    "Thresholds",
    "alpha_tokens",
    "beta_tokens",
    "get_policy",
    "max_over_avg",
    "pack_prefill_batch",
]
