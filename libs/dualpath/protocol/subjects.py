"""Every NATS subject DualPath uses, and who may publish and subscribe to each: one table.

Scheme (after Dynamo's ``namespace.{ns}.component.{comp}.{topic}``): ``{ns}.{component}.{topic}``
for deployment-wide services and ``{ns}.{component}.{instance}.{topic}`` for addressed ones.
Instance ids are restricted to ``[A-Za-z0-9_-]`` so they cannot inject subject tokens.

``RULES`` names, for every subject of ``Subjects``, its pattern and the roles that publish and
subscribe to it; ``STORES`` does the same for the JetStream streams and buckets. The NATS
server's per-identity permissions are derived from these two tables (``dualpath.bus.auth``), so
a subject without a rule cannot be used by any service once authorization is on, and a test
checks that every subject has one. A rule's scope says how far a role reaches: ``ANY`` instance,
or only its ``OWN`` (the pattern's id fields filled with the identity's own engine, node or
gateway id). Reports carry their sender in the subject, so an engine can publish only its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

__all__ = [
    "DEFAULT_NAMESPACE",
    "RULES",
    "STORES",
    "TM_TOPICS",
    "Role",
    "Rule",
    "Scope",
    "Store",
    "Subjects",
    "check_id",
    "sender_of",
]

DEFAULT_NAMESPACE = "dualpath"
_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is safe inside a subject; raise ValueError otherwise."""
    if not _ID.match(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]{{1,128}}")
    return value


class Role(StrEnum):
    """What a NATS identity is: each service process connects as one identity of its role."""

    GATEWAY = "gateway"
    SCHEDULER = "scheduler"
    PREFILL = "prefill"
    DECODE = "decode"
    TRAFFIC_MANAGER = "traffic-manager"
    KV_PERSISTENCE = "kv-persistence"
    OBSERVER = "observer"  # read-only tools: the experiments' report sampler, dashboards


class Scope(StrEnum):
    ANY = "any"  # every instance: the pattern's id fields are wildcards
    OWN = "own"  # the identity's own instance: id fields it has are filled with its ids


@dataclass(frozen=True, slots=True)
class Rule:
    """One subject: its pattern (``{ns}`` and id fields in braces) and who may use it."""

    pattern: str
    publish: Mapping[Role, Scope]
    subscribe: Mapping[Role, Scope]


@dataclass(frozen=True, slots=True)
class Store:
    """One JetStream resource: a stream, a key-value bucket or an object store, and its owners."""

    name: str  # the stream's or bucket's name pattern (``{ns}`` filled; no dots)
    kind: str  # "stream" | "kv" | "object"
    owners: frozenset[Role]
    subject: str = ""  # a stream's own subject pattern (kv and object stores have theirs from the name)


_P, _D = Role.PREFILL, Role.DECODE
_ANY, _OWN = Scope.ANY, Scope.OWN


def _rule(pattern: str, publish: dict[Role, Scope], subscribe: dict[Role, Scope]) -> Rule:
    return Rule(pattern, MappingProxyType(publish), MappingProxyType(subscribe))


# Topics of one node's traffic manager (``Subjects.tm``): who asks it what. The traffic manager
# serves its own node's topics only.
_TM_SUB = {Role.TRAFFIC_MANAGER: _OWN}
TM_TOPICS: Mapping[str, Rule] = MappingProxyType(
    {
        "alloc": _rule("{ns}.tm.{node}.alloc", {Role.SCHEDULER: _ANY, _D: _OWN}, _TM_SUB),
        "free": _rule("{ns}.tm.{node}.free", {Role.SCHEDULER: _ANY, _P: _OWN, _D: _OWN}, _TM_SUB),
        "load": _rule("{ns}.tm.{node}.load", {_P: _ANY}, _TM_SUB),  # a DE read asks a decode node's TM
        "persist": _rule("{ns}.tm.{node}.persist", {_D: _OWN}, _TM_SUB),
        "describe": _rule("{ns}.tm.{node}.describe", {_P: _ANY, _D: _ANY}, _TM_SUB),
        "claim": _rule("{ns}.tm.{node}.claim", {_D: _OWN}, _TM_SUB),
        "prefetch": _rule("{ns}.tm.{node}.prefetch", {Role.SCHEDULER: _ANY}, _TM_SUB),
        "probe": _rule("{ns}.tm.{node}.probe", {_P: _ANY}, _TM_SUB),
    }
)

