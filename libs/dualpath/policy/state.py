"""The cluster state the policy reads: engines, nodes (each node is one engine group with a
leader), and the requests live in them.

The policy never mutates it. The caller (scheduler service, testbed, simulator) applies
each decision with ``on_assigned`` and each completion with ``on_read_finished``,
``on_prefill_finished`` and ``on_finished``; group leaders' reports overwrite the
bookkeeping with ``report_engine`` / ``report_node``. Because a report may already count a
completion the caller applies afterwards, completions clamp at zero (and free HBM at the
engine's capacity) rather than go negative.

Not thread-safe: one owner (the scheduler loop, the simulator) drives it.
"""

# Conditional expressions instead of min()/max() calls: these run on every report and charge.
# ruff: noqa: FURB136, PLR1730

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from dualpath.policy.errors import (
    DuplicateRequestError,
    InsufficientHbmError,
    InvalidTopologyError,
    RoleMismatchError,
    UnknownEngineError,
    UnknownNodeError,
    UnknownRequestError,
)
from dualpath.policy.index import LazyIndex
from dualpath.policy.values import Assignment, NodeSpec, Role

__all__ = ["ClusterState", "EngineState", "NodeState"]

_DECODE: Final = Role.DECODE


class EngineState:
    """One engine (GPU): ``seq`` unfinished requests, ``tok`` their tokens (see
    ``values`` for the unit per role), ``free_hbm_tokens`` of ``hbm_tokens`` KV capacity
    (decode engines; prefill engines have 0 and are never checked). Read-only for
    callers: change it through ``ClusterState``, which keeps sums and indices current."""

    __slots__ = ("engine_id", "free_hbm_tokens", "hbm_tokens", "node_id", "role", "seq", "tok")

    def __init__(self, engine_id: int, node_id: int, role: Role, hbm_tokens: int) -> None:
        self.engine_id = engine_id
        self.node_id = node_id
        self.role = role
        self.hbm_tokens = hbm_tokens
        self.free_hbm_tokens = hbm_tokens
        self.seq = 0
        self.tok = 0

    def __repr__(self) -> str:
        return f"EngineState(id={self.engine_id}, node={self.node_id}, seq={self.seq}, tok={self.tok}, free_hbm={self.free_hbm_tokens})"


class NodeState:
    """One node and its engine group: ``read_q`` hit tokens queued on its storage NIC,
    ``reads_open`` hit tokens of the reads the scheduler placed on it that it has not seen
    end yet (the scheduler's own count, without a report's lag: ``Thresholds.hold_tokens``),
    ``tok_sum`` = Σ ``tok`` of its engines, ``buffer_free`` of ``buffer_blocks`` Full Blocks
    of its DRAM buffer (a decode node's buffer holds each placed request's slot until its KV
    is in HBM; -1: not reported, the policies do not check it). Read-only for callers, like
    ``EngineState``."""

    __slots__ = ("buffer_blocks", "buffer_free", "engines", "leader", "node_id", "read_q", "reads_open", "role", "tok_sum")

    def __init__(self, spec: NodeSpec) -> None:
        self.node_id = spec.node_id
        self.role = spec.role
        self.engines = tuple(EngineState(eid, spec.node_id, spec.role, spec.hbm_tokens) for eid in sorted(spec.engine_ids))
        self.leader = self.engines[0].engine_id
        self.read_q = 0
        self.reads_open = 0
        self.tok_sum = 0
        self.buffer_free = self.buffer_blocks = -1

    def __repr__(self) -> str:
        return (
            f"NodeState(id={self.node_id}, role={self.role.name}, read_q={self.read_q}, reads_open={self.reads_open}, "
            f"tok_sum={self.tok_sum}, buffer={self.buffer_free}/{self.buffer_blocks})"
        )

    def buffer_room(self, blocks: int, free: int) -> bool:
        """Whether a slot of ``blocks`` Full Blocks fits when ``free`` blocks are free: always
        when the buffer is not reported, and in an empty buffer even when it is larger than
        the whole buffer (the node takes it alone rather than never)."""
        return self.buffer_blocks < 0 or blocks <= free or free >= self.buffer_blocks


