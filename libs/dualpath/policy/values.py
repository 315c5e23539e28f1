"""Value types of the policy: what goes in (requests, topology) and what comes out
(assignments). All are frozen, slotted, keyword-only and hold integers only, so the
scheduler service can put them on the wire and the simulator can hash them.

Token accounting (the unit of every ``tok``/``read_q`` figure in this package is TOKENS):

- a prefill engine's ``tok_e`` is the sum of ``miss_tokens`` (tokens it must *compute*)
  over its unfinished requests. The paper's β is "tokens one GPU processes in 5 s", a
  compute budget, so ``tok_e`` must count the same thing; hit tokens cost storage
  bandwidth, and that is what the node's ``read_q`` measures.
- a decode engine's ``tok_e`` is the sum of ``total_len`` (prompt + most new tokens) over
  its unfinished requests, and ``total_len`` is also what it reserves in HBM: the
  decode engine holds the whole context and grows it up to that length.
- a node's ``read_q`` is the number of hit tokens queued for reading from storage
  through that node's storage NIC.
- a node's DRAM buffer figures (``NodeState.buffer_free``) count FULL BLOCKS: a request
  takes ``slot_blocks`` of its decode node's buffer from placement until its KV is in HBM.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum

from dualpath.policy.errors import InvalidRequestError, InvalidTopologyError

__all__ = ["Assignment", "NodeSpec", "PendingRequest", "ReadPath", "ReadSide", "Role"]


class Role(IntEnum):
    """What the engines of a node do (a node hosts one role only, as in the paper)."""

    PREFILL = 0
    DECODE = 1


class ReadSide(IntEnum):
    """Which node reads a request's hit KV from storage: the prefill engine's node (the
    classic PE read path) or the decode engine's node (the DE read path)."""

    PE = 0
    DE = 1


class ReadPath(str, Enum):  # noqa: UP042 - StrEnum would change str() of members in logs and wire values
    """How a policy picks the read side (``SchedulerConfig.read_path``): ``auto`` = the
    node with the shorter storage read queue (DualPath), ``pe`` = always the prefill
    side (the paper's Basic), ``de`` = always the decode side (for experiments),
    ``split`` = each request's hit blocks divided between both sides (``policy.split``)."""

    AUTO = "auto"
    PE = "pe"
    DE = "de"
    SPLIT = "split"


