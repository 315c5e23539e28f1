"""The scheduler core's ledger under random event sequences: every figure the policy reads is
the holder's last report plus the charges that report could not have seen, never less."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.core import (
    CoreConfig,
    Dispatch,
    DispatchAnswered,
    EngineReported,
    NodeReported,
    RequestFinished,
    RequestSubmitted,
    ReserveSlot,
    SchedulerCore,
    SlotReserved,
    TimeAdvanced,
)
from dualpath.core.scheduler_members import ACKED, UNSEEN
from dualpath.policy import Thresholds, get_policy
from dualpath.policy.values import Role
from tests.unit.test_scheduler_core import Cluster

HBM = 50_000
ENGINES = {"p0": ("P", Role.PREFILL), "p1": ("P", Role.PREFILL), "d0": ("D", Role.DECODE), "d1": ("D", Role.DECODE)}

step = st.one_of(
    st.tuples(st.just("submit"), st.integers(2, 900), st.integers(0, 6)),
    st.tuples(st.just("tick")),
    st.tuples(st.just("answer"), st.integers(0, 50)),
    st.tuples(st.just("report"), st.sampled_from(sorted(ENGINES)), st.integers(0, 3), st.integers(0, 3000), st.booleans()),
    st.tuples(st.just("node"), st.sampled_from(["P", "D"]), st.integers(0, 3000), st.integers(-1, 40 * 64)),
)
BUFFER = 40 * 64  # bytes of node D's buffer (block_bytes 64), when it reports one


def _check(core: SchedulerCore) -> None:
    """Figures = last report + Σ unreflected charges (clamped), per engine and node."""
    state = core.state
    assert state is not None
    live = {"eng": {}, "node": {}}
    for t in core.requests.values():
        for c in (t.pe_charge, t.de_charge, t.read_charge, t.split_charge, t.slot_charge):
            if c is not None and c.state in (UNSEEN, ACKED):
                kind = "node" if c.holder.name in core.members.nodes else "eng"
                s = live[kind].setdefault(c.holder.name, [0, 0, 0])
                s[0] += c.seq
                s[1] += c.tok
                s[2] += c.hbm
    for e in core.engines():
        seq, tok, hbm = live["eng"].get(e.name, [0, 0, 0])
        assert (e.dseq, e.dtok, e.dhbm) == (seq, tok, hbm)
        fig = state.engines[e.num]
        assert fig.seq == max(0, e.seq + seq) and fig.tok == max(0, e.tok + tok)
        if e.role == Role.DECODE:
            assert fig.free_hbm_tokens == max(0, min(HBM, e.free_hbm - hbm))
    for n in core.nodes():
        _, tok, nbytes = live["node"].get(n.name, [0, 0, 0])
        nfig = state.nodes[n.num]
        assert n.dtok == tok and nfig.read_q == max(0, n.read_q + tok)
        assert n.dhbm == nbytes
        if n.buffer_free >= 0 and n.name == "D":  # free buffer, in 64-byte blocks
            assert nfig.buffer_free == max(0, (n.buffer_free - nbytes) // 64) and nfig.buffer_blocks == BUFFER // 64
        elif n.name == "D":
            assert nfig.buffer_free == -1


@settings(max_examples=150, deadline=None)
@given(st.lists(step, min_size=1, max_size=60))
def test_every_figure_is_the_last_report_plus_the_charges_it_could_not_see(steps):
    core = SchedulerCore(get_policy("dualpath", Thresholds(alpha_tokens=10**6, beta_tokens=10**6)), CoreConfig())
    now, n = 0.0, 0
    for name, (node, role) in ENGINES.items():
        core.handle(
            EngineReported(
                now=now,
                engine=name,
                node=node,
                role=role,
                seq=0,
                tok=0,
                free_hbm_tokens=HBM if role else 0,
                capacity_tokens=HBM if role else 0,
                block_bytes=64,
            )
        )
    pending: list = []  # commands waiting for their answer
    placed: list[tuple[str, str, str]] = []  # (request, prefill engine, decode engine), dispatched
    for s in steps:
        now += 0.01
        if s[0] == "submit":
            core.handle(RequestSubmitted(now=now, request_id=f"r{n}", prompt_tokens=s[1], hit_blocks=s[2], block_tokens=64, max_tokens=8))
            n += 1
        elif s[0] == "tick":
            pending += core.handle(TimeAdvanced(now=now))
        elif s[0] == "answer":  # answer what is pending, up to s[1] answers, in a varying order
            for _ in range(s[1]):
                if not pending:
                    break
                c = pending.pop(s[1] % len(pending))
                if isinstance(c, ReserveSlot):
                    pending += core.handle(SlotReserved(now=now, request_id=c.request_id, attempt=c.attempt))
                elif isinstance(c, Dispatch):
                    core.handle(DispatchAnswered(now=now, request_id=c.request_id, attempt=c.attempt))
                    placed.append((c.request_id, c.prefill_engine, c.decode_engine))
        elif s[0] == "report":
            _, engine, seq, tok, finish = s
            node, role = ENGINES[engine]
            done = ()
            if finish:  # the engine finished the oldest request it holds
                mine = [p for p in placed if engine in p[1:]]
                if mine:
                    done = (mine[0][0],)
                    if role == Role.DECODE:
                        placed.remove(mine[0])
            core.handle(
                EngineReported(
                    now=now,
                    engine=engine,
                    node=node,
                    role=role,
                    seq=seq,
                    tok=tok,
                    free_hbm_tokens=HBM - tok if role else 0,
                    capacity_tokens=HBM if role else 0,
                    finished=done,
                )
            )
        elif s[0] == "node":
            core.handle(NodeReported(now=now, node=s[1], read_q_tokens=s[2], buffer_free_bytes=s[3], buffer_bytes=BUFFER))
        _check(core)


def test_finished_requests_leave_no_acknowledged_charge_behind_on_engines_that_do_not_report():
    """A decode engine acknowledges each request's charge when its prefill ends; a report
    then reflects it. An engine that reports rarely (or, in the simulator, never after it
    joins) must not keep the charges of requests that ended: they need no report to go."""
    c = Cluster()
    for i in range(50):
        d = c.place(f"r{i}")
        c.handle(RequestFinished(now=c.now, request_id=f"r{i}", engine=d.prefill_engine))
        c.now += 0.01
        c.handle(RequestFinished(now=c.now, request_id=f"r{i}", engine=d.decode_engine))
    holders = [*c.core.members.engines.values(), *c.core.members.nodes.values()]
    assert sum(len(h.acked) for h in holders) == 0
    assert all((h.dseq, h.dtok, h.dhbm) == (0, 0, 0) for h in holders)  # and the figures carry nothing of them
