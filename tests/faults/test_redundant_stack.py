"""Faults on the redundant form (``dualpath up --replicas 2 --nats-cluster 3``, 2P2D): real
kill -9 and SIGSTOP of real processes; each test states the recovery bound it checks.

One stack serves the module (starting it is the slow part); every test leaves it whole again.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest
from conftest import start_stack
from faultkit import (
    Answer,
    active_scheduler,
    chat_cached,
    complete,
    concurrently,
    health,
    log_events,
    record,
    tm_answers,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.faults]

PROMPTS = [f"agent {i} reports: the build failed on step {i}, the log says " + "retry the flaky step " * 10 for i in range(6)]


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("redundant")
    s = start_stack(
        tiny_model,
        root / "storage",
        root / "run",
        topology="2P2D",
        replicas=2,
        nats_cluster=3,
        extra_env={"DUALPATH_REQUEST_TIMEOUT": "45"},
    )
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def reference(stack) -> dict[str, Answer]:
    """Undisturbed greedy answers to compare with."""
    return {p: complete(stack, p, max_tokens=48) for p in PROMPTS}


def _whole(stack, want_p: int = 2, want_d: int = 2) -> bool:
    h = health(stack)
    return h.get("prefill_engines", 0) >= want_p and h.get("decode_engines", 0) >= want_d


def test_active_scheduler_killed_with_requests_in_flight_standby_takes_over(stack, reference):
    """Bound: the standby is active within 8 s (lease TTL 3 s + a quarter of it + start); every
    in-flight client gets its complete greedy answer within 20 s of the kill (the gateway resubmits
    what no run had started to the new leader), far under the gateway's 45 s timeout."""
    victim = active_scheduler(stack)
    actives_before = {n: len(log_events(stack, n, "scheduler_active")) for n in ("scheduler", "scheduler-1")}

    def ask(p: str) -> Answer:
        return complete(stack, p, max_tokens=48, timeout=60)

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        t_sent = time.monotonic()
        futures = [pool.submit(ask, p) for p in PROMPTS]
        # kill while the scheduler holds them (queued or running), not after they finished
        wait_until(lambda: sum(health(stack).get(k, 0) for k in ("queued", "running")) > 0 or all(f.done() for f in futures), 10)
        t0 = time.monotonic()
        os.kill(stack.pid(victim), signal.SIGKILL)
        unfinished = sum(not f.done() for f in futures)
        took = wait_until(lambda: any(len(log_events(stack, n, "scheduler_active")) > c for n, c in actives_before.items()), 20)
        record("scheduler killed (standby takes over)", took, 8.0)
        # new requests are served by the new leader while the in-flight ones are still settling
        first_ok = wait_until(lambda: complete(stack, PROMPTS[0], max_tokens=48).text == reference[PROMPTS[0]].text, 30)
        record("scheduler killed (new requests served)", time.monotonic() - t0, 15.0)
        assert first_ok < 30
        answers = [f.result(timeout=70) for f in futures]
        settled = max(t_sent + a.seconds for a in answers) - t0  # the last answer, from the kill
        print(f"scheduler killed with {unfinished} of {len(PROMPTS)} requests unfinished")
        record("scheduler killed (every in-flight client answered)", max(settled, 0.0), 20.0)
    for p, a in zip(PROMPTS, answers):
        assert a.error is None and a.text == reference[p].text and a.tokens == 48, (p, a)
    assert log_events(stack, "gateway", "scheduler_restarted")  # the gateway saw the new leader
    wait_until(lambda: _whole(stack), 30)


