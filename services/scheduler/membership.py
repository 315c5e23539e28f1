"""Who is alive: engines and nodes known from their reports, with integer ids for the policy.

The policy works on dense integers; the wire uses strings. An engine that has not reported
for ``timeout`` seconds is dead; any change in the set rebuilds the policy's ``ClusterState``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.policy import ClusterState, NodeSpec
from dualpath.policy.values import Role as PolicyRole
from dualpath.protocol import messages as m

__all__ = ["Member", "Membership"]


@dataclass(slots=True, kw_only=True)
class Member:
    name: str
    num: int
    node: str
    role: int
    capacity_tokens: int
    block_bytes: int
    last_seen: float


@dataclass(slots=True, kw_only=True)
class NodeInfo:
    name: str
    num: int
    read_q_tokens: int = 0
    last_seen: float = 0.0
    region: dict = field(default_factory=dict)


class Membership:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.engines: dict[str, Member] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self._engine_nums: dict[str, int] = {}
        self._node_nums: dict[str, int] = {}
        self.by_engine_num: dict[int, str] = {}
        self.by_node_num: dict[int, str] = {}

    def _node(self, name: str) -> NodeInfo:
        info = self.nodes.get(name)
        if info is None:
            num = self._node_nums.setdefault(name, len(self._node_nums))
            self.by_node_num[num] = name
            info = self.nodes[name] = NodeInfo(name=name, num=num)
        return info

    def engine_report(self, r: m.EngineReport, now: float) -> bool:
        """Record a report; True when the engine is new (membership changed)."""
        member = self.engines.get(r.engine_id)
        if member is not None:
            member.last_seen = now
            return False
        num = self._engine_nums.setdefault(r.engine_id, len(self._engine_nums))
        self.by_engine_num[num] = r.engine_id
        self._node(r.node_id)
        self.engines[r.engine_id] = Member(name=r.engine_id, num=num, node=r.node_id, role=r.role,
                                           capacity_tokens=r.capacity_tokens, block_bytes=r.block_bytes, last_seen=now)
        return True

    def node_report(self, r: m.NodeReport, now: float) -> NodeInfo:
        info = self._node(r.node_id)
        info.last_seen = now
        info.read_q_tokens = r.read_q_tokens
        if r.regions:
            info.region = r.regions[0]
        return info

    def expire(self, now: float) -> list[Member]:
        """Drop engines silent for longer than the timeout; returns them."""
        dead = [e for e in self.engines.values() if now - e.last_seen > self.timeout]
        for e in dead:
            del self.engines[e.name]
        return dead

    def count(self, role: int) -> int:
        return sum(1 for e in self.engines.values() if e.role == role)

    def cluster_state(self) -> ClusterState | None:
        """A fresh policy state for the live engines (None without both roles)."""
        specs = []
        by_node: dict[str, list[Member]] = {}
        for e in self.engines.values():
            by_node.setdefault(e.node, []).append(e)
        for node, members in by_node.items():
            role = PolicyRole.DECODE if members[0].role == m.Role.DECODE else PolicyRole.PREFILL
            hbm = min(e.capacity_tokens for e in members) if role is PolicyRole.DECODE else 0
            specs.append(NodeSpec(node_id=self.nodes[node].num, role=role, engine_ids=tuple(e.num for e in members), hbm_tokens=hbm))
        if not any(s.role is PolicyRole.PREFILL for s in specs) or not any(s.role is PolicyRole.DECODE for s in specs):
            return None
        return ClusterState(specs)
