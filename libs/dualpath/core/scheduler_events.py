"""What goes into the scheduler core (events) and what comes out (commands).

Every event carries ``now``: the driver's clock in seconds (monotonic time in the service,
virtual time in the simulator). The core keeps no clock of its own; it compares ``now``
values only with each other (engine expiry, back-pressure pauses, queue waits).

Events (driver -> core)::

    RequestSubmitted   a request enters the queue (gateway submit)
    EngineReported     an engine's periodic report: seq_e, tok_e, free HBM, finished requests
    NodeReported       a traffic manager's periodic report: read_q, free DRAM buffer
    SlotReserved       the decode node answered ReserveSlot: the DE buffer slot exists
    DispatchAnswered   the prefill engine accepted a Dispatch
    DispatchFailed     ReserveSlot or Dispatch failed (code 507 = buffer full: back-pressure;
                       ``unreachable`` = an engine that did not answer)
    TaskFailed         an engine gave up on a request it held
    EngineLost         an engine is gone (the driver knows it outside any one request)
    NodeLost           a node's traffic manager is gone (likewise)
    RequestFinished    an engine finished its part of a request (prefill or decode); the same
                       as the request appearing in that engine's report's ``finished``
    TimeAdvanced       the clock moved: expire silent engines, run a scheduling pass

Commands (core -> driver)::

    RejectRequest      answer the submit with an error (400, 409, 429); nothing was queued
    ReserveSlot        reserve the request's DE buffer slot on the decode node
    Dispatch           send the task to the prefill engine (it names the decode engine too)
    FreeSlot           release a DE buffer slot (re-queued or stale attempt)
    FailRequest        tell the request's client it failed (reason and code); the core forgot it
    ExpelEngine        the core stopped using an engine (silent, unreachable, lost or restarted):
                       announce it (gateways resubmit what it served)
    Requeued           a placed request went back to the head of the queue; for logs/spans
    StopAttempts       tell engines to drop every run of a request below an attempt, silently
    Prefetch           a session's turn ended: hint its blocks to a node's prefetch cache (lowest priority)

Attempts: each placement of a request is one ``attempt`` (0, 1, ...). Answers carry the
attempt they answer; an answer for an older attempt is *stale* and is handled as such (a
stale slot is freed, a stale failure ignored). Engines and traffic managers number attempts
across scheduler failovers: a request's ``submission`` (the gateway's n-th submit of it)
offsets them, ``wire_attempt(submission, attempt)``, so a scheduler that took over (counting
from 0 again) never reuses a number of the one that died. Commands that reach them carry
that number (``wire_attempt``, ``wire_before``); what engines report (``finished_attempts``,
``holding_attempts``, ``TaskFailed.attempt``) is in it too, and the core maps it back (an
attempt of another submission is late). With submission 0 both numberings are the same.

The types are slotted, keyword-only dataclasses and hold no I/O objects; ``payload`` and
``region`` are opaque to the core (the driver's own request and region descriptor, handed
back unchanged). Treat them as immutable. They are not ``frozen`` on purpose: a frozen
dataclass sets each field through ``object.__setattr__`` and costs ~2.5x as much to build,
and at 10,000 GPUs the driver builds ~75,000 events and the core ~36,000 commands a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

from dualpath.policy.values import ReadSide, Role
from dualpath.protocol.messages import ALL_ATTEMPTS, SUBMISSION_ATTEMPTS

__all__ = [
    "ALL_ATTEMPTS",
    "BUFFER_FULL",
    "Command",
    "Decision",
    "Dispatch",
    "DispatchAnswered",
    "DispatchFailed",
    "EngineLost",
    "EngineReported",
    "Event",
    "ExpelEngine",
    "FailRequest",
    "FreeSlot",
    "NodeLost",
    "NodeReported",
    "ReadSide",
    "RejectRequest",
    "RequestFinished",
    "RequestSubmitted",
    "Requeued",
    "ReserveSlot",
    "Role",
    "SlotReserved",
    "Stage",
    "StopAttempts",
    "TaskFailed",
    "TimeAdvanced",
    "core_attempt",
    "wire_attempt",
]

BUFFER_FULL: Final = 507  # DispatchFailed.code: a node buffer had no room now (back-pressure, not a failure)

_ev = {"slots": True, "kw_only": True}  # not frozen: see the module docstring


def wire_attempt(submission: int, attempt: int) -> int:
    """A request's ``attempt`` here as engines and traffic managers number it."""
    return submission * SUBMISSION_ATTEMPTS + attempt