def test_requests_queued_at_a_killed_scheduler_are_resubmitted_to_the_standby_and_answered_once(stack, reference):
    """Bound: requests the active scheduler accepted but could not dispatch yet (both prefill
    engines paused, so they wait in its queue) all get their complete greedy answer within 20 s
    of its kill -9: the gateway sees the lease move and resubmits them to the new leader."""
    victim = active_scheduler(stack)
    prefills = sorted(n for n in stack.supervisor.children if n.startswith("prefill-"))
    for n in prefills:
        os.kill(stack.pid(n), signal.SIGSTOP)
    try:
        # expelled: nothing can be dispatched
        wait_until(lambda: health(stack).get("prefill_engines", 1) == 0, 20, describe=lambda: health(stack))
        resubmitted_before = len(log_events(stack, "gateway", "request_resubmitted"))
        rounds_before = len(log_events(stack, "gateway", "scheduler_restarted"))
        known_before = len(log_events(stack, "gateway", "resubmission_known"))
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(complete, stack, p, max_tokens=48, timeout=60) for p in PROMPTS]
            # every submit accepted and queued (a precondition, not a bound)
            wait_until(
                lambda: health(stack).get("queued", 0) == len(PROMPTS),
                30,
                describe=lambda: (health(stack), [f.result() for f in futures if f.done()]),
            )
            t0 = time.monotonic()
            os.kill(stack.pid(victim), signal.SIGKILL)
            for n in prefills:
                os.kill(stack.pid(n), signal.SIGCONT)
            answers = [f.result(timeout=70) for f in futures]
            settled = time.monotonic() - t0
    finally:
        for n in prefills:
            os.kill(stack.pid(n), signal.SIGCONT)
    for p, a in zip(PROMPTS, answers):
        assert a.error is None and a.text == reference[p].text and a.tokens == 48, (p, a)
    assert len(log_events(stack, "gateway", "request_resubmitted")) - resubmitted_before == len(PROMPTS)
    # one failover is one resubmission round (the new leader's instance, heard once)
    assert len(log_events(stack, "gateway", "scheduler_restarted")) - rounds_before == 1
    assert len(log_events(stack, "gateway", "resubmission_known")) == known_before
    record("scheduler killed with requests queued (every client answered)", settled, 20.0)
    wait_until(lambda: _whole(stack), 30)


def test_kv_persistence_replica_killed_during_commits_loses_no_committed_block(stack):
    """Bound: the killed replica is back (stream replayed) within 15 s; lookups keep being answered
    meanwhile; every block hit before the second replica is killed is still a hit from the first."""
    convs = [[{"role": "user", "content": f"conversation {i}: " + "the tool printed a long listing of files " * 8}] for i in range(4)]
    loaded_before = len(log_events(stack, "kv-persistence", "index_loaded"))

    def turn(msgs):
        r = complete_chat(stack, msgs)
        msgs.append({"role": "assistant", "content": r})
        msgs.append({"role": "user", "content": "next observation: " + "ok " * 30})
        return r

    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(4) as pool:
        first = [pool.submit(turn, c) for c in convs]
        # Once one first turn is answered its prompt blocks were committed; the others' commits
        # (prompt or generated blocks) are still coming: the kill lands among them.
        wait_until(lambda: any(f.done() for f in first), 60)
        t0 = time.monotonic()
        os.kill(stack.pid("kv-persistence"), signal.SIGKILL)
        [f.result(timeout=60) for f in first]
        concurrently(turn, convs, workers=4)  # second turns: commits while the replica replays
    wait_until(lambda: len(log_events(stack, "kv-persistence", "index_loaded")) > loaded_before, 30)
    record("kv-persistence replica killed (replica back, index replayed)", time.monotonic() - t0, 15.0)
    [chat_cached(stack, c) for c in convs]  # this turn's own blocks get committed too: measure after it
    # Commits may still be on their way: read until two reads in a row agree (not one sleep).
    reads = [[chat_cached(stack, c) for c in convs]]

    def settled() -> bool:
        reads.append([chat_cached(stack, c) for c in convs])
        return reads[-1] == reads[-2]

    wait_until(settled, 30, step=0.5)
    hits_both = reads[-1]
    assert sum(hits_both) > 0
    stack.supervisor.hold("kv-persistence-1")  # only the restarted replica answers from here
    victim = stack.supervisor.children["kv-persistence-1"].proc
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: victim.poll() is not None, 10)
    # A lookup sent before NATS drops the dead replica's subscription may go unanswered (a miss):
    # poll, with a deadline, for the restarted replica alone to give every earlier hit back.
    hits_restarted: list[list[int]] = []

    def replayed() -> bool:
        hits_restarted.append([chat_cached(stack, c) for c in convs])
        return hits_restarted[-1] == hits_both

    wait_until(replayed, 15, step=0.3, describe=lambda: {"both": hits_both, "restarted alone": hits_restarted[-3:]})
    stack.supervisor.restart_now("kv-persistence-1")


