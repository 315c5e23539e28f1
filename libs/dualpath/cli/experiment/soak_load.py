"""The soak's load: online agents, a killer and a progress line, owned by one anyio task group.

Agents arrive as a Poisson process (``loadgen.arrivals``) and run their trajectory's turns back
to back over loadgen's streaming client, with the texts ``dualpath loadgen`` sends for the same
seed (so storage warmed by a loadgen run holds their history). Unlike loadgen, every request's
outcome is kept with its answer:

* *completed*: HTTP 200 and exactly the tokens asked for;
* *failed*: an explicit error, an HTTP error status or an SSE error event; the agent stops
  (its next prompt would need this answer);
* *lost*: no answer, the client gave up after its timeout, the connection broke, or the answer
  ended short without an error.

No agent starts a turn after ``seconds``; turns in flight then finish (bounded by the client
timeout). The killer sends SIGKILL to one process of a random kind every ``every`` seconds until
``seconds`` (the kinds come in shuffled rounds, so a short soak still hits each of them); the
stack's supervisor restarts it. ``replay`` asks every completed turn again, with
the soak's own history as its prompt, on an undisturbed stack, and counts differing answers.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import anyio

from loadgen.client import Endpoint
from loadgen.conversation import Conversation
from loadgen.errors import HTTPStatusError, RequestTimeoutError, ServerError, StreamError
from loadgen.prompts import PromptText
from loadgen.runner import LoadSpec, _turn_texts, session_headers
from loadgen.transports import open_connection

__all__ = ["KINDS", "Load", "Outcome", "classify", "replay", "run_load"]

KINDS = {
    "engine": ("prefill-", "decode-"),
    "traffic-manager": ("traffic-manager-",),
    "scheduler": ("scheduler",),
    "kv-persistence": ("kv-persistence",),
}
_ERROR_EVENT = "server sent an error event"  # loadgen.client's StreamError for an SSE error event


@dataclass(slots=True)
class Outcome:
    """One request of the soak. Times are host seconds since the soak began."""

    agent: int
    turn: int
    started: float
    ended: float | None = None
    status: str = "lost"  # completed | failed | lost
    text: str = ""
    error: str = ""
    ttft_s: float | None = None  # host seconds, as the client measured them
    tpot_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server found in storage


@dataclass(slots=True, kw_only=True)
class Load:
    """What the soak runs: the agents (a loadgen spec with host-time arrivals) and the kills."""

    spec: LoadSpec
    prompts: PromptText
    seconds: float  # host seconds during which turns start and kills happen
    kill_every: float
    kinds: list[str]
    rng: random.Random
    progress_every: float = 15.0
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0


def classify(exc: ServerError) -> tuple[str, str]:
    """``(status, message)`` of a request that raised ``exc``: failed when the server said so."""
    if isinstance(exc, HTTPStatusError):
        return "failed", f"HTTP {exc.status}: {exc.body[:200]}"
    if isinstance(exc, StreamError) and not isinstance(exc, RequestTimeoutError) and str(exc).startswith(_ERROR_EVENT):
        return "failed", str(exc)
    return "lost", f"{type(exc).__name__}: {exc}"


def _turns(load: Load, index: int) -> Iterator[tuple[str, int]]:
    """(system text, 0) then each turn's (append text, generation tokens) of agent ``index``."""
    texts = _turn_texts(index, load.spec.trajectories[index], load.spec, load.prompts)  # loadgen's own texts
    yield next(texts), 0
    yield from zip(texts, load.spec.trajectories[index].gen_tokens)


async def _agent(load: Load, index: int) -> None:
    conn = open_connection(load.spec.endpoint, "fast", session_headers(load.spec, index))
    conversation = Conversation(chat=False, model=load.spec.endpoint.model)
    turns = _turns(load, index)
    conversation.add_system(next(turns)[0])
    try:
        for turn, (text, gen) in enumerate(turns):
            if load.now() >= load.seconds:
                return
            conversation.add_user(text)
            out = Outcome(agent=index, turn=turn, started=load.now())
            load.outcomes.append(out)
            try:
                r = await conn.request(conversation.body(gen))
            except ServerError as exc:
                out.ended = load.now()
                out.status, out.error = classify(exc)
                return
            out.ended = load.now()
            n = r.completion_tokens if r.completion_tokens is not None else r.chunks
            if n != gen:
                out.error = f"answer ended after {n} of {gen} tokens without an error"
                return
            out.status, out.text, out.ttft_s, out.tpot_s = "completed", r.text, r.ttft, r.tpot
            out.prompt_tokens, out.cached_tokens = r.prompt_tokens or 0, r.cached_tokens or 0
            conversation.add_answer(r.text)
    finally:
        with anyio.CancelScope(shield=True):
            await conn.aclose()


async def _launch(load: Load, group: anyio.abc.TaskGroup) -> None:
    for index, at in enumerate(load.spec.arrivals):
        if at >= load.seconds:
            return
        await anyio.sleep(max(0.0, at - load.now()))
        group.start_soon(_agent, load, index)