def core_attempt(submission: int, wire: int) -> int:
    """``wire_attempt``'s inverse: -1 for -1 (not said); an attempt of another submission maps
    past every attempt of this one (late, never current)."""
    if wire < 0:
        return -1
    attempt = wire - submission * SUBMISSION_ATTEMPTS
    return attempt if 0 <= attempt < SUBMISSION_ATTEMPTS else SUBMISSION_ATTEMPTS


class Stage(IntEnum):
    """Which step of a placement a ``DispatchFailed`` answers."""

    RESERVE = 0  # ReserveSlot
    DISPATCH = 1  # Dispatch


# --- events --------------------------------------------------------------------------------


# The hot dataclasses below spell out ``__init__`` (``init=False``): mypyc compiles a written
# ``__init__`` natively, ~15x faster than the one ``dataclasses`` generates (a simulated
# rollout builds tens of millions of these); fields, eq and repr stay the dataclass's.
@dataclass(**_ev, init=False)
class RequestSubmitted:
    """A request asks to be scheduled.

    ``hit_blocks`` × ``block_tokens`` leading prompt tokens are persisted (read, not
    computed, but never the block of the last prompt token: ``kv.hits.readable_hit_blocks``). ``forced_side`` forces the
    read side for this request (the API's ``dualpath_read_path``); None lets the policy
    choose (or its stack-wide ``read_path``). ``submission``: the gateway's n-th submit of
    the request (above 0: resubmitted after a scheduler failover); one no newer than a
    submission this core already ran to its end is refused (409: a late copy).
    """

    now: float
    request_id: str
    prompt_tokens: int
    hit_blocks: int = 0
    block_tokens: int = 64
    max_tokens: int = 16
    forced_side: ReadSide | None = None
    payload: Any = None
    session: str = ""  # the agent session the turn belongs to ("": unknown); prefetch stages its blocks
    submission: int = 0

    def __init__(
        self,
        *,
        now: float,
        request_id: str,
        prompt_tokens: int,
        hit_blocks: int = 0,
        block_tokens: int = 64,
        max_tokens: int = 16,
        forced_side: ReadSide | None = None,
        payload: Any = None,
        session: str = "",
        submission: int = 0,
    ) -> None:
        self.now = now
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.hit_blocks = hit_blocks
        self.block_tokens = block_tokens
        self.max_tokens = max_tokens
        self.forced_side = forced_side
        self.payload = payload
        self.session = session
        self.submission = submission


@dataclass(**_ev, init=False)
class EngineReported:
    """An engine's periodic report (also its heartbeat). ``seq``/``tok`` are the paper's
    seq_e/tok_e as the engine counts them; ``finished`` lists the requests it completed
    since its previous report (a prefill engine: handed to the decode engine), and
    ``finished_attempts`` the attempt of each, by position (empty: not said; a finish of an
    earlier attempt is late and changes nothing). A prefill engine may list every task it
    holds now (``holding``, with ``holding_attempts`` by position; None: not said): a
    prefill the core placed there that two such reports in a row leave out is lost (its
    ``TaskFailed`` never came) and retried. Attempts are wire attempts (module docstring).
    ``incarnation`` names the engine's process: a known engine reporting a new one restarted
    under its name, losing what it held, and is expelled before it joins again."""

    now: float
    engine: str
    node: str
    role: Role
    seq: int
    tok: int
    free_hbm_tokens: int = 0
    capacity_tokens: int = 0
    block_bytes: int = 0
    finished: tuple[str, ...] = ()
    finished_attempts: tuple[int, ...] = ()
    holding: tuple[str, ...] | None = None
    holding_attempts: tuple[int, ...] = ()
    incarnation: str = ""

    def __init__(
        self,
        *,
        now: float,
        engine: str,
        node: str,
        role: Role,
        seq: int,
        tok: int,
        free_hbm_tokens: int = 0,
        capacity_tokens: int = 0,
        block_bytes: int = 0,
        finished: tuple[str, ...] = (),
        finished_attempts: tuple[int, ...] = (),
        holding: tuple[str, ...] | None = None,
        holding_attempts: tuple[int, ...] = (),
        incarnation: str = "",
    ) -> None:
        self.now = now
        self.engine = engine
        self.node = node
        self.role = role
        self.seq = seq
        self.tok = tok
        self.free_hbm_tokens = free_hbm_tokens
        self.capacity_tokens = capacity_tokens
        self.block_bytes = block_bytes
        self.finished = finished
        self.finished_attempts = finished_attempts
        self.holding = holding
        self.holding_attempts = holding_attempts
        self.incarnation = incarnation


