"""Agent-aware prefetch in virtual time (mode ``prefetch``; ``dualpath sim online --prefetch``).

The services' behaviour (``services/traffic_manager/prefetcher.py``, ``dualpath.node.prefetch``),
modelled per node:

- when a turn's decode ends, the scheduler core emits ``Prefetch`` for the node that read
  the turn (``CoreConfig.prefetch``); once the turn's new blocks are persisted, that node
  stages the agent's whole persisted context (prompt and answer blocks) — the next turn's
  hit — into its DRAM buffer;
- staging is the lowest priority on the node's storage NIC: a chunk (about 2 ms of link time,
  whole blocks) starts only while the node has no storage read queued or running, so a real
  read shares the link with at most one chunk;
- a staged copy is a hint: it lives in the node's prefetch cache, host DRAM beside the
  request buffer (``SimConfig.prefetch_gb`` per node, scaled as the buffer), so it never takes
  a request's room (``NodeStorage.buffer_used`` is the requests' alone), and has a time to
  live; staging waits for room rather than drop a copy;
- the next turn prefers the staged node (``PendingRequest.staged_node``); a read on that node
  takes the staged leading blocks (a DRAM copy, modelled as free) and reads only the rest
  from storage; a turn placed elsewhere reads from storage and the copy waits out its TTL;
- *retained* copies (``PrefetchCache.retain``): the node that read a turn keeps what it read
  instead of freeing it (the bytes pass from the request buffer to the cache): on the PE
  read path the hits in the prefill node's buffer when the prefill ends, on the DE read path
  the prompt's full blocks in the decode node's slot once they are in HBM (the services
  persist them from that slot); that copy is where the core's hint points, so staging reads
  only what it lacks. No storage read at all: this, not the staging, lowers the storage load. A split read keeps only its PE share.

Counters: hints, bytes staged (storage reads), bytes retained, bytes used by a read, bytes
dropped unused, and the peak bytes of the cache held by staged copies.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from dualpath.policy import ReadSide

if TYPE_CHECKING:
    from dualpath.sim.agent import Agent
    from dualpath.sim.request import SimRequest
    from dualpath.sim.simulation import Simulation
    from dualpath.sim.storage import NodeStorage

__all__ = ["NodePrefetch", "SimPrefetch"]

CHUNK_S = 0.002  # link time of one staging chunk: how long a real read may share the link with one


class _Copy:
    """One agent's staged context on one node."""

    __slots__ = ("agent", "dead", "expires", "flight", "held", "ready", "want")

    def __init__(self, agent: int, want: int, expires: float) -> None:
        self.agent = agent
        self.want = want  # tokens to stage (block-aligned)
        self.ready = 0  # tokens staged
        self.flight = 0  # tokens of the chunk being read
        self.held = 0.0  # buffer bytes accounted to it (ready and in flight)
        self.expires = expires
        self.dead = False  # dropped while a chunk was in flight: its bytes go when the chunk ends