def complete_chat(stack, messages) -> str:
    from faultkit import client, model_of

    model = model_of(stack)
    with client(stack) as c:
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    return r.choices[0].message.content


def test_one_nats_server_of_three_killed_services_reconnect(stack, reference):
    """Bound: with one of three nats-servers down, a request is answered within 10 s; after it
    returns, the cluster serves again within 15 s."""
    stack.supervisor.hold("nats-1")
    t0 = time.monotonic()
    os.kill(stack.pid("nats-1"), signal.SIGKILL)
    p = PROMPTS[1]
    took = wait_until(lambda: complete(stack, p, max_tokens=48, timeout=15).text == reference[p].text, 30)
    record("one NATS server of 3 killed (requests served)", took, 10.0)
    answers = concurrently(lambda q: complete(stack, q, max_tokens=48), PROMPTS, workers=3)
    assert [a.text for a in answers] == [reference[q].text for q in PROMPTS]
    stack.supervisor.restart_now("nats-1")
    took = wait_until(lambda: complete(stack, p, max_tokens=48, timeout=15).text == reference[p].text, 30)
    record("NATS server back (requests served)", took, 15.0)
    assert time.monotonic() - t0 < 60


def test_decode_engine_paused_past_heartbeat_is_expelled_and_rejoins_without_duplicates(stack, reference):
    """Bound: SIGSTOP for 5 s (engine timeout 3 s): every request completes with its exact greedy
    answer (no duplicate or missing tokens) within 30 s; the engine is back in /health within 10 s of SIGCONT."""
    pid = stack.pid("decode-d0e0")
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(complete, stack, p, max_tokens=48) for p in PROMPTS]
        wait_until(lambda: health(stack).get("running", 0) > 0, 10)  # placed: the pause lands on requests in flight
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        in_flight = sum(not f.done() for f in futures)
        try:
            wait_until(lambda: health(stack).get("decode_engines", 2) < 2, 15)
            time.sleep(max(0.0, 5.0 - (time.monotonic() - t0)))
        finally:
            os.kill(pid, signal.SIGCONT)
        t1 = time.monotonic()
        answers = [f.result(timeout=60) for f in futures]
    assert in_flight > 0, "every request was answered before the pause: nothing was tested"
    for p, a in zip(PROMPTS, answers):
        assert a.error is None and a.text == reference[p].text and a.tokens == 48, (p, a)
    record("decode engine paused (all requests answered)", time.monotonic() - t0, 30.0)
    wait_until(lambda: _whole(stack), 20)
    record("decode engine resumed (rejoined)", time.monotonic() - t1, 10.0)


def test_traffic_manager_killed_during_de_reads_requests_retried_elsewhere(stack, reference):
    """Bound: with a decode node's traffic manager dead, DE-path requests are answered within 15 s
    (retried on the other node); the node serves again within 20 s of its return."""
    long = "the repository has these files and each of them matters " * 12  # several full blocks: hits to read
    first = complete(stack, long, max_tokens=16)
    assert first.text is not None
    stack.supervisor.hold("traffic-manager-d0")
    t0 = time.monotonic()
    os.kill(stack.pid("traffic-manager-d0"), signal.SIGKILL)
    answers = concurrently(lambda _i: complete(stack, long, max_tokens=16, read_path="de", timeout=40), range(4), workers=4)
    served = time.monotonic() - t0
    stack.supervisor.restart_now("traffic-manager-d0")
    took = wait_until(lambda: tm_answers(stack, "d0"), 30)
    record("traffic manager back (answers again)", took, 20.0)
    served_again = wait_until(
        lambda: all(
            a.text == first.text
            for a in concurrently(lambda _i: complete(stack, long, max_tokens=16, read_path="de", timeout=20), range(8), workers=4)
        ),
        30,
    )
    record("traffic manager back (DE reads served on every node)", served_again, 20.0)
    print("answers with the traffic manager dead:", [a.error or "ok" for a in answers], f"in {served:.1f}s")
    assert all(a.text == first.text for a in answers), [a.error for a in answers]
    record("traffic manager killed during DE reads (requests answered)", served, 15.0)
