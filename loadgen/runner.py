"""Runs agents against a server: offline (all at once) or online (scheduled arrivals).

Each agent owns one connection and runs its turns back to back; turn ``i``'s prompt is the
previous prompt + the answer + append ``i``. Everything measured lands in a ``RunState``
that the caller owns, so a run that is aborted (too many errors, Ctrl-C, the deadline)
still leaves a full record of what happened up to that point.

Offline runs open every agent's connection before the clock starts (a thousand connects
in a row would otherwise sit inside the first turns' TTFT); online agents connect when
they arrive, before their first request is timed.

The cyclic garbage collector is paused for the run: with 1,000 agents its collections
stopped the event loop for up to 30 ms (and ate ~15% of the CPU), which every agent then
saw as latency. A run only makes reference cycles when a connection closes (about eight
small objects each), and those are collected when the run ends.

Bounded time: with ``duration_s`` arrivals stop at ``duration_s`` and the run ends
``drain_s`` later; agents still running are cut off (their in-flight turn is recorded as
``cancelled``). Every request is bounded by the endpoint's timeout. The run aborts once
``max_errors`` turns have failed.
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import anyio

from loadgen.client import Endpoint, ResponseConsumer, TurnResult
from loadgen.conversation import Conversation
from loadgen.errors import HTTPStatusError, RequestTimeoutError, ServerError, ServerUnreachableError
from loadgen.progress import Progress
from loadgen.prompts import PromptText
from loadgen.report import AgentRecord, LogHistogram, Slo, TurnRecord, summarize
from loadgen.trajectory import Trajectory
from loadgen.transports import FastConnection, HttpxConnection, open_connection

__all__ = ["LoadSpec", "RunState", "run_load"]

_MONITOR_TICK_S = 0.05
_BURST = 16  # agents started per event-loop iteration when many are due at once


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSpec:
    """One run: the endpoint, one trajectory and one arrival offset per agent, limits."""

    endpoint: Endpoint
    trajectories: tuple[Trajectory, ...]
    arrivals: tuple[float, ...]
    offline: bool
    duration_s: float | None = None
    drain_s: float = 0.0
    transport: str = "fast"
    text_seed: int = 0
    max_errors: int = 20
    exact_tokens: bool = True
    session_header: bool = True  # each agent sends X-Session-ID (as aiperf --session-header): servers may prefetch its KV
    tool_gap_s: float = 0.0  # mean seconds an agent spends "running a tool" between turns (exponential; 0: back to back)
    untimed_turns: int = 0  # each agent's first turns: run, left out of the figures (loadgen.report.summarize)


SESSION_HEADER = "x-session-id"


def session_headers(spec: LoadSpec, index: int) -> dict[str, str]:
    """The per-agent headers: ``X-Session-ID`` naming this run's agent ``index``."""
    return {SESSION_HEADER: f"agent-{spec.text_seed}-{index}"} if spec.session_header else {}


