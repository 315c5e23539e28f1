"""Every control message between DualPath services (and nothing else).

Messages are frozen, slotted, kw-only dataclasses with explicit ``to_wire``/``from_wire``
(see ``wire.Wire``); the codec wraps them in a versioned msgpack envelope with an integer
type code. Wire types are not domain types: services convert at the edge.

Flow of one request (subjects in ``subjects.py``)::

    gateway --LookupRequest--> kv-persistence                  (hit length)
    gateway --SubmitRequest--> scheduler                       (queue; reply = accepted)
    scheduler --AllocRequest--> traffic-manager(DE node)       (reserve the DE buffer slot)
    scheduler --PrefillTask--> prefill engine
    prefill engine --LoadRequest--> traffic-manager(read side) (storage -> buffer)
    prefill engine --TokenEvent--> gateway                     (first token)
    prefill engine --DecodeTask--> decode engine               (KV complete in the DE buffer)
    decode engine --PersistRequest--> traffic-manager(DE node) (buffer -> storage, commit)
    decode engine --TokenEvent--> gateway                      (the rest, then finish)
    engines/traffic managers --EngineReport/NodeReport--> scheduler (periodic, also liveness)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any  # evaluated by Wire.from_wire's type checks (typing.get_type_hints): not under TYPE_CHECKING

from dualpath.protocol.codec import register
from dualpath.protocol.wire import Wire

__all__ = [
    "AllocReply",
    "AllocRequest",
    "DecodeTask",
    "EngineReport",
    "ErrorReply",
    "FreeRequest",
    "LoadReply",
    "LoadRequest",
    "LookupReply",
    "LookupRequest",
    "CommitRequest",
    "NodeReport",
    "Ok",
    "PersistRequest",
    "PrefillTask",
    "ReadPath",
    "Role",
    "SubmitReply",
    "SubmitRequest",
    "TokenEvent",
    "RemoveRequest",
    "SlotClaimed",
    "DescribeRequest",
    "DescribeReply",
    "LoadProbe",
    "LoadProbeReply",
    "TaskFailed",
    "CancelRequest",
    "EngineLost",
    "StateRequest",
    "StateReply",
    "BUFFER_FULL",
    "ALL_ATTEMPTS",
    "SUBMISSION_ATTEMPTS",
]

BUFFER_FULL = 507  # ErrorReply code: a node DRAM buffer has no room now (back-pressure, not a failure)
# A request's placements are numbered on the wire from ``submission * SUBMISSION_ATTEMPTS``
# (``SubmitRequest.submission``): a scheduler that took over numbers its attempts from 0, and
# its attempts must still order after (and never equal) those of the scheduler that died, so
# engines and traffic managers tell an older run from a newer one by the attempt alone.
SUBMISSION_ATTEMPTS = 1 << 20
ALL_ATTEMPTS = 1 << 62  # FreeRequest.before_attempt that frees every attempt's slot


class Role(IntEnum):
    """What an engine does. Integers on the wire (compact, fast to compare)."""

    PREFILL = 0
    DECODE = 1


class ReadPath(IntEnum):
    """Which node reads a request's hit KV from storage (paper: PE read path / DE read path)."""

    AUTO = 0
    PE = 1
    DE = 2
    NONE = 3  # oracle mode / no hits: nothing read from storage


_msg = dict(frozen=True, slots=True, kw_only=True)


# --- generic replies -----------------------------------------------------------------------


@register(1)
@dataclass(**_msg)
class ErrorReply(Wire):
    """Any service's answer to a request it could not serve; ``code`` is HTTP-like."""

    code: int
    message: str


@register(2)
@dataclass(**_msg)
class Ok(Wire):
    """Plain acknowledgement."""

    detail: str = ""


# --- kv-persistence -------------------------------------------------------------------------


@register(10)
@dataclass(**_msg)
class LookupRequest(Wire):
    """How many leading blocks of this hash chain are persisted?

    ``hashes``: the chain, or (what the gateway sends) the same hashes packed as little-endian
    u64s (``dualpath.kv.pack_hashes``), which the index reads only where it probes."""

    model_digest: int
    hashes: list[int] | bytes


@register(11)
@dataclass(**_msg)
class LookupReply(Wire):
    hit_blocks: int


@register(12)
@dataclass(**_msg)
class CommitRequest(Wire):
    """Blocks ``hashes[start:]`` are durable in storage; their parents are the earlier hashes."""

    model_digest: int
    hashes: list[int]
    start: int = 0


@register(13)
@dataclass(**_msg)
class RemoveRequest(Wire):
    """Drop blocks from the index (their files were found corrupt or missing)."""

    model_digest: int
    hashes: list[int]


# --- gateway -> scheduler -------------------------------------------------------------------