@dataclass(**_ev, init=False)
class NodeReported:
    """A traffic manager's periodic report: hit tokens queued on its storage NIC, and the
    free bytes of its DRAM buffer out of ``buffer_bytes`` (-1: not reported; the policy then
    does not check that node's buffer and a full one is found by back-pressure only)."""

    now: float
    node: str
    read_q_tokens: int
    buffer_free_bytes: int = -1
    buffer_bytes: int = 0

    def __init__(self, *, now: float, node: str, read_q_tokens: int, buffer_free_bytes: int = -1, buffer_bytes: int = 0) -> None:
        self.now = now
        self.node = node
        self.read_q_tokens = read_q_tokens
        self.buffer_free_bytes = buffer_free_bytes
        self.buffer_bytes = buffer_bytes


@dataclass(**_ev, init=False)
class SlotReserved:
    """The decode node reserved the slot asked for by ``ReserveSlot``."""

    now: float
    request_id: str
    attempt: int
    region: Any = None
    offset: int = 0

    def __init__(self, *, now: float, request_id: str, attempt: int, region: Any = None, offset: int = 0) -> None:
        self.now = now
        self.request_id = request_id
        self.attempt = attempt
        self.region = region
        self.offset = offset


@dataclass(**_ev, init=False)
class DispatchAnswered:
    """The prefill engine accepted the ``Dispatch`` of this attempt."""

    now: float
    request_id: str
    attempt: int

    def __init__(self, *, now: float, request_id: str, attempt: int) -> None:
        self.now = now
        self.request_id = request_id
        self.attempt = attempt


@dataclass(**_ev)
class DispatchFailed:
    """``ReserveSlot`` (stage RESERVE) or ``Dispatch`` (stage DISPATCH) failed.

    ``code`` is the answer's error code (``BUFFER_FULL`` = back-pressure; 0 = no answer);
    ``unreachable`` names an engine that did not answer at all (the core stops using it
    until it reports again); ``node_unreachable`` a node whose traffic manager nobody serves
    (the core stops using the node's engines until it reports again)."""

    now: float
    request_id: str
    attempt: int
    stage: Stage
    reason: str
    code: int = 0
    unreachable: str = ""
    node_unreachable: str = ""


@dataclass(**_ev)
class TaskFailed:
    """``engine`` gave up on a request it held; ``unreachable`` names an engine it could not
    reach, ``node_unreachable`` a node whose traffic manager died under the task (the node
    leaves scheduling until it reports again, before the retry is placed). ``attempt``: the
    wire attempt that failed (-1: not known); a failure of an earlier attempt is late and
    changes nothing (the engine may hold the current attempt too). ``abandoned``:
    the request needs nothing more from this scheduler (the decode engine refused the hand-off
    because it holds or ran a newer run, another scheduler's after a failover; or the client
    cancelled it during its prefill): it leaves, neither retried nor answered."""

    now: float
    request_id: str
    engine: str
    reason: str
    unreachable: str = ""
    attempt: int = -1
    abandoned: bool = False
    node_unreachable: str = ""


@dataclass(**_ev)
class EngineLost:
    """``engine`` is gone (its process restarted or died, as the driver learned outside any
    one request): the core stops using it and re-queues what it held."""

    now: float
    engine: str
    reason: str


