"""Every NATS subject DualPath uses, built in one place.

Scheme (after Dynamo's ``namespace.{ns}.component.{comp}.{topic}``): ``{ns}.{component}.{topic}``
for deployment-wide services and ``{ns}.{component}.{instance}.{topic}`` for addressed ones.
Instance ids are restricted to ``[A-Za-z0-9_-]`` so they cannot inject subject tokens.
"""

from __future__ import annotations

import re

__all__ = [
    "DEFAULT_NAMESPACE",
    "Subjects",
    "check_id",
]

DEFAULT_NAMESPACE = "dualpath"
_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is safe inside a subject; raise ValueError otherwise."""
    if not _ID.match(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]{{1,128}}")
    return value


class Subjects:
    """Subject names for one namespace (one deployment on a shared NATS)."""

    __slots__ = ("ns",)

    def __init__(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.ns = check_id(namespace, "namespace")

    # kv-persistence (shardable: one queue group)
    @property
    def kv_lookup(self) -> str:
        return f"{self.ns}.kvp.lookup"

    @property
    def kv_commit(self) -> str:
        return f"{self.ns}.kvp.commit"

    @property
    def kv_remove(self) -> str:
        return f"{self.ns}.kvp.remove"

    @property
    def kv_log(self) -> str:
        """JetStream subject of the replicated index's records (``dualpath.ha.replicated_index``)."""
        return f"{self.ns}.kvp.log"

    @property
    def sched_leader(self) -> str:
        """JetStream key-value bucket of the scheduler's leadership lease (bucket names take no dots)."""
        return f"{self.ns}_sched_leader"

    @property
    def responses(self) -> str:
        """JetStream key-value bucket of the gateways' stored ``/v1/responses`` answers."""
        return f"{self.ns}_responses"

    # scheduler
    @property
    def submit(self) -> str:
        return f"{self.ns}.sched.submit"

    @property
    def engine_report(self) -> str:
        return f"{self.ns}.sched.engine_report"

    @property
    def node_report(self) -> str:
        return f"{self.ns}.sched.node_report"

    @property
    def task_failed(self) -> str:
        return f"{self.ns}.sched.task_failed"

    @property
    def sched_state(self) -> str:
        return f"{self.ns}.sched.state"

    @property
    def sched_alive(self) -> str:
        """The active scheduler's heartbeat (its instance: gateways resubmit when it changes)."""
        return f"{self.ns}.sched.alive"

    @property
    def engine_lost(self) -> str:
        """The active scheduler's notice that it stopped using an engine (``EngineLost``)."""
        return f"{self.ns}.sched.engine_lost"

    @property
    def cancel(self) -> str:
        return f"{self.ns}.ctl.cancel"

    # traffic manager of one node
    def tm(self, node_id: str, topic: str) -> str:
        """``alloc``, ``free``, ``load``, ``persist``, ``describe``, ``claim``, ``prefetch``, ``probe`` of one node's traffic manager."""
        return f"{self.ns}.tm.{check_id(node_id, 'node id')}.{topic}"

    def tm_every_node(self, topic: str) -> str:
        """``topic`` of every node's traffic manager (a subscription wildcard)."""
        return f"{self.ns}.tm.*.{topic}"

    # engines
    def prefill(self, engine_id: str) -> str:
        return f"{self.ns}.engine.{check_id(engine_id, 'engine id')}.prefill"

    def decode(self, engine_id: str) -> str:
        return f"{self.ns}.engine.{check_id(engine_id, 'engine id')}.decode"

    # token stream of one request, consumed by the gateway that submitted it
    def tokens(self, gateway_id: str, request_id: str) -> str:
        return f"{self.ns}.out.{check_id(gateway_id, 'gateway id')}.{check_id(request_id, 'request id')}"

    def tokens_wildcard(self, gateway_id: str) -> str:
        return f"{self.ns}.out.{check_id(gateway_id, 'gateway id')}.*"