# Every subject of ``Subjects`` by attribute name (``tm`` and ``tm_every_node``: see TM_TOPICS).
RULES: Mapping[str, Rule] = MappingProxyType(
    {
        "kv_lookup": _rule("{ns}.kvp.lookup", {Role.GATEWAY: _ANY}, {Role.KV_PERSISTENCE: _ANY}),
        "kv_commit": _rule("{ns}.kvp.commit", {Role.TRAFFIC_MANAGER: _ANY}, {Role.KV_PERSISTENCE: _ANY}),
        "kv_remove": _rule("{ns}.kvp.remove", {Role.TRAFFIC_MANAGER: _ANY}, {Role.KV_PERSISTENCE: _ANY}),
        "kv_log": _rule("{ns}.kvp.log", {Role.KV_PERSISTENCE: _ANY}, {Role.KV_PERSISTENCE: _ANY}),
        "submit": _rule("{ns}.sched.submit", {Role.GATEWAY: _ANY}, {Role.SCHEDULER: _ANY}),
        "engine_report": _rule("{ns}.sched.engine_report.{engine}", {_P: _OWN, _D: _OWN}, {Role.SCHEDULER: _ANY, Role.OBSERVER: _ANY}),
        "node_report": _rule("{ns}.sched.node_report.{node}", {Role.TRAFFIC_MANAGER: _OWN}, {Role.SCHEDULER: _ANY, Role.OBSERVER: _ANY}),
        "task_failed": _rule("{ns}.sched.task_failed.{engine}", {_P: _OWN, _D: _OWN}, {Role.SCHEDULER: _ANY}),
        "sched_state": _rule("{ns}.sched.state", {Role.GATEWAY: _ANY, Role.OBSERVER: _ANY}, {Role.SCHEDULER: _ANY}),
        "sched_alive": _rule("{ns}.sched.alive", {Role.SCHEDULER: _ANY}, {Role.GATEWAY: _ANY, Role.TRAFFIC_MANAGER: _ANY}),
        "engine_lost": _rule("{ns}.sched.engine_lost", {Role.SCHEDULER: _ANY}, {Role.GATEWAY: _ANY}),
        "cancel": _rule("{ns}.ctl.cancel", {Role.GATEWAY: _ANY, Role.SCHEDULER: _ANY}, {_P: _ANY, _D: _ANY}),
        "prefill": _rule("{ns}.engine.{engine}.prefill", {Role.SCHEDULER: _ANY}, {_P: _OWN}),
        "decode": _rule("{ns}.engine.{engine}.decode", {_P: _ANY}, {_D: _OWN}),
        # Token streams: any engine (and the scheduler, for a request it fails) may publish to a
        # gateway's stream, since NATS cannot tie a publisher to one request; only that gateway reads it.
        "tokens": _rule("{ns}.out.{gateway}.{request}", {Role.SCHEDULER: _ANY, _P: _ANY, _D: _ANY}, {Role.GATEWAY: _OWN}),
    }
)

# JetStream resources, by ``Subjects`` attribute name.
STORES: Mapping[str, Store] = MappingProxyType(
    {
        "kv_index": Store("{ns}_kvindex", "stream", frozenset({Role.KV_PERSISTENCE}), subject="{ns}.kvp.log"),
        "kv_index_snapshots": Store("{ns}_kvindex_snap", "object", frozenset({Role.KV_PERSISTENCE})),
        "kv_index_compact": Store("{ns}_kvindex_compact", "kv", frozenset({Role.KV_PERSISTENCE})),
        "sched_leader": Store("{ns}_sched_leader", "kv", frozenset({Role.SCHEDULER})),
        "responses": Store("{ns}_responses", "kv", frozenset({Role.GATEWAY})),
    }
)

# Attributes of ``Subjects`` that are not subjects of their own.
_DERIVED = frozenset({"ns", "tm", "tm_every_node", "tokens_wildcard", "engine_reports", "node_reports", "task_failures"})


def sender_of(subject: str) -> str:
    """The sender id a report subject ends with (``engine_report``, ``node_report``, ``task_failed``)."""
    return subject.rsplit(".", 1)[-1]