class RunState:
    """Everything a run measured so far, plus its live counters."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.turns: list[TurnRecord] = []
        self.agents: list[AgentRecord] = []
        self.launched_at: list[float] = []
        self.itl = LogHistogram()
        self.loop_lag = LogHistogram()
        self.active = self.max_active = self.errors = self.tokens = 0
        self.recent_ttft: deque[float] = deque(maxlen=200)
        self.first_error: str | None = None
        self.first_error_kind: str | None = None
        self.abort_reason: str | None = None
        self.wall_s: float | None = None
        self._scope: anyio.CancelScope | None = None

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.t0

    def note_error(self, kind: str, message: str, max_errors: int) -> None:
        """Count a failed turn; abort the run once ``max_errors`` have failed."""
        self.errors += 1
        if self.first_error is None:
            self.first_error, self.first_error_kind = message, kind
        if self.errors >= max_errors and self.abort_reason is None:
            self.abort_reason = f"{self.errors} turns failed (limit --max-errors {max_errors})"
            if self._scope is not None:
                self._scope.cancel()

    def summary(self, slo: Slo, offline: bool, untimed_turns: int = 0) -> dict:
        """The measured part of the report (``loadgen.report.summarize``) plus loop health."""
        wall = self.wall_s if self.wall_s is not None else self.now()
        out = summarize(
            self.turns,
            self.agents,
            slo=slo,
            wall_s=wall,
            itl=self.itl,
            launched_at=self.launched_at,
            offline=offline,
            untimed_turns=untimed_turns,
        )
        out["t0_monotonic"] = self.t0  # run time 0 on this host's CLOCK_MONOTONIC
        lags = [a.started - a.scheduled for a in self.agents]
        out["loadgen"] = {
            "max_active_agents": self.max_active,
            "launch_lag_s": {"p99": sorted(lags)[int(0.99 * (len(lags) - 1))] if lags else None, "max": max(lags, default=None)},
            "loop_lag_s": self.loop_lag.summary(),
        }
        return out


def _error_kind(exc: ServerError) -> str:
    if isinstance(exc, RequestTimeoutError):
        return "timeout"
    if isinstance(exc, ServerUnreachableError):
        return "unreachable"
    return "http" if isinstance(exc, HTTPStatusError) else "stream"


async def run_load(spec: LoadSpec, prompts: PromptText, state: RunState, progress: Progress | None = None) -> None:
    """Run every agent of ``spec`` (bounded as the module docstring says).

    Never raises for server trouble: failed turns are recorded in ``state``. Cancelling the
    caller cuts the agents off the same way the deadline does.
    """
    _raise_fd_limit(len(spec.trajectories))
    connections = None
    if spec.offline:
        # Every agent starts at once: open the connections first, so that the clock does
        # not include a thousand connects run one after another on this event loop.
        connections = [open_connection(spec.endpoint, spec.transport, session_headers(spec, i)) for i in range(len(spec.trajectories))]
        async with anyio.create_task_group() as group:
            for conn in connections:
                group.start_soon(conn.connect)
    state.t0 = time.monotonic()
    deadline = math.inf if spec.duration_s is None else spec.duration_s + spec.drain_s
    collecting = gc.isenabled()
    gc.freeze()  # what exists now (corpus, trajectories) is never scanned again
    gc.disable()
    try:
        async with anyio.create_task_group() as outer:
            outer.start_soon(_monitor, spec, state, progress)
            with anyio.move_on_after(deadline):
                async with anyio.create_task_group() as agents:
                    state._scope = agents.cancel_scope
                    await _launch(spec, prompts, state, agents, connections)
            outer.cancel_scope.cancel()
    finally:
        state.wall_s = state.now()
        gc.unfreeze()
        if collecting:
            gc.enable()
        if progress is not None:
            progress.close()
        with anyio.CancelScope(shield=True):
            for conn in connections or ():  # opened for agents that never launched
                if conn is not None:
                    await conn.aclose()


def _raise_fd_limit(agents: int) -> None:
    """Lift the soft open-files limit (up to the hard one) to fit a socket per agent."""
    try:
        import resource
    except ImportError:  # not on Unix: nothing to adjust
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = agents + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


async def _launch(spec: LoadSpec, prompts: PromptText, state: RunState, group: anyio.abc.TaskGroup, connections: list | None) -> None:
    burst = 0
    for index, (trajectory, at) in enumerate(zip(spec.trajectories, spec.arrivals)):
        if spec.duration_s is not None and at >= spec.duration_s:
            break
        delay = at - state.now()
        if delay > 0:
            await anyio.sleep(delay)
            burst = 0
        elif burst >= _BURST:
            # Agents due at the same moment start in groups with a yield in between, so the
            # event loop reads the first answers while later agents are still sending;
            # otherwise every answer in a 1,000-agent burst waits for the last send.
            await anyio.sleep(0)
            burst = 0
        burst += 1
        if state.abort_reason is not None:
            break
        state.launched_at.append(state.now())
        if connections is not None:
            conn, connections[index] = connections[index], None  # the agent closes it now
        else:
            conn = open_connection(spec.endpoint, spec.transport, session_headers(spec, index))
        group.start_soon(_agent, index, trajectory, float(at), spec, prompts, state, conn)


async def _monitor(spec: LoadSpec, state: RunState, progress: Progress | None) -> None:
    """Measures event-loop lag (how late a 50 ms timer fires) and draws progress each second."""
    expected, next_draw = time.monotonic() + _MONITOR_TICK_S, 0.0
    while True:
        await anyio.sleep(max(0.0, expected - time.monotonic()))
        lag = time.monotonic() - expected
        state.loop_lag.add(max(0.0, lag))
        expected = max(expected + _MONITOR_TICK_S, time.monotonic())
        if progress is not None and state.now() >= next_draw:
            next_draw += 1.0
            progress.update(
                elapsed=state.now(),
                launched=len(state.launched_at),
                total=len(spec.trajectories),
                active=state.active,
                finished=len(state.agents),
                turns=len(state.turns),
                errors=state.errors,
                tokens=state.tokens,
                recent_ttft=list(state.recent_ttft),
            )


def _turn_texts(index: int, trajectory: Trajectory, spec: LoadSpec, prompts: PromptText):
    """Yields (system text, then) each turn's append text, generated lazily."""
    rng = prompts.agent_rng(spec.text_seed, index)
    tagged = False

    def make(tokens: int) -> str:
        nonlocal tagged
        if tokens <= 0:
            return ""
        if not tagged:
            tagged = True
            return prompts.first_segment(rng, index, tokens)
        return prompts.segment(rng, tokens)

    yield trajectory.system_text if trajectory.system_text is not None else make(trajectory.system_tokens)
    for turn, tokens in enumerate(trajectory.append_tokens):
        yield trajectory.append_texts[turn] if trajectory.append_texts is not None else make(tokens)


