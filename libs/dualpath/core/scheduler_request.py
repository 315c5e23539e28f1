"""What the scheduler core keeps per request: its record (``CoreRequest``: stage, attempt,
placement and the charges it holds) and the newest submission seen of each (``Submissions``).

Stages: ``QUEUED`` (waiting to be placed), ``RESERVING`` (its decode node's slot asked for),
``DISPATCHING`` (sent to its prefill engine), ``RUNNING`` (accepted; prefilling, then decoding).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from dualpath.core.scheduler_events import Decision
from dualpath.core.scheduler_members import Charge, EngineMember, NodeMember
from dualpath.core.scheduler_queue import Queued
from dualpath.policy import PendingRequest
from dualpath.policy.values import ReadSide

__all__ = ["DISPATCHING", "QUEUED", "RESERVING", "RUNNING", "CoreRequest", "Submissions"]

# CoreRequest.stage
QUEUED: Final = 0
RESERVING: Final = 1
DISPATCHING: Final = 2
RUNNING: Final = 3


class CoreRequest(Queued):
    """One request the core knows (queued or placed)."""

    __slots__ = (
        "attempt",
        "blocks",
        "buffer_waits",
        "de",
        "de_charge",
        "decision",
        "num",
        "open_reads",
        "payload",
        "pe",
        "pe_charge",
        "pending",
        "prefill_done",
        "prefill_done_at",
        "queued_since",
        "read_charge",
        "read_side",
        "rid",
        "session",
        "slot_charge",
        "submission",
        "split_charge",
        "stage",
        "wait_start",
    )

    def __init__(self, rid: str, num: int, pending: PendingRequest, blocks: int, payload: object, now: float) -> None:
        self.rid, self.num, self.pending, self.blocks, self.payload = rid, num, pending, blocks, payload
        self.attempt = self.buffer_waits = 0
        self.wait_start = -1.0  # now of the first back-pressure (-1: none yet)
        super().__init__(now)
        self.queued_since = now
        self.open_reads: tuple[tuple[NodeMember, int], ...] = ()  # (node, hit tokens) of its reads until its prefill ends
        self.stage = QUEUED
        self.pe: EngineMember | None = None
        self.de: EngineMember | None = None
        self.pe_charge: Charge | None = None
        self.de_charge: Charge | None = None
        self.read_charge: Charge | None = None
        self.split_charge: Charge | None = None  # a split read's DE share (policy.split)
        self.slot_charge: Charge | None = None  # its slot in the decode node's buffer (bytes, as hbm)
        self.session = ""  # the agent session (prefetch)
        self.submission = 0  # the gateway's n-th submit of it: offsets its attempts on the wire
        self.read_side: ReadSide | None = None
        self.prefill_done = False
        self.prefill_done_at = -1.0  # now of the prefill engine's hand-off (DecodeHistory measures from it)
        self.decision: Decision | None = None


class Submissions:
    """The newest submission accepted of each request, for the ``limit`` requests seen last
    (the oldest is forgotten first): a submission no newer than it is a late copy."""

    __slots__ = ("_newest", "limit")

    def __init__(self, limit: int = 65536) -> None:
        self._newest: OrderedDict[str, int] = OrderedDict()
        self.limit = limit

    def newest(self, request_id: str) -> int:
        """The newest submission accepted of ``request_id`` (-1: none remembered)."""
        return self._newest.get(request_id, -1)

    def accept(self, request_id: str, submission: int) -> None:
        self._newest[request_id] = submission
        self._newest.move_to_end(request_id)
        if len(self._newest) > self.limit:
            self._newest.popitem(last=False)