@register(20)
@dataclass(**_msg)
class SubmitRequest(Wire):
    """A tokenized request entering the scheduler's queue."""

    request_id: str
    model: str
    model_digest: int
    prompt_tokens: list[int]
    block_hashes: list[int]  # hash chain of the prompt's full blocks
    hit_blocks: int  # persisted prefix length at lookup time (in blocks)
    sampling: dict[str, Any]  # dualpath.model.SamplingParams fields
    reply_subject: str  # where TokenEvents go
    read_path: int = ReadPath.AUTO
    block_tokens: int = 64
    arrival_ts: float = 0.0
    trace: dict[str, str] = field(default_factory=dict)  # W3C trace context of the request (traceparent/tracestate)
    session: str = ""  # agent session id (X-Session-ID, the OpenAI user field or dualpath_session); "" unknown
    submission: int = 0  # the gateway's n-th submission of the request (a resubmission after a failover; see SUBMISSION_ATTEMPTS)
    chain_root: int = 0  # parent hash of the prompt's first block (dualpath.kv.chain_root: tenant, cache_salt); 0 unsalted


@register(21)
@dataclass(**_msg)
class SubmitReply(Wire):
    """The scheduler's answer to a submit; also its heartbeat on ``Subjects.sched_alive``."""

    queue_position: int
    instance: str = ""  # the answering scheduler's instance (new at every start: a change means a restart)


# --- scheduler <-> traffic manager ------------------------------------------------------------


@register(30)
@dataclass(**_msg)
class AllocRequest(Wire):
    """Reserve room in a node's DRAM buffer for ``blocks`` Full Blocks of a request.

    Slots are per ``(request_id, attempt)``: an older attempt can never read, write or free a
    newer one's. ``instance`` names the scheduler that reserved it (its heartbeat instance):
    once another instance is active, a reservation no load or persist has claimed is given
    back after a grace period (the dead scheduler can no longer free it)."""

    request_id: str
    blocks: int
    block_bytes: int
    attempt: int = 0
    instance: str = ""


@register(31)
@dataclass(**_msg)
class AllocReply(Wire):
    region: dict[str, Any]  # transfer.RegionDescriptor wire form
    offset: int
    nbytes: int


@register(32)
@dataclass(**_msg)
class FreeRequest(Wire):
    """Give back the slot of ``(request_id, attempt)``, or with ``before_attempt >= 0`` the
    slots of every attempt of the request below it (``ALL_ATTEMPTS``: all of them)."""

    request_id: str
    attempt: int = 0
    before_attempt: int = -1


@register(33)
@dataclass(**_msg)
class LoadRequest(Wire):
    """Read hit Full Blocks from storage into the node buffer, block i at ``offset + i*block_bytes``.

    If the request has no slot on that node yet, the traffic manager allocates one
    (``allocate=True``, PE read path) and returns where it is.
    """

    request_id: str
    model_digest: int
    hashes: list[int]
    layers: int
    bytes_per_token_layer: int
    dtype: str
    block_tokens: int
    allocate: bool = False
    kv_layout: int = 0  # what a token's bytes are (dualpath.kv.block.KV_LAYOUTS)
    total_blocks: int = 0  # slot size when allocating
    first_block: int = 0  # hashes[0] is block ``first_block`` of the slot (a split read's DE share: the last blocks)
    attempt: int = 0  # the slot is the one of (request_id, attempt)


@register(38)
@dataclass(**_msg)
class PrefetchRequest(Wire):
    """A hint (published, no reply): stage these persisted blocks in the node's prefetch cache
    while its storage NIC is idle, for the session's next turn (agent-aware prefetch). The
    block format is the one the node's last load or persist used, else the first block file's
    header (the scheduler does not know the model's layout)."""

    session: str
    model_digest: int
    hashes: list[int]


@register(34)
@dataclass(**_msg)
class LoadReply(Wire):
    """``loaded`` leading blocks are valid in the buffer (a missing/corrupt block ends the hit)."""

    loaded: int
    region: dict[str, Any]
    offset: int
    bytes_read: int
    queue_wait_s: float = 0.0
    read_s: float = 0.0


@register(35)
@dataclass(**_msg)
class PersistRequest(Wire):
    """Write Full Blocks that sit in this node's buffer to storage, then commit them.

    Block ``i`` of ``hashes`` lies at ``offset + i*block_bytes`` of region ``region_id``;
    ``chain_start`` is the index of ``hashes[0]`` in the request's hash chain and ``parent``
    its parent hash (0 at the root). ``free_after`` releases the request's slot when done.
    """

    request_id: str
    model_digest: int
    region_id: str
    offset: int
    hashes: list[int]
    parent_chain: list[int]  # the chain before hashes[0] (commit needs the full path)
    layers: int
    bytes_per_token_layer: int
    dtype: str
    block_tokens: int
    free_after: bool = False
    kv_layout: int = 0  # what a token's bytes are (dualpath.kv.block.KV_LAYOUTS)
    attempt: int = 0  # the slot is the one of (request_id, attempt)


