"""A single scheduler (plain ``dualpath up``, no lease) killed with requests queued: the
supervisor restarts it, the gateway hears the new instance's heartbeat and resubmits what
the dead one held. Real processes: the prefill engine is paused (SIGSTOP) so the requests wait
in the scheduler's queue, then the scheduler gets a real kill -9.

Then a request whose answer had started when the scheduler died: the new scheduler never
heard of it, and its decode engine dies afterwards (kill -9); the gateway resubmits it when
that engine is lost, and the streamed answer resumes exactly.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import pytest
from conftest import start_stack
from faultkit import client, complete, health, log_events, model_of, record, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.faults]

PROMPTS = [f"job {i} of the agent: the linter flagged line {i}, the fix is " + "rename the variable " * 8 for i in range(4)]


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("single-scheduler")
    s = start_stack(tiny_model, root / "storage", root / "run", extra_env={"DUALPATH_REQUEST_TIMEOUT": "45"})
    try:
        yield s
    finally:
        s.stop()


def test_requests_queued_at_a_restarted_single_scheduler_are_resubmitted_and_answered_exactly(stack):
    """Bound: every client whose request the killed scheduler had queued gets its exact greedy
    answer within 20 s of the kill -9 (the supervisor restarts the scheduler, its first
    heartbeat names a new instance, the gateway resubmits), far under the gateway's 45 s."""
    reference = {p: complete(stack, p, max_tokens=32) for p in PROMPTS}
    prefill = next(n for n in stack.supervisor.children if n.startswith("prefill-"))
    os.kill(stack.pid(prefill), signal.SIGSTOP)
    try:
        wait_until(lambda: health(stack).get("prefill_engines", 1) == 0, 20)  # expelled: nothing can be dispatched
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(complete, stack, p, max_tokens=32, timeout=60) for p in PROMPTS]
            wait_until(lambda: health(stack).get("queued", 0) == len(PROMPTS), 20)  # every submit accepted and queued
            t0 = time.monotonic()
            os.kill(stack.pid("scheduler"), signal.SIGKILL)
            os.kill(stack.pid(prefill), signal.SIGCONT)
            answers = [f.result(timeout=70) for f in futures]
            settled = time.monotonic() - t0
    finally:
        os.kill(stack.pid(prefill), signal.SIGCONT)
    for p, a in zip(PROMPTS, answers):
        assert a.error is None and a.text == reference[p].text and a.tokens == 32, (p, a)
    assert any(e.name == "scheduler" and e.kind == "restarted" for e in stack.events)
    assert log_events(stack, "gateway", "scheduler_restarted")
    assert len(log_events(stack, "gateway", "request_resubmitted")) == len(PROMPTS)
    record("single scheduler killed with requests queued, restarted (every client answered)", settled, 20.0)


def test_a_started_request_whose_engine_dies_after_a_scheduler_restart_is_resumed_not_left_hanging(stack):
    """Bound: the streamed client gets its whole exact greedy answer within 20 s of its decode
    engine's kill -9 (the new scheduler expels the engine, or sees it restarted, and announces
    it lost; the gateway resubmits the request; the new run's tokens resume the answer), where
    it waited for its 45 s timeout before."""
    prompt = "the agent reads the failing test and explains why: " + "the assertion compares two lists " * 6
    n = 256
    reference = complete(stack, prompt, max_tokens=n)
    decode = next(c for c in stack.supervisor.children if c.startswith("decode-"))
    model = model_of(stack)
    started, parts, finish = threading.Event(), [], []

    def stream() -> str:
        with client(stack, timeout=90) as c:
            for chunk in c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True):
                for choice in chunk.choices:
                    parts.append(choice.text)
                    started.set()
                    if choice.finish_reason:
                        finish.append(choice.finish_reason)
        return "".join(parts)

    restarts = len(log_events(stack, "gateway", "scheduler_restarted"))
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(stream)
        assert started.wait(30), "no token was streamed"
        os.kill(stack.pid(decode), signal.SIGSTOP)  # mid-decode
        try:
            assert not finish, "the answer ended before the engine was paused: use a longer one"
            os.kill(stack.pid("scheduler"), signal.SIGKILL)
            wait_until(lambda: len(log_events(stack, "gateway", "scheduler_restarted")) > restarts, 20)
        finally:
            os.kill(stack.pid(decode), signal.SIGCONT)
        wait_until(lambda: health(stack).get("decode_engines", 0) >= 1, 10)  # the new scheduler knows the engine, not the request
        assert not finish
        t0 = time.monotonic()
        os.kill(stack.pid(decode), signal.SIGKILL)
        text = answer.result(timeout=60)
        took = time.monotonic() - t0
    assert finish == ["length"] and text == reference.text
    lost = log_events(stack, "gateway", "request_engine_lost")
    assert lost, "the gateway never resubmitted the request"
    print(f"\nresubmitted because: {lost[-1].get('why')}")
    record("decode engine killed after a scheduler restart, its request already streaming (resumed exactly)", took, 20.0)