@dataclass(**_ev)
class NodeLost:
    """``node``'s traffic manager is gone: its engines leave scheduling until it reports again
    (what they hold fails on its own)."""

    now: float
    node: str
    reason: str


@dataclass(**_ev, init=False)
class RequestFinished:
    """``engine`` finished its part of the request (as if listed in its report's ``finished``);
    ``attempt``: the attempt that finished (-1: not said)."""

    now: float
    request_id: str
    engine: str
    attempt: int = -1

    def __init__(self, *, now: float, request_id: str, engine: str, attempt: int = -1) -> None:
        self.now = now
        self.request_id = request_id
        self.engine = engine
        self.attempt = attempt


@dataclass(**_ev, init=False)
class TimeAdvanced:
    """The driver's clock reads ``now``: expire silent engines, then place what fits."""

    now: float

    def __init__(self, *, now: float) -> None:
        self.now = now


Event = (
    RequestSubmitted
    | EngineReported
    | NodeReported
    | SlotReserved
    | DispatchAnswered
    | DispatchFailed
    | TaskFailed
    | EngineLost
    | NodeLost
    | RequestFinished
    | TimeAdvanced
)


# --- commands ------------------------------------------------------------------------------


@dataclass(**_ev, init=False)
class Decision:
    """What the policy decided for one attempt, and what it compared (for the decision span).

    ``queued_since`` is the ``now`` at which the request (re-)entered the queue; ``seen``
    holds the figures the policy compared (read_q of both nodes, tok_e/seq_e of both
    engines, free HBM), filled only when the core traces inputs.
    """

    policy: str
    prefill_engine: str
    prefill_node: str
    decode_engine: str
    decode_node: str
    read_side: ReadSide | None  # None: nothing to read (no hit blocks)
    policy_side: ReadSide  # the side the assignment was charged to (== read_side when there are hits)
    hit_tokens: int
    prefill_tokens: int
    decode_tokens: int
    queued_since: float
    queue_len: int
    seen: dict[str, int | list[str]] = field(default_factory=dict)  # a figure's name -> its value (candidates: "engine:tok_e")
    read_split: tuple[int, int] | None = None  # a split read's (PE blocks, DE blocks); None: one side reads all

    def __init__(
        self,
        *,
        policy: str,
        prefill_engine: str,
        prefill_node: str,
        decode_engine: str,
        decode_node: str,
        read_side: ReadSide | None,
        policy_side: ReadSide,
        hit_tokens: int,
        prefill_tokens: int,
        decode_tokens: int,
        queued_since: float,
        queue_len: int,
        seen: dict[str, int | list[str]] | None = None,
        read_split: tuple[int, int] | None = None,
    ) -> None:
        self.policy = policy
        self.prefill_engine = prefill_engine
        self.prefill_node = prefill_node
        self.decode_engine = decode_engine
        self.decode_node = decode_node
        self.read_side = read_side
        self.policy_side = policy_side
        self.hit_tokens = hit_tokens
        self.prefill_tokens = prefill_tokens
        self.decode_tokens = decode_tokens
        self.queued_since = queued_since
        self.queue_len = queue_len
        self.seen = dict() if seen is None else seen
        self.read_split = read_split


@dataclass(**_ev)
class RejectRequest:
    """Refuse a submission (nothing was queued): 400 bad request, 409 duplicate, 429 queue full."""

    request_id: str
    code: int
    reason: str


@dataclass(**_ev, init=False)
class ReserveSlot:
    """Reserve ``blocks`` Full Blocks of ``block_bytes`` in ``node``'s buffer for the request;
    answer with ``SlotReserved`` or ``DispatchFailed(stage=RESERVE)`` (naming ``attempt``).
    ``wire_attempt``: the attempt as the traffic manager numbers it."""

    request_id: str
    attempt: int
    node: str
    blocks: int
    block_bytes: int
    decision: Decision
    payload: Any = None
    wire_attempt: int = -1

    def __init__(
        self,
        *,
        request_id: str,
        attempt: int,
        node: str,
        blocks: int,
        block_bytes: int,
        decision: Decision,
        payload: Any = None,
        wire_attempt: int = -1,
    ) -> None:
        self.request_id = request_id
        self.attempt = attempt
        self.wire_attempt = attempt if wire_attempt < 0 else wire_attempt
        self.node = node
        self.blocks = blocks
        self.block_bytes = block_bytes
        self.decision = decision
        self.payload = payload