@register(39)
@dataclass(**_msg)
class SlotClaimed(Wire):
    """A decode engine took a hand-off whose KV lies in its node's slot of ``(request_id,
    attempt)`` (published to that traffic manager, no reply): the reservation is in use even if
    the scheduler that made it is gone; the decode engine frees it once the KV moved in."""

    request_id: str
    attempt: int = 0


@register(36)
@dataclass(**_msg)
class DescribeRequest(Wire):
    """Ask a traffic manager for its data-plane regions (connection set-up over NATS)."""

    node_id: str = ""


@register(37)
@dataclass(**_msg)
class DescribeReply(Wire):
    node_id: str
    regions: list[dict[str, Any]]


@register(64)
@dataclass(**_msg)
class LoadProbe(Wire):
    """Ask a traffic manager whether it still runs the load of ``(request_id, attempt)``: an engine
    awaiting a long load asks every second, so a load lost with its traffic manager (killed, or
    restarted under the same node) fails in seconds instead of after ``TIMEOUTS.tm_load``."""

    request_id: str
    attempt: int = 0


@register(65)
@dataclass(**_msg)
class LoadProbeReply(Wire):
    """``running``: the load is queued or reading here (its answer is still to come)."""

    running: bool


# --- scheduler -> engines ---------------------------------------------------------------------


@register(40)
@dataclass(**_msg)
class PrefillTask(Wire):
    """Everything a prefill engine needs to run one request and hand it to its decode engine."""

    request_id: str
    model: str  # model id: the hash chain's namespace
    model_digest: int
    prompt_tokens: list[int]
    block_hashes: list[int]
    hit_blocks: int
    sampling: dict[str, Any]
    reply_subject: str
    read_path: int  # ReadPath.PE / DE / NONE
    prefill_engine: str
    prefill_node: str
    decode_engine: str
    decode_node: str
    de_region: dict[str, Any]  # where the DE buffer slot lives
    de_offset: int
    attempt: int = 0
    policy: str = ""
    arrival_ts: float = 0.0  # wall time the gateway admitted the request (TTFT's queueing part starts here)
    read_split: list[int] = field(default_factory=list)  # split read: [PE blocks, DE blocks] (read_path PE); [] = one side reads all
    trace: dict[str, str] = field(default_factory=dict)  # the request's trace context (its work outlives this message)
    chain_root: int = 0  # SubmitRequest.chain_root: the decode engine salts the hashes of generated blocks with it


@register(41)
@dataclass(**_msg)
class DecodeTask(Wire):
    """Prefill is done: the request's complete prompt KV lies in the DE buffer slot."""

    request_id: str
    model: str
    model_digest: int
    prompt_tokens: list[int]
    block_hashes: list[int]
    cached_blocks: int  # blocks that were hits (already persisted)
    first_token: int
    first_logprob: float
    first_top_logprobs: list[list[int | float]]  # [[token_id, logprob], ...]
    sampling: dict[str, Any]
    reply_subject: str
    de_region_id: str
    de_offset: int
    read_path: int
    prefill_engine: str
    attempt: int = 0
    timing: dict[str, Any] = field(default_factory=dict)  # ttft_queue_s / ttft_exec_s measured by the prefill engine
    trace: dict[str, str] = field(default_factory=dict)  # the request's trace context (decode outlives this message)
    chain_root: int = 0  # SubmitRequest.chain_root: the parent of the first generated block when the prompt has no full block


@register(42)
@dataclass(**_msg)
class TaskFailed(Wire):
    """An engine could not run a task; the scheduler retries it elsewhere or fails it."""

    request_id: str
    engine_id: str
    reason: str
    retryable: bool = True
    unreachable: str = ""  # an engine that did not answer (the scheduler stops using it until it reports)
    node_unreachable: str = ""  # a node whose traffic manager died under the task (the scheduler stops using the node until it reports)
    attempt: int = -1  # the task's attempt as dispatched (-1: not said): a failure of an attempt the scheduler has retried is late
    abandoned: bool = False  # nothing more is needed (a newer run holds it, or its client cancelled): dropped, not retried


