"""Who is alive, what they last reported, and the scheduler's charges they have not reported yet.

Engines and nodes are *holders*: each keeps its last reported figures and the sum of the
charges the core made on it that no report of it has reflected yet (the ledger rule is
in ``dualpath.core.scheduler``). The policy works on dense integers; the wire uses names:
each name gets a number on first sight and keeps it (an engine that re-joins gets its old
number back).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Final

from dualpath.policy import ClusterState, NodeSpec
from dualpath.policy.values import Role

__all__ = ["ACKED", "REFLECTED", "RELEASED", "UNSEEN", "Charge", "EngineMember", "HeldTasks", "Holder", "Membership", "NodeMember"]

# Charge.state
UNSEEN: Final = 0
ACKED: Final = 1
REFLECTED: Final = 2
RELEASED: Final = 3


class Holder:
    """Something the core charges: an engine (seq, tok, HBM) or a node (read_q tokens in
    ``dtok``, bytes of its DRAM buffer in ``dhbm``)."""

    __slots__ = ("acked", "dhbm", "dseq", "dtok", "last_seen", "live", "name", "num")

    def __init__(self, name: str, num: int, now: float) -> None:
        self.name, self.num, self.last_seen = name, num, now
        self.live = True  # False once removed: its charges no longer touch the cluster state
        self.dseq = self.dtok = self.dhbm = 0  # Σ charges not reflected by a report yet
        self.acked: deque[Charge] = deque()  # acknowledged charges, in acknowledgement order


class EngineMember(Holder):
    """One engine: where it runs, its role and capacity, its last report, and the process its
    reports came from (``incarnation``; "" until one names it)."""

    __slots__ = ("block_bytes", "capacity_tokens", "free_hbm", "incarnation", "node", "role", "seq", "tok")

    def __init__(self, name: str, num: int, now: float, *, node: str, role: Role, capacity_tokens: int, block_bytes: int) -> None:
        super().__init__(name, num, now)
        self.node, self.role, self.capacity_tokens, self.block_bytes = node, role, capacity_tokens, block_bytes
        self.seq = self.tok = 0
        self.free_hbm = capacity_tokens
        self.incarnation = ""


class NodeMember(Holder):
    """One node's traffic manager: its last reported storage read queue (tokens) and free
    DRAM buffer (bytes, of ``buffer_bytes``; -1: never reported), whether it is down
    (its engines leave scheduling until its next report), and ``reads_open``: the hit
    tokens of the reads the core placed on it whose prefill has not finished (the core's
    own count, never overwritten by a report: ``NodeState.reads_open``)."""

    __slots__ = ("block_bytes", "buffer_bytes", "buffer_free", "down", "read_q", "reads_open", "reported")

    def __init__(self, name: str, num: int, now: float) -> None:
        super().__init__(name, num, now)
        self.read_q = 0
        self.reads_open = 0
        self.buffer_free = -1
        self.buffer_bytes = 0
        self.block_bytes = 0  # a Full Block of its decode engines: the policy counts the buffer in blocks
        self.reported = False  # a node that never reported (known from its engines) never expires
        self.down = False  # its traffic manager stopped reporting or did not answer: not used

    def buffer_blocks(self) -> tuple[int, int]:
        """(free, total) Full Blocks of its buffer for the policy: the last report less the
        unreflected slot charges; (-1, -1) while unknown (no report, or no block size)."""
        if self.buffer_free < 0 or self.block_bytes <= 0:
            return -1, -1
        return (self.buffer_free - self.dhbm) // self.block_bytes, self.buffer_bytes // self.block_bytes


class Charge:
    """One decision's charge on one holder (``seq``/``tok``/``hbm`` tokens; a node's
    read charge uses ``tok``, its buffer slot charge ``hbm``, in bytes). ``state``: UNSEEN (the holder cannot know it yet), ACKED at
    event ``ack`` (the holder has it; its next report counts it), REFLECTED (a report
    counted it; only reports move it now), RELEASED (its part of the request ended)."""

    __slots__ = ("ack", "hbm", "holder", "seq", "state", "tok")

    def __init__(self, holder: Holder, seq: int, tok: int, hbm: int) -> None:
        self.holder, self.seq, self.tok, self.hbm = holder, seq, tok, hbm
        self.state = UNSEEN
        self.ack = 0
        holder.dseq += seq
        holder.dtok += tok
        holder.dhbm += hbm

    def acknowledge(self, k: int) -> None:
        """The holder has it as of event ``k``: the first report after ``k`` reflects it."""
        if self.state == UNSEEN:
            self.state = ACKED
            self.ack = k
            self.holder.acked.append(self)

    def release(self) -> bool:
        """The charge's part of the request ended; True when the core must take it off the
        figures itself (it was unreflected), False when reports already carry it."""
        state = self.state
        self.state = RELEASED
        if state == UNSEEN or state == ACKED:
            h = self.holder
            h.dseq -= self.seq
            h.dtok -= self.tok
            h.dhbm -= self.hbm
            if state == ACKED:  # released charges at the head of the acknowledged ones need no report to leave
                acked = h.acked
                while acked and acked[0].state == RELEASED:
                    acked.popleft()
            return True
        return False


class HeldTasks:
    """The prefills each prefill engine whose reports list what it holds was given (dispatch
    answered), and how many of its reports in a row left each out: one missing from
    ``LOST_AFTER_REPORTS`` of them, the last ``grace_s`` or more after the answer, is lost (its
    engine dropped it and the ``TaskFailed`` never came; ``dualpath.core.scheduler``)."""

    LOST_AFTER_REPORTS = 2

    __slots__ = ("_given", "listing")

    def __init__(self) -> None:
        self.listing: set[str] = set()  # engines whose reports list the tasks they hold
        self._given: dict[str, dict[str, tuple[int, float]]] = {}  # engine -> request -> (reports without it, now of the answer)

    def given(self, engine: str, request_id: str, now: float) -> None:
        """``engine`` answered the dispatch of ``request_id`` (checked only if it lists)."""
        if engine in self.listing:
            self._given.setdefault(engine, {})[request_id] = (0, now)

    def forget(self, engine: str) -> None:
        """``engine`` left: nothing of it is checked until it lists again."""
        self._given.pop(engine, None)
        self.listing.discard(engine)

    def lost(
        self,
        engine: str,
        holding: tuple[str, ...],
        attempts: tuple[int, ...],
        current: Callable[[str, str], int],
        now: float,
        grace_s: float,
    ) -> list[str]:
        """The requests ``engine``'s report (``holding``, ``attempts`` by position; -1 or empty:
        not said) shows lost. ``current(engine, request)`` is the attempt the core has
        prefilling there, -1 once that prefill ended (it is then forgotten here)."""
        if engine not in self.listing:
            self.listing.add(engine)  # from now on its answered dispatches are checked
            return []
        given = self._given.get(engine)
        if not given:
            return []
        held = dict(zip(holding, attempts)) if len(attempts) == len(holding) else dict.fromkeys(holding, -1)
        gone: list[str] = []
        for rid, (misses, since) in list(given.items()):
            attempt = current(engine, rid)
            if attempt < 0:
                del given[rid]  # its prefill ended (finished, failed, re-queued): nothing to check
                continue
            said = held.get(rid)
            if said is not None and (said < 0 or said == attempt):
                given[rid] = (0, since)
            elif misses + 1 < self.LOST_AFTER_REPORTS or now - since < grace_s:
                given[rid] = (misses + 1, since)
            else:
                del given[rid]
                gone.append(rid)
        return gone


def reflect(holder: Holder, k: int) -> None:
    """A report of ``holder`` arrived at event ``k``: every charge acknowledged before it is
    now counted by the report and leaves the unreflected sums."""
    acked = holder.acked
    while acked and acked[0].ack < k:
        c = acked.popleft()
        if c.state == ACKED:
            c.state = REFLECTED
            holder.dseq -= c.seq
            holder.dtok -= c.tok
            holder.dhbm -= c.hbm


class Membership:
    """Live engines and known nodes by name, with sticky dense numbers."""

    def __init__(self) -> None:
        self.engines: dict[str, EngineMember] = {}
        self.nodes: dict[str, NodeMember] = {}
        self.engine_by_num: dict[int, EngineMember] = {}
        self.node_by_num: dict[int, NodeMember] = {}
        self._engine_nums: dict[str, int] = {}
        self._node_nums: dict[str, int] = {}

    def node(self, name: str, now: float) -> NodeMember:
        """The node called ``name``, created on first sight."""
        info = self.nodes.get(name)
        if info is None:
            num = self._node_nums.setdefault(name, len(self._node_nums))
            info = self.nodes[name] = self.node_by_num[num] = NodeMember(name, num, now)
        return info

    def join(self, name: str, now: float, *, node: str, role: Role, capacity_tokens: int, block_bytes: int) -> EngineMember:
        """Add an engine (its first report, or its first after it was removed)."""
        num = self._engine_nums.setdefault(name, len(self._engine_nums))
        host = self.node(node, now)
        if role == Role.DECODE and block_bytes:
            host.block_bytes = block_bytes
        member = EngineMember(name, num, now, node=node, role=role, capacity_tokens=capacity_tokens, block_bytes=block_bytes)
        self.engines[name] = self.engine_by_num[num] = member
        return member

    def remove(self, name: str) -> EngineMember | None:
        """Stop using an engine; returns it, or None when it was not live."""
        member = self.engines.pop(name, None)
        if member is not None:
            member.live = False
            del self.engine_by_num[member.num]
        return member

    def silent(self, now: float, timeout: float) -> list[str]:
        """Names of engines that have not reported for more than ``timeout``."""
        limit = now - timeout
        return [e.name for e in self.engines.values() if e.last_seen < limit]

    def silent_nodes(self, now: float, timeout: float) -> list[str]:
        """Names of nodes, up and once reported, whose traffic manager has not reported for more than ``timeout``."""
        limit = now - timeout
        return [n.name for n in self.nodes.values() if n.reported and not n.down and n.last_seen < limit]

    def count(self, role: Role) -> int:
        """Live engines of ``role``."""
        return sum(1 for e in self.engines.values() if e.role == role)

    def cluster_state(self) -> ClusterState | None:
        """A fresh policy state for the live engines of nodes that are not down, each figure =
        last report + unreflected charges (None without both roles)."""
        by_node: dict[str, list[EngineMember]] = {}
        for e in self.engines.values():
            if self.nodes[e.node].down:
                continue  # its traffic manager is gone: nothing can be read to or from it
            by_node.setdefault(e.node, []).append(e)
        specs = []
        for node, members in by_node.items():
            role = Role.DECODE if members[0].role == Role.DECODE else Role.PREFILL
            hbm = min(e.capacity_tokens for e in members) if role is Role.DECODE else 0
            if role is Role.DECODE and hbm <= 0:
                continue  # a decode engine without KV memory can hold nothing
            specs.append(NodeSpec(node_id=self.nodes[node].num, role=role, engine_ids=tuple(e.num for e in members), hbm_tokens=hbm))
        if not any(s.role is Role.PREFILL for s in specs) or not any(s.role is Role.DECODE for s in specs):
            return None
        state = ClusterState(specs)
        for e in self.engines.values():
            if e.num in state.engines:
                state.report_engine(
                    e.num, seq=e.seq + e.dseq, tok=e.tok + e.dtok, free_hbm_tokens=e.free_hbm - e.dhbm if e.role == Role.DECODE else None
                )
        for n in self.nodes.values():
            if n.num in state.nodes:
                state.report_node(n.num, read_q=n.read_q + n.dtok)
                state.adjust_reads_open(n.num, n.reads_open)
                free, total = n.buffer_blocks()
                state.report_buffer(n.num, free_blocks=free, total_blocks=total)
        return state