@dataclass(slots=True)
class _Live:
    assignment: Assignment
    read_pending: bool = True
    prefill_pending: bool = True


def _most_free(node: NodeState) -> int:
    most = 0
    for engine in node.engines:
        if engine.free_hbm_tokens > most:
            most = engine.free_hbm_tokens
    return most


class ClusterState:
    """Engines and nodes of a PD-disaggregated cluster plus the live requests' charges.

    Raises:
        InvalidTopologyError: when a node or engine id repeats, or either role is missing.
    """

    def __init__(self, nodes: Sequence[NodeSpec]) -> None:
        self.nodes: dict[int, NodeState] = {}
        self.engines: dict[int, EngineState] = {}
        for spec in sorted(nodes, key=lambda s: s.node_id):
            if spec.node_id in self.nodes:
                raise InvalidTopologyError(f"node id {spec.node_id} repeats")
            node = NodeState(spec)
            self.nodes[spec.node_id] = node
            for engine in node.engines:
                if engine.engine_id in self.engines:
                    raise InvalidTopologyError(f"engine id {engine.engine_id} repeats")
                self.engines[engine.engine_id] = engine
        self.prefill_nodes = tuple(n for n in self.nodes.values() if n.role is Role.PREFILL)
        self.decode_nodes = tuple(n for n in self.nodes.values() if n.role is Role.DECODE)
        if not self.prefill_nodes or not self.decode_nodes:
            raise InvalidTopologyError("a cluster needs at least one prefill and one decode node")
        self.prefill_engines = tuple(e for n in self.prefill_nodes for e in n.engines)
        self.decode_engines = tuple(e for n in self.decode_nodes for e in n.engines)
        self.max_decode_hbm_tokens = max(e.hbm_tokens for e in self.decode_engines)
        # Sorted views for the policies, kept current by _charge (see index.py).
        engines, by_node = self.engines, self.nodes
        self.prefill_index = LazyIndex((e.engine_id for e in self.prefill_engines), lambda m: engines[m].tok)
        self.decode_index = LazyIndex((e.engine_id for e in self.decode_engines), lambda m: engines[m].tok)
        self.decode_group_index = LazyIndex((n.node_id for n in self.decode_nodes), lambda m: by_node[m].tok_sum)
        # by decode node, the most free HBM of one of its engines (negated: a min-index): the
        # cluster's most is its top, and a node's eight engines change it with one flush entry
        self.decode_free_index = LazyIndex((n.node_id for n in self.decode_nodes), lambda m: -_most_free(by_node[m]))
        self._prefill_dirty = self.prefill_index.marker()
        self._decode_dirty = self.decode_index.marker()
        self._group_dirty = self.decode_group_index.marker()
        self._free_dirty = self.decode_free_index.marker()
        self.assigned_total = 0  # decisions ever applied; round robin's cursor
        self._live: dict[int, _Live] = {}

    @classmethod
    def from_topology(cls, *, prefill_nodes: int, decode_nodes: int, gpus_per_node: int = 8, decode_hbm_tokens: int) -> ClusterState:
        """Build ``prefill_nodes`` PE nodes then ``decode_nodes`` DE nodes of
        ``gpus_per_node`` engines each, numbered densely from 0 (nodes and engines).

        Raises:
            InvalidTopologyError: on a count below one or a non-positive HBM capacity.
        """
        if min(prefill_nodes, decode_nodes, gpus_per_node) < 1:
            raise InvalidTopologyError("node and GPU counts must be at least 1")
        specs = []
        for node_id in range(prefill_nodes + decode_nodes):
            role = Role.PREFILL if node_id < prefill_nodes else Role.DECODE
            first = node_id * gpus_per_node
            specs.append(
                NodeSpec(
                    node_id=node_id,
                    role=role,
                    engine_ids=tuple(range(first, first + gpus_per_node)),
                    hbm_tokens=decode_hbm_tokens if role is Role.DECODE else 0,
                )
            )
        return cls(specs)

    # -- decisions and completions -------------------------------------------------
    def on_assigned(self, a: Assignment) -> None:
        """Apply a decision: charge the PE, the DE (tokens, one sequence, HBM) and the
        read node's queue.

        Raises:
            DuplicateRequestError: the request is already live.
            UnknownEngineError, UnknownNodeError: an id is not in the cluster.
            RoleMismatchError: the PE is not a prefill engine or the DE not a decode one.
            InsufficientHbmError: the DE no longer has room (a stale decision).
        """
        if a.request_id in self._live:
            raise DuplicateRequestError(a.request_id)
        pe, de = self._engine(a.prefill_engine), self._engine(a.decode_engine)
        if pe.role is _DECODE:
            raise RoleMismatchError(pe.engine_id, "prefill")
        if de.role is not _DECODE:
            raise RoleMismatchError(de.engine_id, "decode")
        read_node = self.nodes.get(a.read_node)
        if read_node is None:
            raise UnknownNodeError(a.read_node)
        if de.free_hbm_tokens < a.decode_tokens:
            raise InsufficientHbmError(de.engine_id, a.decode_tokens, de.free_hbm_tokens)
        self._charge(pe, 1, a.prefill_tokens)
        self._charge(de, 1, a.decode_tokens)
        de.free_hbm_tokens -= a.decode_tokens
        self._free_dirty(de.node_id)
        read_node.read_q += a.read_tokens
        read_node.reads_open += a.read_tokens
        self.assigned_total += 1
        self._live[a.request_id] = _Live(a)

    def on_read_finished(self, request_id: int) -> None:
        """The request's hit tokens are read: take them off the read node's queue.
        Idempotent per request.

        Raises:
            UnknownRequestError: the request is not live.
        """
        self._release_read(self._get(request_id))

    def on_prefill_finished(self, request_id: int) -> None:
        """The prefill is done: release the PE's charge (and the read, which precedes it).
        Idempotent per request.

        Raises:
            UnknownRequestError: the request is not live.
        """
        live = self._get(request_id)
        self._release_read(live)
        self._release_prefill(live)

    def on_finished(self, request_id: int) -> None:
        """The request left the cluster (decode done, aborted or failed): release every
        charge still held and forget it.

        Raises:
            UnknownRequestError: the request is not live.
        """
        live = self._live.pop(request_id, None)
        if live is None:
            raise UnknownRequestError(request_id)
        self._release_read(live)
        self._release_prefill(live)
        a = live.assignment
        de = self.engines[a.decode_engine]
        self._charge(de, -1, -a.decode_tokens)
        free = de.free_hbm_tokens + a.decode_tokens
        de.free_hbm_tokens = free if free < de.hbm_tokens else de.hbm_tokens
        self._free_dirty(de.node_id)

    def _release_read(self, live: _Live) -> None:
        if live.read_pending:
            live.read_pending = False
            node = self.nodes[live.assignment.read_node]
            q = node.read_q - live.assignment.read_tokens
            node.read_q = q if q > 0 else 0
            q = node.reads_open - live.assignment.read_tokens
            node.reads_open = q if q > 0 else 0

    def _release_prefill(self, live: _Live) -> None:
        if live.prefill_pending:
            live.prefill_pending = False
            a = live.assignment
            self._charge(self.engines[a.prefill_engine], -1, -a.prefill_tokens)

    # -- reports from group leaders ------------------------------------------------
    def report_engine(self, engine_id: int, seq: int, tok: int, free_hbm_tokens: int | None = None) -> None:
        """Overwrite an engine's counters with what its group leader reported.

        Raises:
            UnknownEngineError: no such engine.
        """
        engine = self.engines.get(engine_id)
        if engine is None:
            raise UnknownEngineError(engine_id)
        engine.seq = seq if seq > 0 else 0
        if free_hbm_tokens is not None:
            free = max(0, min(engine.hbm_tokens, free_hbm_tokens))
            if free != engine.free_hbm_tokens and engine.role is _DECODE:
                self._free_dirty(engine.node_id)
            engine.free_hbm_tokens = free
        if tok < 0:
            tok = 0
        old = engine.tok
        if tok != old:  # _charge's index upkeep, inlined: engines report 5 times a second each
            engine.tok = tok
            node_id = engine.node_id
            self.nodes[node_id].tok_sum += tok - old
            if engine.role is _DECODE:
                self._decode_dirty(engine_id)
                self._group_dirty(node_id)
            else:
                self._prefill_dirty(engine_id)

    def report_node(self, node_id: int, *, read_q: int) -> None:
        """Overwrite a node's storage read queue (tokens) with its traffic manager's figure.

        Raises:
            UnknownNodeError: no such node.
        """
        node = self.nodes.get(node_id)
        if node is None:
            raise UnknownNodeError(node_id)
        node.read_q = max(0, read_q)

    def report_buffer(self, node_id: int, *, free_blocks: int, total_blocks: int) -> None:
        """Set a node's DRAM buffer figures in Full Blocks (free, clamped at zero, and total;
        a negative total: unknown, never checked).

        Raises:
            UnknownNodeError: no such node.
        """
        node = self.nodes.get(node_id)
        if node is None:
            raise UnknownNodeError(node_id)
        if total_blocks < 0:
            node.buffer_free = node.buffer_blocks = -1
        else:
            node.buffer_free, node.buffer_blocks = (free_blocks if free_blocks > 0 else 0), total_blocks

    # -- direct adjustments (the scheduler core's ledger) ------------------------------
    def adjust_engine(self, engine_id: int, seq: int, tok: int, free_hbm_tokens: int = 0) -> None:
        """Add to an engine's figures (clamped like completions: ``seq``/``tok`` at zero, free
        HBM within ``[0, hbm_tokens]``). The scheduler core charges and releases through
        this, without the per-request bookkeeping of ``on_assigned``.

        Raises:
            UnknownEngineError: no such engine.
        """
        engine = self.engines.get(engine_id)
        if engine is None:
            raise UnknownEngineError(engine_id)
        self._charge(engine, seq, tok)
        if free_hbm_tokens:
            free = engine.free_hbm_tokens + free_hbm_tokens
            engine.free_hbm_tokens = 0 if free < 0 else (free if free < engine.hbm_tokens else engine.hbm_tokens)
            if engine.role is _DECODE:
                self._free_dirty(engine.node_id)

    def adjust_read_q(self, node_id: int, tokens: int) -> None:
        """Add ``tokens`` (negative: remove) to a node's read queue, clamped at zero.

        Raises:
            UnknownNodeError: no such node.
        """
        node = self.nodes.get(node_id)
        if node is None:
            raise UnknownNodeError(node_id)
        q = node.read_q + tokens
        node.read_q = q if q > 0 else 0

    def adjust_reads_open(self, node_id: int, tokens: int) -> None:
        """Add ``tokens`` (negative: remove) to a node's open reads, clamped at zero.

        Raises:
            UnknownNodeError: no such node.
        """
        node = self.nodes.get(node_id)
        if node is None:
            raise UnknownNodeError(node_id)
        q = node.reads_open + tokens
        node.reads_open = q if q > 0 else 0

    # -- queries -------------------------------------------------------------------
    def live_assignment(self, request_id: int) -> Assignment:
        """The decision a live request was placed with.

        Raises:
            UnknownRequestError: the request is not live.
        """
        return self._get(request_id).assignment

    def max_decode_free(self) -> int:
        """The most free HBM (tokens) of any one decode engine: a request that needs more
        fits nowhere now."""
        top = self.decode_free_index.top()
        return -top[0] if top is not None else 0

    @property
    def live_count(self) -> int:
        """Requests assigned and not yet finished."""
        return len(self._live)

    def _engine(self, engine_id: int) -> EngineState:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise UnknownEngineError(engine_id)
        return engine

    def _get(self, request_id: int) -> _Live:
        live = self._live.get(request_id)
        if live is None:
            raise UnknownRequestError(request_id)
        return live

    def _charge(self, engine: EngineState, seq: int, tok: int) -> None:
        """Add ``seq``/``tok`` to an engine (clamped at zero, see the module docstring) and
        keep its node's ``tok_sum`` and the sorted views current."""
        s = engine.seq + seq
        engine.seq = s if s > 0 else 0
        t = engine.tok + tok
        if t < 0:
            t = 0
        if t == engine.tok:
            return
        self.nodes[engine.node_id].tok_sum += t - engine.tok
        engine.tok = t
        if engine.role is _DECODE:
            self._decode_dirty(engine.engine_id)
            self._group_dirty(engine.node_id)
        else:
            self._prefill_dirty(engine.engine_id)