@register(43)
@dataclass(**_msg)
class EngineReport(Wire):
    """Periodic state of one engine (also its heartbeat); the paper's ``seq_e``/``tok_e``.

    The scheduler takes a report as the truth about every task the engine has acknowledged
    and adds its own charges for the rest, so the figures are in the units it charges a
    placement in (``dualpath.core.scheduler``):

    - prefill: ``seq`` = unfinished tasks; ``tok`` = the *miss* tokens they still have to
      compute (prompt less the hits: planned hits while a task's load runs, loaded blocks
      after it, less the chunks computed); ``free_hbm_tokens`` = ``capacity_tokens`` = 0.
    - decode: ``seq`` = requests here, running and waiting for admission; ``tok`` = Σ their
      ``prompt + max_tokens`` (not the context so far); ``free_hbm_tokens`` = capacity less
      the KV footprints reserved for them (waiting ones too; whole blocks, so at most a
      block per request below the scheduler's unrounded charge).

    A prefill engine also lists every task it holds (``holding``: loading, queued, in a batch
    or handing off, and a successor waiting for its predecessor to stop), so the scheduler
    can tell a task whose ``TaskFailed`` was lost from one still running.
    """

    engine_id: str
    role: int
    node_id: str
    seq: int
    tok: int  # see above: prefill miss tokens left; decode Σ prompt + max_tokens
    free_hbm_tokens: int  # decode: capacity − reserved footprints (running and waiting)
    capacity_tokens: int
    finished: list[str] = field(default_factory=list)  # requests completed since the last report
    finished_attempts: list[int] = field(default_factory=list)  # the attempt of each, by position (empty: not said)
    block_bytes: int = 0  # bytes of one Full Block in this engine's KV format
    stats: dict[str, Any] = field(default_factory=dict)  # cumulative seconds: busy, modeled, attention, kv_wait
    ts: float = 0.0
    incarnation: str = ""  # new at every start of the engine process: a change means it restarted (and lost its work)
    holding: list[str] | None = None  # prefill: every task held now, queued to handing off (None: not said)
    holding_attempts: list[int] = field(default_factory=list)  # the attempt of each, by position


@register(44)
@dataclass(**_msg)
class NodeReport(Wire):
    """Periodic state of one node's traffic manager: the storage read queue (``read_q``)."""

    node_id: str
    read_q_tokens: int
    read_q_bytes: int
    buffer_free_bytes: int
    buffer_bytes: int
    regions: list[dict[str, Any]] = field(default_factory=list)
    bytes_read: int = 0  # cumulative storage bytes read (SNIC read direction)
    bytes_written: int = 0  # cumulative storage bytes written
    prefetch: dict[str, Any] = field(default_factory=dict)  # prefetch cache counters (node.prefetch.PrefetchStats) when enabled
    ts: float = 0.0


# --- engines -> gateway -----------------------------------------------------------------------


@register(50)
@dataclass(**_msg)
class TokenEvent(Wire):
    """Tokens of one request, in order by ``index`` (the first token comes from the prefill engine).

    ``finish_reason`` set (``stop``, ``length``, ``error``) marks the last event; then ``usage``
    and ``info`` (the ``dualpath`` extension: read path, engines, hit tokens) are filled.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list[int | float]]] = field(default_factory=list)  # per token: [[id, logprob], ...]
    finish_reason: str | None = None
    error: str = ""
    error_code: int = 0
    cached_tokens: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    ts: float = 0.0
    attempt: int = 0  # the scheduler's placement that produced it (PrefillTask.attempt): a retry's events supersede
    decode_engine: str = ""  # the decode engine serving this run: "name@incarnation" (the prefill engine's first token: "name")


# --- control ---------------------------------------------------------------------------------


@register(60)
@dataclass(**_msg)
class CancelRequest(Wire):
    """Stop work on a request (client gone, stop string seen); broadcast to every engine."""

    request_id: str
    reason: str = ""
    before_attempt: int = -1  # the scheduler retried it: only attempts before this one stop (-1: every attempt)


@register(63)
@dataclass(**_msg)
class EngineLost(Wire):
    """The active scheduler stopped using an engine (silent, unreachable or restarted), published
    on ``Subjects.engine_lost``: a gateway resubmits the started requests that engine served,
    which a scheduler that knows them refuses (409) and one that took over after a failover
    (it never heard of them) places again."""

    engine_id: str
    incarnation: str = ""  # the engine process that was lost ("" unknown: any)
    reason: str = ""


@register(61)
@dataclass(**_msg)
class StateRequest(Wire):
    """Ask the scheduler for a summary of the cluster (health checks, ``dualpath up``)."""

    detail: bool = False


@register(62)
@dataclass(**_msg)
class StateReply(Wire):
    prefill_engines: int
    decode_engines: int
    nodes: int
    queued: int
    running: int
    policy: str
    engines: list[dict[str, Any]] = field(default_factory=list)
    node_states: list[dict[str, Any]] = field(default_factory=list)
    buffer_waits: int = 0  # dispatches put back because a decode node's buffer was full