class NodePrefetch:
    """A node's staged copies (oldest first) and its staging queue."""

    def __init__(self, owner: SimPrefetch, storage: NodeStorage) -> None:
        self.owner, self.storage = owner, storage
        self.copies: OrderedDict[int, _Copy] = OrderedDict()
        self.queue: deque[_Copy] = deque()
        self.busy = False
        self.bytes = 0.0  # cache bytes held by copies

    # -- staging -------------------------------------------------------------------------
    def stage(self, agent: int, tokens: int) -> None:
        """Stage ``tokens`` of the agent's context (what is already here is kept: the blocks
        of a grown context extend the old ones)."""
        o = self.owner
        c = self.copies.get(agent)
        if c is None or c.dead:
            c = _Copy(agent, 0, 0.0)
            self.copies[agent] = c
        else:
            self.copies.move_to_end(agent)
        c.want = max(c.want, tokens)
        c.expires = o.now() + o.ttl_s
        if c.ready + c.flight < c.want and c not in self.queue:
            self.queue.append(c)
        self.pump()

    def pump(self) -> None:
        """Start the next chunk if the node's storage NIC has no real read (lowest priority)."""
        s, o = self.storage, self.owner
        if self.busy or s.active or s.queue:
            return
        self._expire()
        while self.queue:
            c = self.queue[0]
            left = c.want - c.ready
            if c.dead or left <= 0:
                self.queue.popleft()
                continue
            tokens = min(left, o.chunk_tokens)
            nbytes = tokens * o.kvb
            if not self._room(nbytes):
                if self.bytes + nbytes > o.cap and c.held == self.bytes:  # alone over the cap: stage what fits
                    c.want = c.ready
                    self.queue.popleft()
                    continue
                return  # no room: wait until a copy is used, expires or a request leaves
            c.flight, c.held = tokens, c.held + nbytes
            self.bytes += nbytes
            o.peak = max(o.peak, self.bytes)
            self.busy = True
            s.read_link.start(nbytes, self._chunk_done, c)
            return

    def _room(self, nbytes: float) -> bool:
        """Whether a chunk fits the cache. Staging never drops another copy: that would spend
        the storage NIC to trade one hint for another of the same worth (the working set of
        agents in their tool calls is larger than DRAM at any useful rate)."""
        return self.bytes + nbytes <= self.owner.cap

    def _chunk_done(self, c: _Copy) -> None:
        o = self.owner
        self.busy = False
        nbytes = c.flight * o.kvb
        o.staged_bytes += nbytes
        if c.dead:
            self._release(c, nbytes)
            o.dropped_bytes += nbytes
        else:
            c.ready += c.flight
        c.flight = 0
        self.pump()

    def retain(self, agent: int, tokens: int) -> float:
        """``tokens`` of the agent's context, in this node's buffer as a request's bytes, stay
        as its copy (``PrefetchCache.retain``; the caller releases the request's buffer bytes):
        the bytes kept (0: over the cap). Never drops another agent's copy."""
        o = self.owner
        nbytes = tokens * o.kvb
        if tokens <= 0 or self.bytes + nbytes > o.cap:
            return 0.0
        c = self.copies.get(agent)
        if c is not None and not c.dead:
            self._drop(c)  # an older copy of the same context: the kept bytes cover it
        c = _Copy(agent, tokens, o.now() + o.ttl_s)
        c.ready, c.held = tokens, float(nbytes)
        self.copies[agent] = c
        self.bytes += nbytes
        o.peak = max(o.peak, self.bytes)
        o.retained_bytes += nbytes
        return nbytes

    # -- use and eviction ----------------------------------------------------------------------
    def take(self, agent: int, hit: int, *, keep: bool) -> int:
        """A read of ``hit`` tokens on this node: the staged leading tokens it can use. The
        copy is consumed; ``keep``: the used bytes pass to the request buffer (the PE read path
        holds its hits there until its prefill ends), else they leave DRAM."""
        c = self.copies.get(agent)
        if c is None or c.dead or c.expires <= self.owner.now():
            return 0
        o = self.owner
        used = min(c.ready, hit)
        o.used_bytes += used * o.kvb
        o.dropped_bytes += (c.ready - used) * o.kvb
        if keep and used:
            c.ready -= used
            c.held -= used * o.kvb
            self.bytes -= used * o.kvb
            self.storage.buffer_used += used * o.kvb
        self._drop(c, count=False)
        return used

    def _expire(self) -> None:
        now = self.owner.now()
        for c in [c for c in self.copies.values() if c.expires <= now and not c.dead]:
            self._drop(c)

    def _drop(self, c: _Copy, *, count: bool = True) -> None:
        """Forget ``c``: its staged bytes leave the cache now, a chunk in flight when it lands."""
        o = self.owner
        if count:
            o.dropped_bytes += c.ready * o.kvb
        ready_bytes = c.ready * o.kvb
        c.ready, c.want, c.dead = 0, 0, True
        if self.copies.get(c.agent) is c:
            del self.copies[c.agent]
        self._release(c, ready_bytes)
        if not c.flight:
            c.held = 0.0

    def _release(self, c: _Copy, nbytes: float) -> None:
        """``nbytes`` of ``c`` leave the cache."""
        if nbytes <= 0:
            return
        c.held -= nbytes
        self.bytes -= nbytes
        if self.bytes < 1e-6:
            self.bytes = 0.0