# The hot dataclasses below spell out ``__init__`` (``init=False``): mypyc compiles a written
# ``__init__`` natively, ~15x faster than the one ``dataclasses`` generates (a simulated
# rollout builds tens of millions of these); fields, eq and repr stay the dataclass's.
@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class PendingRequest:
    """A request waiting to be placed.

    ``prompt_tokens`` is the prompt length, ``hit_tokens`` the persisted prefix (read from
    storage, not computed), ``total_len`` the prompt plus the most new tokens it may
    generate. The last prompt token is always computed (its logits give the first output
    token), so ``hit_tokens < prompt_tokens``. ``forced_side`` forces the read side of
    this request (the API's per-request read path); None lets the policy choose.
    ``block_tokens`` is the block size: a split read divides whole blocks.
    ``staged_node`` (prefetch, beyond the paper): the node whose DRAM buffer holds a staged
    copy of the hits; the policy prefers an engine there and reads on that side.

    Raises:
        InvalidRequestError: on a negative count, ``hit_tokens >= prompt_tokens`` or
            ``total_len < prompt_tokens``.
    """

    request_id: int
    prompt_tokens: int
    hit_tokens: int
    total_len: int
    forced_side: ReadSide | None = None
    block_tokens: int = 64
    staged_node: int = -1  # agent-aware prefetch: the node holding a staged copy of its hits (-1: none)

    def __init__(
        self,
        *,
        request_id: int,
        prompt_tokens: int,
        hit_tokens: int,
        total_len: int,
        forced_side: ReadSide | None = None,
        block_tokens: int = 64,
        staged_node: int = -1,
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "hit_tokens", hit_tokens)
        object.__setattr__(self, "total_len", total_len)
        object.__setattr__(self, "forced_side", forced_side)
        object.__setattr__(self, "block_tokens", block_tokens)
        object.__setattr__(self, "staged_node", staged_node)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.hit_tokens < 0:
            raise InvalidRequestError(self.request_id, f"negative hit_tokens {self.hit_tokens}")
        if self.hit_tokens >= self.prompt_tokens:
            raise InvalidRequestError(
                self.request_id,
                f"hit_tokens {self.hit_tokens} leaves nothing to compute of a {self.prompt_tokens}-token prompt",
            )
        if self.total_len < self.prompt_tokens:
            raise InvalidRequestError(self.request_id, f"total_len {self.total_len} < prompt_tokens {self.prompt_tokens}")

    @property
    def miss_tokens(self) -> int:
        """Tokens the prefill engine computes: the charge to its ``tok_e``."""
        return self.prompt_tokens - self.hit_tokens

    @property
    def slot_blocks(self) -> int:
        """Full Blocks of the prompt's KV: the slot it takes in the decode node's DRAM buffer."""
        return -(-self.prompt_tokens // self.block_tokens)


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class Assignment:
    """One placement decision, with the charges the cluster state applies for it.

    ``prefill_tokens`` is added to the prefill engine's ``tok_e``, ``decode_tokens`` to the
    decode engine's ``tok_e`` and reserved in its HBM, ``read_tokens`` to ``read_q`` of
    ``read_node`` (the node on ``read_side``).

    A split read (``ReadPath.SPLIT``) has ``de_split_tokens > 0``: ``read_side`` is then PE,
    the PE node reads the first ``read_tokens - de_split_tokens`` hit tokens and the decode
    engine's node the last ``de_split_tokens``; each node's ``read_q`` is charged its share.
    """

    request_id: int
    prefill_engine: int
    decode_engine: int
    read_side: ReadSide
    read_node: int
    prefill_tokens: int
    decode_tokens: int
    read_tokens: int
    de_split_tokens: int = 0

    def __init__(
        self,
        *,
        request_id: int,
        prefill_engine: int,
        decode_engine: int,
        read_side: ReadSide,
        read_node: int,
        prefill_tokens: int,
        decode_tokens: int,
        read_tokens: int,
        de_split_tokens: int = 0,
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "prefill_engine", prefill_engine)
        object.__setattr__(self, "decode_engine", decode_engine)
        object.__setattr__(self, "read_side", read_side)
        object.__setattr__(self, "read_node", read_node)
        object.__setattr__(self, "prefill_tokens", prefill_tokens)
        object.__setattr__(self, "decode_tokens", decode_tokens)
        object.__setattr__(self, "read_tokens", read_tokens)
        object.__setattr__(self, "de_split_tokens", de_split_tokens)

    @property
    def read_split(self) -> tuple[int, int]:
        """(PE tokens, DE tokens) of the hit read: one of them is 0 unless the read is split."""
        if self.de_split_tokens:
            return self.read_tokens - self.de_split_tokens, self.de_split_tokens
        return (self.read_tokens, 0) if self.read_side is ReadSide.PE else (0, self.read_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """One node of the cluster: its engines (one per GPU) and, for decode nodes, each
    engine's KV capacity in HBM in tokens. The node is also its engine *group*; the
    group's leader is its lowest engine id.

    Raises:
        InvalidTopologyError: on an empty node or a negative capacity.
    """

    node_id: int
    role: Role
    engine_ids: tuple[int, ...]
    hbm_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.engine_ids:
            raise InvalidTopologyError(f"node {self.node_id} has no engines")
        if self.hbm_tokens < 0:
            raise InvalidTopologyError(f"node {self.node_id} has negative hbm_tokens")
        if self.role is Role.DECODE and self.hbm_tokens == 0:
            raise InvalidTopologyError(f"decode node {self.node_id} has no HBM for KV-cache")
