"""Engines report in the units the scheduler charges (``EngineReport``): a prefill engine's
``tok_e`` is miss tokens, also while its hits load; a decode engine's is Σ prompt + max_tokens,
and its free HBM already excludes requests waiting for admission."""

from __future__ import annotations

from types import SimpleNamespace

from dualpath.core.decode_batcher import DecodeBatcher
from dualpath.core.prefill_batcher import PrefillBatcher
from dualpath.protocol import messages as m
from services.prefill_engine.engine import Job, PrefillEngine

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


def test_a_prefill_engine_counts_planned_hits_as_read_while_the_load_runs_and_loaded_blocks_after():
    batcher = PrefillBatcher(lambda _items: 0.001, block_tokens=BT)
    loading = Job(task=_task("a", 300, 2, int(m.ReadPath.DE)), dest=None)  # its hits are being read
    no_read = Job(task=_task("b", 200, 3, int(m.ReadPath.NONE)), dest=None)  # no read path: every token is computed
    short = Job(task=_task("c", 300, 4, int(m.ReadPath.PE)), dest=None)
    short.loading, short.hit_blocks = False, 1  # the read node found fewer blocks than planned
    queued = Job(task=_task("d", 500, 2, int(m.ReadPath.PE)), dest=None)
    queued.loading, queued.hit_blocks = False, 2
    batcher.add("d", cached=2 * BT, total=500)
    engine = SimpleNamespace(
        setup=SimpleNamespace(layout=SimpleNamespace(block_tokens=BT)),
        batcher=batcher,
        jobs={j.task.request_id: j for j in (loading, no_read, short, queued)},
    )
    want = (300 - 2 * BT) + 200 + (300 - BT) + (500 - 2 * BT)  # what the scheduler charges, less what the load changed
    assert PrefillEngine.tokens_left(engine) == want


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
