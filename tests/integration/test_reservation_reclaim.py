"""A traffic manager (a real process on a real nats-server) gives back the buffer slots a dead
scheduler reserved and nothing used, once the heartbeat names another scheduler and the grace
has passed; a slot that was used (claimed) stays with its request."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import anyio
import pytest

from dualpath.bus import Bus, BusTimeoutError
from dualpath.protocol import decode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SLOT = 4096
GRACE_S = 1.0


async def test_a_dead_schedulers_unclaimed_slot_is_given_back_after_another_scheduler_is_heard(nats_server, tmp_path):
    subjects = Subjects("reclaim")
    log = (tmp_path / "tm.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.traffic_manager", "--nats-url", nats_server.url, "--namespace", "reclaim"]
        + ["--node-id", "n0", "--storage", str(tmp_path / "storage"), "--buffer-mb", "1", "--report-interval", "0.1"]
        + ["--reclaim-after-s", str(GRACE_S)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        async with Bus.open(nats_server.url, "test") as bus:
            reports: list[m.NodeReport] = []

            async def on_report(raw) -> None:
                reports.append(decode(raw.data, m.NodeReport))

            await bus.subscribe_raw(subjects.node_reports, on_report)
            with anyio.fail_after(60):  # the service starts
                while True:
                    try:
                        await bus.request(subjects.tm("n0", "describe"), m.DescribeRequest(), m.DescribeReply, timeout=1.0)
                        break
                    except BusTimeoutError:
                        await asyncio.sleep(0.2)

            async def beat(instance: str) -> None:
                await bus.publish(subjects.sched_alive, m.SubmitReply(queue_position=0, instance=instance))

            async def alloc(rid: str) -> m.AllocReply:
                req = m.AllocRequest(request_id=rid, blocks=1, block_bytes=SLOT, attempt=0, instance="old@1")
                return await bus.request(subjects.tm("n0", "alloc"), req, m.AllocReply, timeout=5.0)

            await beat("old@1")
            used = await alloc("handed-off")
            # placed after it, next to the free tail: once given back, the free room is one run again
            # (a node reports the largest slot it can place, not its free total)
            await alloc("never-dispatched")
            persist = m.PersistRequest(
                request_id="handed-off",
                model_digest=1,
                region_id=used.region["region_id"],
                offset=used.offset,
                hashes=[],
                parent_chain=[],
                layers=1,
                bytes_per_token_layer=1,
                dtype="uint8",
                block_tokens=1,
            )
            await bus.request(subjects.tm("n0", "persist"), persist, m.Ok, timeout=5.0)  # its decode engine claimed it
            size = reports[-1].buffer_bytes
            with anyio.fail_after(10):  # the traffic manager's next report (every 0.1 s) shows both slots held
                while reports[-1].buffer_free_bytes != size - 2 * SLOT:
                    await asyncio.sleep(0.05)
            await beat("new@2")  # the old scheduler died: another one is active
            t0 = time.monotonic()
            with anyio.fail_after(15):
                while reports[-1].buffer_free_bytes != size - SLOT:
                    await asyncio.sleep(0.05)
            took = time.monotonic() - t0
            again = await alloc("handed-off")  # still its slot (allocation is idempotent per request attempt)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
    print(f"\nunclaimed reservation of the dead scheduler given back {took:.2f}s after another one was heard (grace {GRACE_S:.0f}s)")
    assert GRACE_S <= took < GRACE_S + 5.0, took
    assert again.offset == used.offset
    assert '"reservation_reclaimed"' in (tmp_path / "tm.log").read_text()
