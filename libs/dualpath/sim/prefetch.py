"""Agent-aware prefetch in virtual time (mode ``prefetch``; ``dualpath sim online --prefetch``).

The cache is the traffic manager's own core: each node's ``NodeStorage`` holds a
``dualpath.node.prefetch.PrefetchCache`` beside its ``NodeBuffer`` (runs in the same pool,
within ``SimConfig.prefetch_gb`` per node, scaled as the buffer; TTL ``prefetch_ttl_s``), so
placement, budget, expiry, eviction (a request that needs the room drops runs, oldest
first), retained runs (a freed slot whose blocks a read verified) and the counters are the
services'. What is modelled here is the prefetch worker (``services/traffic_manager/
prefetcher.py``) in virtual time:

- when a turn's decode ends, the scheduler core emits ``Prefetch`` for the node that read
  the turn (``CoreConfig.prefetch``); once the turn's new blocks are persisted, that node
  queues a hint for the agent's whole persisted context (at most ``MAX_PENDING_HINTS`` wait:
  the oldest is dropped, as the worker's bounded queue does);
- staging is the lowest priority on the node's storage NIC: while the node has no storage
  read queued or running, the worker opens a run for the hint's blocks the cache does not
  hold yet (``open_run``: the leading ones that fit the budget; staging never drops another
  run) and fills it a chunk at a time (about ``CHUNK_S`` of link time, whole blocks), so a
  real read shares the link with at most one chunk; a run dropped meanwhile stops its hint;
- the next turn prefers the staged node (``PendingRequest.staged_node``); its read takes the
  leading blocks found in that node's cache and reads only the rest (``NodeStorage``).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

from dualpath.node.prefetch import MAX_PENDING_HINTS, PrefetchCache, Run
from dualpath.sim.storage import DIGEST, NodeStorage, block_hashes

if TYPE_CHECKING:
    from dualpath.sim.agent import Agent
    from dualpath.sim.request import SimRequest
    from dualpath.sim.simulation import Simulation

__all__ = ["NodeStaging", "SimPrefetch"]

CHUNK_S: Final = 0.002  # link time of one staging chunk: how long a real read may share the link with one


class NodeStaging:
    """A node's prefetch worker: its pending hints and the run being filled."""

    __slots__ = ("busy", "cache", "fill_next", "owner", "pending", "run", "storage")

    def __init__(self, owner: SimPrefetch, storage: NodeStorage, cache: PrefetchCache) -> None:
        self.owner, self.storage, self.cache = owner, storage, cache
        self.pending: deque[tuple[int, int]] = deque(maxlen=MAX_PENDING_HINTS)  # (agent, blocks)
        self.run: Run | None = None
        self.fill_next = 0  # the run's next block to read
        self.busy = False  # a chunk is on the link

    def stage(self, agent: int, blocks: int) -> None:
        self.pending.append((agent, blocks))
        self.pump()

    def pump(self) -> None:
        """Start the next chunk if the node's storage NIC has no real read (lowest priority)."""
        s, o = self.storage, self.owner
        if self.busy or s.active or s.queue:
            return
        run = self.run
        while run is None or not run.live or self.fill_next >= len(run.hashes):
            self.run = run = None
            if not self.pending:
                return
            agent, blocks = self.pending.popleft()
            todo = [h for h in block_hashes(agent, blocks) if (DIGEST, h) not in self.cache]
            if todo:
                run = self.cache.open_run(DIGEST, todo, s.block_bytes)
                self.run, self.fill_next = run, 0
        i = self.fill_next
        k = min(o.chunk_blocks, len(run.hashes) - i)
        self.fill_next = i + k
        self.busy = True
        o.link_bytes += k * s.block_bytes
        s.read_link.start(k * s.block_bytes, self._chunk_done, (run, i, k))

    def _chunk_done(self, token: tuple[Run, int, int]) -> None:
        run, i, k = token
        self.busy = False
        for j in range(i, i + k):
            if not self.cache.fill(run, j, None):
                break  # dropped meanwhile: the bytes read are lost
        self.pump()


class SimPrefetch:
    """Every node's prefetch worker, and the hints between a turn's end and its persistence."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        bt = sim.cfg.block_tokens
        block_bytes = bt * sim.kv_bytes_per_token
        self.block_tokens = bt
        self.chunk_blocks = max(1, int(sim.cfg.snic_bytes_per_s() * CHUNK_S // block_bytes))
        self.nodes: dict[str, NodeStaging] = {}
        for name, storage in sim.storage.items():
            if storage.cache is None:
                raise ValueError(f"node {name} has no prefetch cache")
            storage.prefetch = self.nodes[name] = NodeStaging(self, storage, storage.cache)
        self.cap = float(next(iter(self.nodes.values())).cache.budget) if self.nodes else 0.0  # the same on every node
        self._hinted: dict[int, str] = {}  # agent -> node asked to stage it, until its blocks are persisted
        self.hints = 0
        self.link_bytes = 0  # bytes staging moved over the storage NICs (used or not)

    def hint(self, req: SimRequest, node: str) -> None:
        """The core's ``Prefetch`` for the turn ``req`` (its decode just ended)."""
        self.hints += 1
        self._hinted[req.agent.index] = node

    def persisted(self, agent: Agent) -> None:
        """The turn's new blocks are in storage: stage the whole persisted context."""
        node = self._hinted.pop(agent.index, None)
        if node is not None and agent.persisted > 0:
            self.nodes[node].stage(agent.index, agent.persisted // self.block_tokens)

    def cached_bytes(self) -> int:
        """Block bytes the caches hold now, ready to use (staged or retained)."""
        return sum(n.cache.ready_bytes() for n in self.nodes.values())

    def summary(self) -> dict:
        stats = [n.cache.stats for n in self.nodes.values()]
        staged, kept = sum(s.staged_bytes for s in stats), sum(s.retained_bytes for s in stats)
        used = sum(s.used_bytes for s in stats)
        return {
            "hints": self.hints,
            "staged_bytes": staged,
            "retained_bytes": kept,
            "used_bytes": used,
            "dropped_bytes": sum(s.dropped_bytes for s in stats),
            "evictions": sum(s.evictions for s in stats),
            "link_bytes": self.link_bytes,
            "used_fraction": used / (staged + kept) if staged + kept else None,
            "peak_cache_bytes": max((n.cache.peak_bytes for n in self.nodes.values()), default=0),
            "cap_bytes_per_node": self.cap,
        }