async def _agent(
    index: int,
    trajectory: Trajectory,
    scheduled: float,
    spec: LoadSpec,
    prompts: PromptText,
    state: RunState,
    conn: FastConnection | HttpxConnection,
) -> None:
    started, done, status = state.now(), 0, "done"
    conversation = Conversation(chat=spec.endpoint.chat, model=spec.endpoint.model, exact=spec.exact_tokens)
    texts = _turn_texts(index, trajectory, spec, prompts)
    conversation.add_system(next(texts))
    expected_prompt = trajectory.system_tokens
    state.active += 1
    state.max_active = max(state.max_active, state.active)
    gaps = random.Random(spec.text_seed * 1_000_003 + index)  # the agent's tool-call gaps, reproducible
    try:
        for turn, (text, gen) in enumerate(zip(texts, trajectory.gen_tokens)):
            if turn and spec.tool_gap_s > 0:  # the agent runs a tool on the last answer before its next turn
                await anyio.sleep(gaps.expovariate(1.0 / spec.tool_gap_s))
            conversation.add_user(text)
            expected_prompt += trajectory.append_tokens[turn]
            base: dict[str, Any] = dict(
                agent=index, turn=turn, t_start=state.now(), expected_prompt_tokens=expected_prompt, expected_gen_tokens=gen
            )
            try:
                itl = state.itl if turn >= spec.untimed_turns else LogHistogram()  # a lead-in turn's gaps are not figures
                result = await conn.request(conversation.body(gen), itl)
            except ServerError as exc:
                kind = _error_kind(exc)
                state.turns.append(TurnRecord(**base, error_kind=kind, error=str(exc)))
                state.note_error(kind, str(exc), spec.max_errors)
                status = "failed"
                return
            except anyio.get_cancelled_exc_class():
                state.turns.append(_cut_off(base, conn.current))
                status = "cancelled"
                raise
            base["t_start"] = result.t_send - state.t0  # when the request left, not when it was built
            state.turns.append(_completed(base, result))
            state.tokens += result.completion_tokens or result.chunks
            if result.ttft is not None and turn >= spec.untimed_turns:
                state.recent_ttft.append(result.ttft)
            conversation.add_answer(result.text)
            expected_prompt += gen
            done += 1
    finally:
        state.active -= 1
        state.agents.append(
            AgentRecord(
                agent=index,
                scheduled=scheduled,
                started=started,
                ended=state.now(),
                turns_done=done,
                turns_total=trajectory.turns,
                status=status,
            )
        )
        with anyio.CancelScope(shield=True):
            await conn.aclose()


def _completed(base: dict, r: TurnResult) -> TurnRecord:
    return TurnRecord(
        **base,
        ttft=r.ttft,
        ttst=r.ttst,
        tpot=r.tpot,
        e2e=r.e2e,
        max_itl=r.max_itl,
        prompt_tokens=r.prompt_tokens,
        completion_tokens=r.completion_tokens,
        cached_tokens=r.cached_tokens,
        server_timing=r.server_timing,
        ttft_queue=r.ttft_queue,
        ttft_exec=r.ttft_exec,
    )


def _cut_off(base: dict, consumer: ResponseConsumer | None) -> TurnRecord:
    """The in-flight turn of an agent cut off by the end of the run."""
    if consumer is None:  # still connecting: the request was never sent
        return TurnRecord(**base, error_kind="cancelled", error="run ended before the request was sent")
    now = time.monotonic()
    ttft = consumer.t_first - consumer.t_send if consumer.count else None
    return TurnRecord(**base, error_kind="cancelled", error="run ended mid-turn", ttft=ttft, e2e=now - consumer.t_send)