class SimPrefetch:
    """Every node's prefetch, and the hints between a turn's end and its persistence."""

    def __init__(self, sim: Simulation, cap_bytes: float, ttl_s: float) -> None:
        self.sim = sim
        self.kvb = sim.kv_bytes_per_token
        bt = sim.cfg.block_tokens
        block_bytes = bt * self.kvb
        self.chunk_tokens = bt * max(1, int(sim.cfg.snic_bytes_per_s() * CHUNK_S // block_bytes))
        self.ttl_s = ttl_s
        if not cap_bytes > 0:
            raise ValueError(f"the prefetch cache must be positive, got {cap_bytes:g} bytes per node")
        self.cap = cap_bytes
        self.nodes: dict[str, NodePrefetch] = {}
        for name, storage in sim.storage.items():
            storage.prefetch = self.nodes[name] = NodePrefetch(self, storage)
        self._hinted: dict[int, str] = {}  # agent -> node asked to stage it, until its blocks are persisted
        self.hints = 0
        self.staged_bytes = self.used_bytes = self.dropped_bytes = self.peak = 0.0
        self.retained_bytes = 0.0  # bytes of requests' reads kept as copies (no storage read)

    def now(self) -> float:
        return self.sim.loop.now

    def hint(self, req: SimRequest, node: str) -> None:
        """The core's ``Prefetch`` for the turn ``req`` (its decode just ended)."""
        self.hints += 1
        self._hinted[req.agent.index] = node

    def persisted(self, agent: Agent) -> None:
        """The turn's new blocks are in storage: stage the whole persisted context."""
        node = self._hinted.pop(agent.index, None)
        if node is not None and agent.persisted > 0:
            self.nodes[node].stage(agent.index, agent.persisted)

    def take(self, req: SimRequest, node: str, *, keep: bool) -> int:
        """Staged leading hit tokens of ``req`` on ``node`` (0: read everything from storage);
        ``keep``: see ``NodePrefetch.take``."""
        return self.nodes[node].take(req.agent.index, req.hit, keep=keep)

    def retain_pe(self, req: SimRequest) -> float:
        """The PE read path's prefill ended: its hits in the prefill node's buffer stay as the
        agent's copy there; the bytes kept (the caller releases the request's buffer bytes)."""
        s = req.buffer
        tokens = req.hit - req.split_de  # a split read's PE share
        if s is None or s.prefetch is None or req.buffer_bytes < tokens * self.kvb:
            return 0.0  # the buffer holds only a rest read after a partly staged copy: nothing kept
        return s.prefetch.retain(req.agent.index, tokens)

    def retain_de(self, req: SimRequest, storage: NodeStorage) -> None:
        """The DE read path's KV is in HBM: the prompt's full blocks in the decode node's slot
        stay as the agent's copy (the caller frees the slot)."""
        slot = storage.slots.get(req.key)
        if req.read_side != ReadSide.DE or req.split_de or not req.hit or slot is None or storage.prefetch is None:
            return
        tokens = min(req.prompt - req.prompt % self.sim.cfg.block_tokens, int(slot // self.kvb))
        storage.prefetch.retain(req.agent.index, tokens)

    def read_rest(self, req: SimRequest, storage: NodeStorage, staged: int, done: Callable[[SimRequest], None]) -> None:
        """``req``'s read on ``storage``'s node, whose first ``staged`` hit tokens were staged
        (a DRAM copy, free here): the rest comes from storage, then ``done(req)``. On the PE
        read path the staged bytes stay in the buffer as the request's until its prefill
        ends; when a rest must be read, its own buffer share replaces them."""
        pe_path = req.read_side == ReadSide.PE
        if pe_path:
            req.buffer, req.buffer_bytes = storage, float(staged * self.kvb)
        if staged >= req.hit:
            self.sim.loop.at(self.sim.loop.now, done, req)
            return
        if pe_path:
            storage.release(staged * self.kvb)
            req.buffer, req.buffer_bytes = None, 0.0
        storage.read(req, (req.hit - staged) * self.kvb, into_buffer=pe_path, tokens=req.hit - staged)

    def summary(self) -> dict:
        staged, kept = self.staged_bytes, self.retained_bytes
        return {
            "hints": self.hints,
            "staged_bytes": staged,
            "retained_bytes": kept,
            "used_bytes": self.used_bytes,
            "dropped_bytes": self.dropped_bytes,
            "used_fraction": self.used_bytes / (staged + kept) if staged + kept else None,
            "peak_cache_bytes": self.peak,
            "cap_bytes_per_node": self.cap,
        }
