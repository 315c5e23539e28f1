"""The soak's load against loadgen's instant server (a real HTTP server process): outcomes are
classified as completed / failed / lost, the replay notices a differing answer, and the killer
kills a live process of the kind it was given."""

from __future__ import annotations

import random
import subprocess
import sys

import anyio
import pytest

from dualpath.cli.experiment.soak_load import Load, replay, run_load
from loadgen.client import Endpoint
from loadgen.dataset import load_dataset
from loadgen.instant_server import start_instant_server
from loadgen.prompts import PromptText
from loadgen.runner import LoadSpec


class FakeStack:
    """What the killer and the progress line read from a Stack: processes and supervisor events."""

    def __init__(self, procs: list[tuple[str, subprocess.Popen]] | None = None) -> None:
        self.procs = procs or []
        self.events: list = []

    def pid(self, name: str) -> int:
        return dict(self.procs)[name].pid


def _load(url: str, *, seconds: float = 1.0, timeout: float = 10.0, kill_every: float = 100.0, kinds=("engine",)) -> Load:
    agents = 6
    spec = LoadSpec(
        endpoint=Endpoint.parse(url, chat=False, model="instant", timeout_s=timeout),
        trajectories=tuple(load_dataset("32k", agents=agents, seed=1, turns=2, scale=0.002)),
        arrivals=tuple(0.05 * i for i in range(agents)),
        offline=False,
        text_seed=1,
    )
    return Load(spec=spec, prompts=PromptText(None), seconds=seconds, kill_every=kill_every, kinds=list(kinds), rng=random.Random(0))


def test_every_turn_completes_and_a_replay_flags_only_the_answer_that_was_changed() -> None:
    with start_instant_server() as server:
        load = _load(server.url)
        anyio.run(run_load, load, FakeStack(), lambda _m: None)
        assert load.outcomes and all(o.status == "completed" for o in load.outcomes)
        assert sorted((o.agent, o.turn) for o in load.outcomes) == [(a, t) for a in range(6) for t in range(2)]
        endpoint = load.spec.endpoint
        assert anyio.run(replay, load, endpoint)[:2] == (0, 0)
        load.outcomes[3].text += "x"  # as if the soak had streamed one token too many
        differ, unanswered, examples = anyio.run(replay, load, endpoint)
    assert (differ, unanswered) == (1, 0)
    assert examples[0]["agent"] == load.outcomes[3].agent and examples[0]["turn"] == load.outcomes[3].turn


def test_an_http_error_is_a_failed_request_and_no_answer_in_time_is_a_lost_one() -> None:
    with start_instant_server(fail_status=503) as server:
        load = _load(server.url)
        anyio.run(run_load, load, FakeStack(), lambda _m: None)
    assert load.outcomes and {o.status for o in load.outcomes} == {"failed"}
    assert all(o.turn == 0 and o.error.startswith("HTTP 503") for o in load.outcomes)  # a failed agent stops
    with start_instant_server(ttft_s=30.0) as server:
        load = _load(server.url, timeout=0.5)
        anyio.run(run_load, load, FakeStack(), lambda _m: None)
    assert load.outcomes and {o.status for o in load.outcomes} == {"lost"}
    assert "RequestTimeoutError" in load.outcomes[0].error


@pytest.mark.timeout(30)
def test_the_killer_kills_a_live_process_of_a_chosen_kind_and_spares_the_others() -> None:
    decode = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gateway = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with start_instant_server() as server:
            load = _load(server.url, seconds=1.0, kill_every=0.4)
            anyio.run(run_load, load, FakeStack([("decode-d0e0", decode), ("gateway", gateway)]), lambda _m: None)
        assert decode.wait(timeout=5) == -9
        assert gateway.poll() is None
        assert [k["process"] for k in load.kills] == ["decode-d0e0"]  # the second round found nothing alive of that kind
    finally:
        for p in (decode, gateway):
            p.kill()
            p.wait()
