"""A request its client gave up on while it was being prefilled leaves the scheduler: nothing
stays charged to the decode engine it was placed on (a real stack; modeled compute in slow
motion, so that a prefill outlasts the gateway's request timeout).

Before, the prefill engine reported such a task finished, which ends only the prefill part at
the scheduler: the request stayed "running" for good, holding its decode engine's tok_e and
HBM share, and every such timeout shrank what the scheduler thought the cluster could take.
"""

from __future__ import annotations

import time

import pytest
from conftest import start_stack
from faultkit import complete, health, log_events, wait_until

from dualpath.config import EmulationConfig

pytestmark = [pytest.mark.slow, pytest.mark.faults]

PROMPT = "the agent reads the build log and retries the flaky step " * 24
TIMEOUT_S = 2.0  # the gateway's request timeout: shorter than one slowed-down prefill


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("abandoned")
    s = start_stack(
        tiny_model,
        root / "storage",
        root / "run",
        emulation=EmulationConfig(compute="modeled", target="ds27b", slowdown=400.0),
        extra_env={"DUALPATH_REQUEST_TIMEOUT": str(TIMEOUT_S)},
    )
    try:
        yield s
    finally:
        s.stop()


def test_a_request_timed_out_during_its_prefill_leaves_the_scheduler(stack):
    t0 = time.monotonic()
    answer = complete(stack, PROMPT, max_tokens=4, timeout=30)
    assert answer.error is not None and answer.error.startswith("504"), answer  # the gateway gave up on it
    assert time.monotonic() - t0 < 10
    # the gateway cancelled it while the prefill engine still computed it
    wait_until(lambda: log_events(stack, "prefill-p0e0", "task_abandoned"), 30, describe=lambda: health(stack))
    wait_until(
        lambda: health(stack).get("running", 1) == 0 and health(stack).get("queued", 1) == 0,
        10,
        describe=lambda: health(stack),
    )
    assert not log_events(stack, "decode-d0e0", "decode_done")  # it never reached the decode engine
