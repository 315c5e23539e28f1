"""Helpers of the fault suite: clients, timing a recovery, reading service logs, finding the leader."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

RECOVERY: dict[str, float] = {}  # fault -> observed recovery seconds (printed at the end of the session)


def record(fault: str, seconds: float, bound: float) -> float:
    """Keep the observed recovery time of ``fault`` and check it is within ``bound``."""
    RECOVERY[fault] = seconds
    print(f"\nFAULT {fault}: recovered in {seconds:.2f}s (bound {bound:.0f}s)")
    assert seconds < bound, f"{fault}: recovery took {seconds:.1f}s, bound {bound:.0f}s"
    return seconds


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.1, describe: Callable[[], object] | None = None) -> float:
    """Seconds until ``pred()`` holds; raises AssertionError after ``timeout`` (with what
    ``describe()`` says of the state then, when given)."""
    t0 = time.monotonic()
    while True:
        try:
            ok = pred()
        except Exception:  # noqa: BLE001 - a probe against a recovering stack may fail
            ok = False
        if ok:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            seen = ""
            if describe is not None:
                try:
                    seen = f"; state then: {describe()}"
                except Exception as exc:  # noqa: BLE001 - the description must not hide the timeout
                    seen = f"; state unknown ({exc!r})"
            raise AssertionError(f"condition not met within {timeout:.0f}s{seen}")
        time.sleep(step)


def first_served(probe: Callable[[], bool], timeout: float, *, since: float | None = None, every: float = 0.5, workers: int = 32) -> float:
    """Seconds from ``since`` (a ``time.monotonic()``; default now) until one of a stream of
    overlapping probes succeeds: a new ``probe()`` starts every ``every`` s, each waits as long
    as it needs. A probe sent while the stack cannot answer hangs until it can, so sequential
    probes with a timeout would add up to one timeout of their own to the time measured;
    overlapping ones see the first answer when it comes. Raises AssertionError ``timeout`` s
    after ``since``."""
    t0 = time.monotonic() if since is None else since
    done: list[float] = []

    def one() -> None:
        try:
            if probe():
                done.append(time.monotonic() - t0)
        except Exception:  # noqa: BLE001 - a probe against a recovering stack may fail
            pass

    pool = cf.ThreadPoolExecutor(workers)
    try:
        while not done:
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"no probe succeeded within {timeout:.0f}s")
            pool.submit(one)
            time.sleep(every)
        return min(done)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # probes still in flight end on their own timeout


def client(stack, timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=timeout)


def model_of(stack) -> str:
    with client(stack) as c:
        return c.models.list().data[0].id


@dataclass
class Answer:
    text: str | None
    tokens: int
    info: dict
    error: str | None = None
    seconds: float = 0.0


def complete(stack, prompt, *, max_tokens: int = 32, read_path: str | None = None, timeout: float = 60.0) -> Answer:
    """One greedy completion; an HTTP error is an explicit error (never raised)."""
    extra = {"dualpath_read_path": read_path} if read_path else {}
    model = model_of(stack)
    t0 = time.monotonic()
    try:
        with client(stack, timeout) as c:  # closed: its pooled sockets would be an unraisable ResourceWarning
            r = c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
    except openai.APIStatusError as exc:
        return Answer(None, 0, {}, error=f"{exc.status_code}: {exc.message}", seconds=time.monotonic() - t0)
    return Answer(r.choices[0].text, r.usage.completion_tokens, r.model_extra.get("dualpath", {}), seconds=time.monotonic() - t0)


def chat_cached(stack, messages, *, max_tokens: int = 1) -> int:
    """Cached prompt tokens of one chat request (the index's hit for this prompt)."""
    model = model_of(stack)
    with client(stack) as c:
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens


def concurrently(fn, items, workers: int = 8, timeout: float = 90.0) -> list:
    with cf.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(fn, x) for x in items]
        return [f.result(timeout=timeout) for f in futures]


def health(stack) -> dict:
    return httpx.get(stack.url + "/health", timeout=2.0).json()


def log_events(stack, name: str, event: str) -> list[dict]:
    """The JSON log lines of service ``name`` whose event is ``event``."""
    path = Path(stack.logs) / f"{name}.log"
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if f'"{event}"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def active_scheduler(stack) -> str:
    """The scheduler child that logged ``scheduler_active`` last and is running."""
    best, when = "", ""
    for name, proc in stack.procs:
        if name.startswith("scheduler") and proc.poll() is None:
            for ev in log_events(stack, name, "scheduler_active"):
                if ev["timestamp"] > when:
                    best, when = name, ev["timestamp"]
    assert best, "no active scheduler"
    return best


def tm_answers(stack, node: str) -> bool:
    """True when node ``node``'s traffic manager answers a describe request over NATS."""
    import asyncio

    import nats

    from dualpath.protocol import decode, encode
    from dualpath.protocol import messages as m
    from dualpath.protocol.subjects import Subjects

    async def probe() -> bool:
        nc = await nats.connect(stack.nats_url.split(","), connect_timeout=2, allow_reconnect=False, **stack.nats_options())
        try:
            reply = await nc.request(Subjects(stack.namespace).tm(node, "describe"), encode(m.DescribeRequest()), timeout=1.0)
            return decode(reply.data, m.DescribeReply).node_id == node
        except Exception:  # noqa: BLE001 - not answering yet
            return False
        finally:
            await nc.close()

    return asyncio.run(probe())


def netns_unusable() -> str:
    """Why ``dualpath netns`` cannot run here ('' when it can): not Linux, not root, or
    ``ip netns add`` not permitted."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "dualpath netns needs root (ip netns add)"
    probe = f"dpprobe{uuid.uuid4().hex[:6]}"
    try:
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no usable `ip` command: {exc}"
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def ip_state() -> dict[str, list[str]]:
    """The root namespace's addresses, routes and namespace list (to compare before and after)."""
    out = {}
    for key, cmd in (("addr", ["ip", "-br", "addr"]), ("route", ["ip", "route"]), ("netns", ["ip", "netns", "list"])):
        out[key] = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    return out
