"""Engines report in the units the scheduler charges (``EngineReport``): a prefill engine's
``tok_e`` is miss tokens, also while its hits load; a decode engine's is Σ prompt + max_tokens,
and its free HBM already excludes requests waiting for admission."""

from __future__ import annotations

from types import SimpleNamespace

from dualpath.core.attempts import AttemptTable
from dualpath.core.decode_batcher import DecodeBatcher
from dualpath.core.prefill_batcher import PrefillBatcher
from dualpath.protocol import messages as m
from services.prefill_engine.engine import Job, PrefillEngine, PrefillPhase

BT = 64


def _task(rid: str, prompt: int, hits: int, read_path: int) -> m.PrefillTask:
    return m.PrefillTask(
        request_id=rid,
        model="m",
        model_digest=0,
        prompt_tokens=[1] * prompt,
        block_hashes=[],
        hit_blocks=hits,
        sampling={},
        reply_subject="r",
        read_path=read_path,
        prefill_engine="p0",
        prefill_node="P",
        decode_engine="d0",
        decode_node="D",
        de_region={},
        de_offset=0,
    )


def _prefill_engine() -> PrefillEngine:
    """A prefill engine with its request table and batcher, no model and no bus."""
    engine = PrefillEngine.__new__(PrefillEngine)
    engine.setup = SimpleNamespace(layout=SimpleNamespace(block_tokens=BT))  # type: ignore[assignment]
    engine.batcher = PrefillBatcher(lambda _items: 0.001, block_tokens=BT)
    engine.requests = AttemptTable(PrefillPhase.LOADING)
    return engine


def _held(engine: PrefillEngine, task: m.PrefillTask, *, loaded_blocks: int | None = None) -> Job:
    """``task`` taken by ``engine``: still loading, or (``loaded_blocks``) loaded and queued."""
    [start] = engine.requests.arrive(task.request_id, task.attempt, task)
    job = start.run.state = Job(held=start.run, dest=None)  # type: ignore[arg-type]
    if loaded_blocks is not None:
        job.hit_blocks = loaded_blocks
        engine.requests.move(start.run, PrefillPhase.QUEUED)
    return job


def test_a_prefill_engine_counts_planned_hits_as_read_while_the_load_runs_and_loaded_blocks_after():
    engine = _prefill_engine()
    _held(engine, _task("a", 300, 2, int(m.ReadPath.DE)))  # its hits are being read
    _held(engine, _task("b", 200, 3, int(m.ReadPath.NONE)))  # no read path: every token is computed
    _held(engine, _task("c", 300, 4, int(m.ReadPath.PE)), loaded_blocks=1)  # the read node found fewer blocks than planned
    _held(engine, _task("d", 500, 2, int(m.ReadPath.PE)), loaded_blocks=2)
    engine.batcher.add("d", cached=2 * BT, total=500)
    want = (300 - 2 * BT) + 200 + (300 - BT) + (500 - 2 * BT)  # what the scheduler charges, less what the load changed
    assert engine.tokens_left() == want
    engine.batcher.next_batch()  # computing "d" changes nothing until its batch ends
    assert engine.tokens_left() == want


def test_a_decode_engine_reports_prompt_plus_max_tokens_and_free_hbm_net_of_waiting_requests():
    b = DecodeBatcher(capacity_tokens=1024, block_tokens=BT, max_running=1)
    b.add("a", prompt_tokens=100, max_tokens=50)  # footprint 192
    b.add("b", prompt_tokens=200, max_tokens=10)  # footprint 256; waits: one runs at a time
    assert b.admit() == ["a"]
    assert b.committed_tokens() == 150 + 210
    assert b.unreserved_tokens == 1024 - 192 - 256
    assert b.free_tokens == 1024 - 192  # admission still sees the room the waiting one has not taken
    step = b.next_step()
    b.finish_step(step)
    assert b.committed_tokens() == 150 + 210  # generating a token does not change the charge's unit
