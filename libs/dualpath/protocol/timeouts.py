"""How long each bus request waits for its answer: one table, next to the subjects.

Every ``Bus.request`` names its timeout from ``TIMEOUTS`` (a test checks that no call passes a
number of its own), so a reader sees in one place what each service is willing to wait for and
why. The values are upper bounds on a healthy answer, not expected latencies: a request that
runs past one is treated by its caller as "nobody answered" (``BusTimeoutError``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TIMEOUTS", "BusTimeouts"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BusTimeouts:
    """Seconds a requester waits on each endpoint (see ``dualpath.protocol.subjects.Subjects``)."""

    # kv-persistence: index calls are in-memory, commits append one fsync'ed log line.
    # A lookup past this is served as a full recompute; that costs far more than waiting (a 32K-token
    # prefill), and a loaded host (the 2-core testbed) delays the index process by seconds at times.
    kv_lookup: float = 5.0
    kv_commit: float = 10.0
    kv_remove: float = 5.0
    # scheduler: submit only enqueues; state is a snapshot.
    submit: float = 5.0
    sched_state: float = 2.0
    # traffic manager of one node.
    tm_alloc: float = 5.0
    tm_free: float = 2.0  # a free is instant; the scheduler frees slots on nodes that may have died
    tm_load: float = 120.0  # a whole prompt's hit KV read from storage, behind the node's read queue (read_q)
    tm_probe: float = 2.0  # "do you still run this load?" (in memory); unanswered for 3 probes in a row, the load is given up
    tm_persist: float = 60.0  # blocks written to storage (fsync'ed files), then committed to the index
    # engines: a dispatch is acknowledged once the engine has queued the task.
    prefill_dispatch: float = 5.0
    decode_dispatch: float = 10.0  # the decode engine may be busy with a step when the handoff arrives


TIMEOUTS = BusTimeouts()
