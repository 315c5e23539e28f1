"""``Simulation``: a PD-disaggregated cluster and its agents in virtual time.

Wiring only; each part is its own module: the network (``network``), the nodes' storage
queues and buffers (``storage``), the prefill and decode engines around their cores
(``prefill``, ``decode``), the scheduler around the policy (``scheduling``).

A turn's path (the services' path, see ``dualpath.protocol.messages``):

1. submitted with the agent's context: prompt = context + append, hit = the tokens of its
   context whose Full Blocks are persisted (``Agent.persisted``);
2. the scheduler core places it (PE, DE, read side), reserves its slot in the decode node's
   buffer, and the read node's storage queue reads the hit KV (oracle: no read);
3. the prefill engine batches it; the batch loads the hit KV, computes, stores KV to the
   decode side (``prefill``); its last chunk's end is the first token (TTFT);
4. the decode engine copies the complete KV from its node's buffer into HBM (its CNIC in)
   and decodes it (``decode``);
5. at the end the DE persists the turn's new Full Blocks through its node's SNIC write
   direction; when they are in storage the agent makes its next turn (after its tool-call
   pause, online).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from dualpath.core.scheduler_events import Dispatch
from dualpath.cost import cost_model
from dualpath.kv.hits import readable_hit_blocks
from dualpath.policy import ReadSide, Role, Thresholds, get_policy
from dualpath.sim.agent import Agent
from dualpath.sim.clock import EventLoop
from dualpath.sim.config import SimConfig
from dualpath.sim.decode import DecodeEngineSim
from dualpath.sim.metrics import Metrics
from dualpath.sim.network import FluidNetwork, Link
from dualpath.sim.prefetch import SimPrefetch
from dualpath.sim.prefill import PrefillEngineSim
from dualpath.sim.request import SimRequest
from dualpath.sim.scheduling import SimScheduler
from dualpath.sim.series import Series
from dualpath.sim.sharedlink import SharedLink
from dualpath.sim.storage import NodeStorage
from dualpath.sim.workload import Workload, build_agents, gap_sampler

__all__ = ["Simulation"]


class Simulation:
    """One run: ``Simulation(cfg, workload).run()`` returns its ``Metrics``."""

    def __init__(self, cfg: SimConfig, workload: Workload, agents: list[Agent] | None = None) -> None:
        self.cfg, self.workload = cfg, workload
        self.mode = cfg.sim_mode
        # read on every turn: native fields here, not attribute lookups on the config's objects
        self.block_tokens: int = cfg.block_tokens
        self.oracle: bool = self.mode.oracle
        self.layerwise: bool = self.mode.layerwise
        self.loop = EventLoop()
        self.net = FluidNetwork(self.loop)
        self.cost = cost_model(cfg.target, cfg.gpu)  # prefill engines
        t = self.cost.target
        self.decode_cost = cost_model(cfg.target, cfg.gpu, ep=cfg.decode_ep_size(t.default_ep, t.routed_experts))
        self.layers = t.layers
        self.kv_bytes_per_token = t.kv_bytes_per_token()
        self.predict: Callable = self.cost.attention_time  # the quota is on attention time (§6.2)
        self.metrics = Metrics()
        self.hbm_tokens = cfg.hbm_tokens or self.decode_cost.hbm_kv_capacity_tokens()
        self.thresholds = Thresholds.from_profile(
            snic_bytes_per_s=cfg.snic_bytes_per_s(),
            kv_bytes_per_token=self.kv_bytes_per_token,
            prefill_tokens_per_s=self.cost.prefill_tokens_per_s(),
        )
        policy = get_policy(self.mode.policy, self.thresholds, read_path=self.mode.read_path)
        self.scheduler = SimScheduler(
            self.loop,
            policy,
            interval=cfg.pass_interval_s,
            report_interval=cfg.report_interval_s,
            reserve=self._reserve,
            free=self._free,
            dispatch=self._dispatch,
            failed=self._failed,
            prefetch=self._prefetch_hint if self.mode.prefetch else None,
        )
        self._build_nodes()
        self.prefetch = SimPrefetch(self) if self.mode.prefetch else None
        self.agents = agents if agents is not None else build_agents(workload, cfg.block_tokens)
        self._gap = gap_sampler(workload.tool_gap_s, workload.seed) if workload.tool_gap_s > 0 else None  # None: no pauses
        self._next_rid = 0
        self._started = False  # the agents' first turns are scheduled (run goes on from where it stopped)
        self.agents_done = 0
        self.agents_failed = 0
        self.end_time = 0.0
        self.wall_s = 0.0
        self.cpu_s = 0.0

    def _build_nodes(self) -> None:
        cfg = self.cfg
        snic, cnic = cfg.snic_bytes_per_s(), cfg.cnic_bytes_per_s()
        block_bytes = cfg.block_tokens * self.kv_bytes_per_token
        self.storage: dict[str, NodeStorage] = {}
        self.node_storage: list[NodeStorage] = []  # by node id
        self.prefill_engines: dict[str, PrefillEngineSim] = {}
        self.decode_engines: dict[str, DecodeEngineSim] = {}
        engine_id = 0
        for node_id in range(cfg.prefill_nodes + cfg.decode_nodes):
            prefill = node_id < cfg.prefill_nodes
            name = f"p{node_id}" if prefill else f"d{node_id - cfg.prefill_nodes}"
            read = SharedLink(self.loop, f"{name}.snic.read", snic if prefill else snic * cfg.de_read_share, Series())
            write = SharedLink(self.loop, f"{name}.snic.write", snic, Series())
            self.storage[name] = NodeStorage(
                node_id,
                name,
                self.loop,
                read,
                write,
                buffer_bytes=cfg.buffer_bytes(),
                parallel=cfg.storage_parallel,
                block_tokens=cfg.block_tokens,
                kv_bytes_per_token=self.kv_bytes_per_token,
                on_read=self._read_done,
                changed=self.scheduler.node_changed,
                prefetch_bytes=cfg.prefetch_gb * 1e9 * cfg.node_share if self.mode.prefetch else 0.0,
                prefetch_ttl_s=cfg.prefetch_ttl_s,
            )
            self.node_storage.append(self.storage[name])
            if not self.mode.oracle:  # oracle has no buffers (every slot is granted): no buffer figure to report
                self.scheduler.report(self.storage[name])
            for k in range(cfg.engines):
                ename = f"{name}e{k}"
                lin, lout = Link(f"{ename}.cnic.in", cnic), Link(f"{ename}.cnic.out", cnic)
                if prefill:
                    self.prefill_engines[ename] = PrefillEngineSim(self, engine_id, ename, node_id, lin, lout)
                    self.scheduler.join(ename, name, Role.PREFILL, capacity_tokens=0, block_bytes=block_bytes)
                else:
                    self.decode_engines[ename] = DecodeEngineSim(self, engine_id, ename, node_id, lin, lout, self.hbm_tokens)
                    self.scheduler.join(ename, name, Role.DECODE, capacity_tokens=self.hbm_tokens, block_bytes=block_bytes)
                engine_id += 1

    # -- agents ------------------------------------------------------------------------
    def _submit(self, agent: Agent) -> None:
        k = agent.turn
        prompt = agent.ctx + agent.appends[k]
        hit = readable_hit_blocks(prompt, agent.persisted // self.block_tokens, self.block_tokens) * self.block_tokens
        self._next_rid += 1
        req = SimRequest(self._next_rid, agent, prompt, hit, agent.gens[k], self.loop.now)
        self.scheduler.submit(req, self.block_tokens)

    def _failed(self, req: SimRequest, reason: str) -> None:
        """The scheduler refused or gave up on a turn: its agent stops there."""
        self.agents_failed += 1
        req.agent.done_at = self.loop.now

    # -- the scheduler's commands ------------------------------------------------------------
    def _reserve(self, node: str, rid: str, nbytes: float) -> bool:
        return True if self.oracle else self.storage[node].reserve(rid, nbytes)

    def _free(self, node: str, rid: str) -> None:
        self.storage[node].free_slot(rid)

    def _dispatch(self, req: SimRequest, cmd: Dispatch) -> None:
        req.pe = self.prefill_engines[cmd.prefill_engine]
        req.de = self.decode_engines[cmd.decode_engine]
        req.read_side = cmd.read_side
        if self.oracle or cmd.read_side is None:
            req.t_read = self.loop.now
            req.pe.add(req)
            return
        kvb = self.kv_bytes_per_token
        split = cmd.decision.read_split
        if split is not None:  # split read: the first blocks on the PE node, the rest on the DE node, at once
            pe_tok = split[0] * self.block_tokens
            req.split_de, req.reads_left = req.hit - pe_tok, 2
            self.storage[cmd.prefill_node].read(req, pe_tok * kvb, into_buffer=True, tokens=pe_tok)
            self.storage[cmd.decode_node].read(req, req.split_de * kvb, into_buffer=False, tokens=req.split_de)
            return
        req.reads_left = 1
        node = cmd.prefill_node if cmd.read_side == ReadSide.PE else cmd.decode_node
        # agent-aware prefetch: the leading hits the node's cache holds are taken, not read
        self.storage[node].read(req, req.hit * kvb, into_buffer=cmd.read_side == ReadSide.PE, staged=self.prefetch is not None)

    def _prefetch_hint(self, req: SimRequest, node: str) -> None:
        if self.prefetch is not None:
            self.prefetch.hint(req, node)

    def _read_done(self, req: SimRequest) -> None:
        req.reads_left -= 1
        if req.reads_left > 0:  # a split read's other share is still running
            return
        req.t_read = self.loop.now
        req.pe.add(req)

    # -- engines -----------------------------------------------------------------------------
    def prefill_done(self, req: SimRequest) -> None:
        """Its last chunk ran: first token; the decode engine copies its KV into HBM."""
        req.t_first = self.loop.now
        self.scheduler.finished(req, req.pe.name)
        if req.buffer is not None:  # PE read path: the hits leave the prefill node's slot (prefetch: a run of its cache)
            req.buffer.free_read(req)
        nbytes = 0.0 if self.oracle else req.prompt * self.kv_bytes_per_token
        self.net.start((req.de.cnic_in,), nbytes, self._in_hbm, req)

    def _in_hbm(self, req: SimRequest) -> None:
        de = req.de
        if not self.oracle:
            storage = self.node_storage[de.node_id]
            storage.keep_prompt(req)  # prefetch: the DE read path's slot stays as a run of the prompt
            storage.free_slot(req.key)
        de.add(req)

    def decode_done(self, req: SimRequest, de: DecodeEngineSim) -> None:
        """Its last token: record the turn, free its charges, persist its new blocks."""
        now = self.loop.now
        self.scheduler.finished(req, de.name)
        self.metrics.turn(
            submit=req.t_submit, first=req.t_first, batch=req.t_batch, ttst=req.ttst, end=now, gen=req.gen, prompt=req.prompt, hit=req.hit
        )
        agent = req.agent
        bt = self.block_tokens
        # the prompt's full blocks and those the decode filled (a final token that completes a
        # block gets its flush step; any other last token's KV is never computed)
        persisted = max(req.prompt - req.prompt % bt, req.kv_blocks * bt)
        agent.ctx = req.prompt + req.gen
        nbytes = 0.0 if self.oracle else (persisted - agent.persisted) * self.kv_bytes_per_token
        agent.persisted = persisted
        if nbytes > 0:
            self.node_storage[de.node_id].write(nbytes, self._persisted, agent)
        else:
            self.loop.at(now, self._persisted, agent)

    def _persisted(self, agent: Agent) -> None:
        if self.prefetch is not None:
            self.prefetch.persisted(agent)  # the whole context is in storage: stage it for the next turn
        agent.turn += 1
        if agent.turn < agent.turns:
            self.loop.at(self.loop.now + (self._gap() if self._gap is not None else 0.0), self._submit, agent)
            return
        agent.done_at = self.loop.now
        self.metrics.agent_end.append(self.loop.now)
        self.agents_done += 1
        self.end_time = self.loop.now

    # -- run -------------------------------------------------------------------------------
    def run(self, until: float = float("inf"), tick: Callable[[Simulation], None] | None = None) -> Metrics:
        """Run every agent to its end (or ``until``; a later call goes on from there);
        returns the metrics."""
        if not self._started:
            self._started = True
            for agent in self.agents:
                self.loop.at(agent.arrival, self._submit, agent)
        t0, c0 = time.perf_counter(), time.process_time()
        # Millions of live objects and no reference cycles among them (a test checks that a
        # run leaves no cyclic garbage in every mode): the cyclic collector would only walk
        # them, so it is off while the run lasts; reference counting frees everything.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.loop.run(until, tick=(lambda _t: tick(self)) if tick else None)
        finally:
            if collecting:
                gc.enable()
        self.wall_s = time.perf_counter() - t0
        self.cpu_s = time.process_time() - c0  # what the run cost this process, however busy the machine
        if self.end_time == 0.0 or until != float("inf"):
            self.end_time = self.loop.now
        return self.metrics