class Subjects:
    """Subject names for one namespace (one deployment on a shared NATS)."""

    __slots__ = ("ns",)

    def __init__(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.ns = check_id(namespace, "namespace")

    def _fill(self, table: Mapping[str, Rule], key: str, **ids: str) -> str:
        return table[key].pattern.format(ns=self.ns, **{k: check_id(v, f"{k} id") for k, v in ids.items()})

    def _wild(self, key: str) -> str:
        """``key``'s subject with every id field a wildcard (a subscription of all senders)."""
        fields = re.findall(r"{(\w+)}", RULES[key].pattern)
        return RULES[key].pattern.format(**{f: "*" for f in fields if f != "ns"}, ns=self.ns)

    # kv-persistence (shardable: one queue group)
    @property
    def kv_lookup(self) -> str:
        return self._fill(RULES, "kv_lookup")

    @property
    def kv_commit(self) -> str:
        return self._fill(RULES, "kv_commit")

    @property
    def kv_remove(self) -> str:
        return self._fill(RULES, "kv_remove")

    @property
    def kv_log(self) -> str:
        """JetStream subject of the replicated index's records (``dualpath.ha.replicated_index``)."""
        return self._fill(RULES, "kv_log")

    @property
    def kv_index(self) -> str:
        """JetStream stream of the replicated index (stream names may not contain dots)."""
        return STORES["kv_index"].name.format(ns=self.ns)

    @property
    def kv_index_snapshots(self) -> str:
        """Object store bucket of the replicated index's snapshots."""
        return STORES["kv_index_snapshots"].name.format(ns=self.ns)

    @property
    def kv_index_compact(self) -> str:
        """Key-value bucket of the lease that lets one replica at a time compact the index."""
        return STORES["kv_index_compact"].name.format(ns=self.ns)

    @property
    def sched_leader(self) -> str:
        """JetStream key-value bucket of the scheduler's leadership lease (bucket names take no dots)."""
        return STORES["sched_leader"].name.format(ns=self.ns)

    @property
    def responses(self) -> str:
        """JetStream key-value bucket of the gateways' stored ``/v1/responses`` answers."""
        return STORES["responses"].name.format(ns=self.ns)

    # scheduler
    @property
    def submit(self) -> str:
        return self._fill(RULES, "submit")

    def engine_report(self, engine_id: str) -> str:
        """Where engine ``engine_id`` publishes its ``EngineReport`` (its heartbeat)."""
        return self._fill(RULES, "engine_report", engine=engine_id)

    @property
    def engine_reports(self) -> str:
        """Every engine's reports (a subscription wildcard)."""
        return self._wild("engine_report")

    def node_report(self, node_id: str) -> str:
        """Where node ``node_id``'s traffic manager publishes its ``NodeReport``."""
        return self._fill(RULES, "node_report", node=node_id)

    @property
    def node_reports(self) -> str:
        """Every node's reports (a subscription wildcard)."""
        return self._wild("node_report")

    def task_failed(self, engine_id: str) -> str:
        """Where engine ``engine_id`` reports a task it could not run (``TaskFailed``)."""
        return self._fill(RULES, "task_failed", engine=engine_id)

    @property
    def task_failures(self) -> str:
        """Every engine's ``TaskFailed`` (a subscription wildcard)."""
        return self._wild("task_failed")

    @property
    def sched_state(self) -> str:
        return self._fill(RULES, "sched_state")

    @property
    def sched_alive(self) -> str:
        """The active scheduler's heartbeat (its instance: gateways resubmit when it changes)."""
        return self._fill(RULES, "sched_alive")

    @property
    def engine_lost(self) -> str:
        """The active scheduler's notice that it stopped using an engine (``EngineLost``)."""
        return self._fill(RULES, "engine_lost")

    @property
    def cancel(self) -> str:
        return self._fill(RULES, "cancel")

    # traffic manager of one node
    @staticmethod
    def _tm_rule(topic: str) -> Rule:
        if topic not in TM_TOPICS:
            raise ValueError(f"unknown traffic-manager topic {topic!r}; known: {', '.join(TM_TOPICS)}")
        return TM_TOPICS[topic]

    def tm(self, node_id: str, topic: str) -> str:
        """``topic`` (a key of ``TM_TOPICS``) of one node's traffic manager.

        Raises:
            ValueError: an unknown topic (a new one needs its rule in ``TM_TOPICS`` first).
        """
        return self._tm_rule(topic).pattern.format(ns=self.ns, node=check_id(node_id, "node id"))

    def tm_every_node(self, topic: str) -> str:
        """``topic`` of every node's traffic manager (a subscription wildcard)."""
        return self._tm_rule(topic).pattern.format(ns=self.ns, node="*")

    # engines
    def prefill(self, engine_id: str) -> str:
        return self._fill(RULES, "prefill", engine=engine_id)

    def decode(self, engine_id: str) -> str:
        return self._fill(RULES, "decode", engine=engine_id)

    # token stream of one request, consumed by the gateway that submitted it
    def tokens(self, gateway_id: str, request_id: str) -> str:
        return self._fill(RULES, "tokens", gateway=gateway_id, request=request_id)

    def tokens_wildcard(self, gateway_id: str) -> str:
        return RULES["tokens"].pattern.format(ns=self.ns, gateway=check_id(gateway_id, "gateway id"), request="*")


def unruled_attributes() -> list[str]:
    """Public attributes of ``Subjects`` that are neither in ``RULES`` nor ``STORES`` nor derived
    from one of them (a test asserts this is empty)."""
    names = [n for n in dir(Subjects) if not n.startswith("_")]
    return [n for n in names if n not in RULES and n not in STORES and n not in _DERIVED]