@dataclass(**_ev, init=False)
class Dispatch:
    """Send the request to its prefill engine, naming its decode engine and DE slot; answer
    with ``DispatchAnswered`` or ``DispatchFailed(stage=DISPATCH)`` (naming ``attempt``);
    ``wire_attempt``: the attempt as engines number it."""

    request_id: str
    attempt: int
    prefill_engine: str
    prefill_node: str
    decode_engine: str
    decode_node: str
    read_side: ReadSide | None
    region: Any
    offset: int
    decision: Decision
    payload: Any = None
    wire_attempt: int = -1

    def __init__(
        self,
        *,
        request_id: str,
        attempt: int,
        prefill_engine: str,
        prefill_node: str,
        decode_engine: str,
        decode_node: str,
        read_side: ReadSide | None,
        region: Any,
        offset: int,
        decision: Decision,
        payload: Any = None,
        wire_attempt: int = -1,
    ) -> None:
        self.request_id = request_id
        self.attempt = attempt
        self.wire_attempt = attempt if wire_attempt < 0 else wire_attempt
        self.prefill_engine = prefill_engine
        self.prefill_node = prefill_node
        self.decode_engine = decode_engine
        self.decode_node = decode_node
        self.read_side = read_side
        self.region = region
        self.offset = offset
        self.decision = decision
        self.payload = payload


@dataclass(**_ev, init=False)
class FreeSlot:
    """Release the request's slot in ``node``'s buffer (best effort: the node may be gone):
    that of ``wire_attempt`` only (an abandoned request, a reservation for an attempt that is
    over), or, when it is -1, those of every attempt below ``wire_before`` (``ALL_ATTEMPTS``:
    all of them, once the request is gone)."""

    node: str
    request_id: str
    wire_attempt: int = -1
    wire_before: int = ALL_ATTEMPTS

    def __init__(self, *, node: str, request_id: str, wire_attempt: int = -1, wire_before: int = ALL_ATTEMPTS) -> None:
        self.node = node
        self.request_id = request_id
        self.wire_attempt = wire_attempt
        self.wire_before = wire_before


@dataclass(**_ev)
class FailRequest:
    """The request failed for good: tell its client (``code`` is HTTP-like, 503 after retries)."""

    request_id: str
    code: int
    reason: str
    attempts: int
    payload: Any = None


@dataclass(**_ev)
class ExpelEngine:
    """The core stopped using ``engine`` (it re-joins with its next report); ``incarnation``:
    the process it knew (what gateways compare with the one that served a request)."""

    engine: str
    reason: str
    incarnation: str = ""


@dataclass(**_ev)
class Requeued:
    """A placed request went back to the head of the queue as ``attempt``; ``counted`` is
    False for back-pressure (a full buffer does not use up an attempt)."""

    request_id: str
    attempt: int
    reason: str
    counted: bool


@dataclass(**_ev)
class StopAttempts:
    """Tell every engine to drop its runs of the request below ``before`` (a wire attempt),
    silently: a retry or a resubmission replaces them. Sent before the new attempt's dispatch."""

    request_id: str
    before: int
    reason: str


@dataclass(**_ev, init=False)
class Prefetch:
    """A session's turn ended (``CoreConfig.prefetch``): ask ``node`` to pre-stage the turn's
    persisted prompt blocks for the session's next turn, as a hint (no answer expected)."""

    node: str
    request_id: str
    session: str
    payload: Any = None

    def __init__(self, *, node: str, request_id: str, session: str, payload: Any = None) -> None:
        self.node = node
        self.request_id = request_id
        self.session = session
        self.payload = payload


Command = RejectRequest | ReserveSlot | Dispatch | FreeSlot | FailRequest | ExpelEngine | Requeued | StopAttempts | Prefetch