async def _killer(load: Load, stack) -> None:
    """SIGKILL one live process of a random kind every ``kill_every`` seconds until ``seconds``."""
    n, bag = 0, []  # type: tuple[int, list[str]]
    while True:
        n += 1
        due = n * load.kill_every
        await anyio.sleep(max(0.0, min(due, load.seconds) - load.now()))
        if due >= load.seconds:
            return
        if not bag:  # kinds in shuffled rounds: random order, yet every kind is hit within len(kinds) kills
            bag = load.rng.sample(load.kinds, len(load.kinds))
        kind = bag.pop()
        names = sorted(name for name, p in stack.procs if name.startswith(KINDS[kind]) and p.poll() is None)
        if not names:
            continue
        name = load.rng.choice(names)
        try:
            pid = stack.pid(name)
            os.kill(pid, signal.SIGKILL)
        except (KeyError, ProcessLookupError):
            continue
        load.kills.append({"t": round(load.now(), 2), "wall": time.time(), "kind": kind, "process": name, "pid": pid})


async def _progress(load: Load, stack, say: Callable[[str], None]) -> None:
    while True:
        await anyio.sleep(load.progress_every)
        outs = load.outcomes
        count = {k: sum(o.status == k for o in outs if o.ended is not None) for k in ("completed", "failed", "lost")}
        restarts = sum(e.kind == "restarted" for e in stack.events)
        phase = f"{load.now():.0f}/{load.seconds:.0f} s" if load.now() < load.seconds else f"draining ({load.now():.0f} s)"
        say(
            f"soak {phase}: started {len(outs)}, completed {count['completed']}, failed {count['failed']}, "
            f"lost {count['lost']}, in flight {sum(o.ended is None for o in outs)}; kills {len(load.kills)}, restarts {restarts}; "
            f"load average {os.getloadavg()[0]:.1f}"
        )


async def run_load(load: Load, stack, say: Callable[[str], None]) -> None:
    """Run the agents, the killer and the progress line; returns when every agent has finished
    and the kills are over (at ``seconds``, even if the agents ran out before)."""
    async with anyio.create_task_group() as outer:
        outer.start_soon(_progress, load, stack, say)
        async with anyio.create_task_group() as work:
            work.start_soon(_killer, load, stack)
            await _launch(load, work)
        outer.cancel_scope.cancel()


async def replay(
    load: Load, endpoint: Endpoint, concurrency: int = 16, say: Callable[[str], None] = lambda _m: None
) -> tuple[int, int, list[dict]]:
    """Ask every completed turn again at ``endpoint`` (an undisturbed stack), each agent's turns in
    order with the soak's history as prompt; ``say`` gets a progress line every ``progress_every``
    seconds. Returns (answers that differ, turns not answered again, up to three examples of
    differing answers)."""
    done: dict[int, dict[int, Outcome]] = {}
    for o in load.outcomes:
        if o.status == "completed":
            done.setdefault(o.agent, {})[o.turn] = o
    result = {"asked": 0, "differ": 0, "unanswered": 0}
    total = sum(len(kept) for kept in done.values())
    examples: list[dict] = []
    limit = anyio.CapacityLimiter(concurrency)

    async def agent(index: int, kept: dict[int, Outcome]) -> None:
        async with limit:
            conn = open_connection(endpoint, "fast", session_headers(load.spec, index))
            conversation = Conversation(chat=False, model=endpoint.model)
            turns = _turns(load, index)
            conversation.add_system(next(turns)[0])
            try:
                for turn, (text, gen) in enumerate(turns):
                    if turn not in kept:
                        return
                    conversation.add_user(text)
                    result["asked"] += 1
                    try:
                        again = (await conn.request(conversation.body(gen))).text
                    except ServerError:
                        result["unanswered"] += len(kept) - turn
                        return
                    if again != kept[turn].text:
                        result["differ"] += 1
                        if len(examples) < 3:
                            examples.append({"agent": index, "turn": turn, "soak": kept[turn].text[:80], "undisturbed": again[:80]})
                    conversation.add_answer(kept[turn].text)  # the soak's history, whatever the replay said
            finally:
                with anyio.CancelScope(shield=True):
                    await conn.aclose()

    async def progress() -> None:
        t0 = time.monotonic()
        while True:
            await anyio.sleep(load.progress_every)
            say(
                f"replay {time.monotonic() - t0:.0f} s: asked {result['asked']} of {total}, {result['differ']} differ, "
                f"{result['unanswered']} not answered; load average {os.getloadavg()[0]:.1f}"
            )

    async with anyio.create_task_group() as outer:
        outer.start_soon(progress)
        async with anyio.create_task_group() as group:
            for index, kept in sorted(done.items()):
                group.start_soon(agent, index, kept)
        outer.cancel_scope.cancel()
    return result["differ"], result["unanswered"], examples
