"""``DecodeBatcher``: a decode engine's core — continuous batching with KV-memory admission.

No I/O and no clock of its own; it counts tokens and blocks, the driver (the decode engine
service, or the simulator) moves KV, runs the model and samples. Loop phases (SGLang's):

1. *receive*: ``add(request_id, prompt_tokens=, max_tokens=)`` when a prefilled request
   arrives (its first token came from prefill); ``admit()`` then moves waiting requests into
   the running set, FIFO, while the engine's KV memory ("HBM") has room for each one's
   reservation and fewer than ``max_running`` run;
2. *next batch*: ``next_step()`` is every running request: those still generating
   (``decode``) and those that finished on a token completing a block, which need one more
   forward so that block's KV exists and can be persisted (``flush``);
3. *run*: the driver runs one decode step over them and samples;
4. *process result*: ``finish_step(step, finish=...)`` advances the counts (the driver says
   which requests stopped, e.g. on EOS; the length limit is applied here) and returns the
   blocks that just filled with KV (to persist) and the requests that leave (their memory is
   released). ``finish`` marks a request done between steps (its first token was final, a
   cancel); ``evict`` drops a request at once (its KV is gone; the driver fails it so the
   scheduler re-dispatches it).

Admission reserves a request's whole footprint, ``prompt + max_tokens`` tokens rounded up to
blocks: the same total the scheduler charges against the engine's free HBM, so a running
request never waits for memory mid-decode and none is evicted for lack of it. A request
whose footprint exceeds the whole memory is refused at ``add``. ``free_tokens`` is what the
engine reports as free HBM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from dualpath.core.batch_errors import (
    DuplicateRequestError,
    InvalidRequestError,
    KvCapacityError,
)

__all__ = ["DecodeBatcher", "DecodeStep", "StepOutcome"]

CANCELLED: Final = "cancelled"


# The hot dataclasses below spell out ``__init__`` (``init=False``): mypyc compiles a written
# ``__init__`` natively, ~15x faster than the one ``dataclasses`` generates (a simulated
# rollout builds tens of millions of these); fields, eq and repr stay the dataclass's.
@dataclass(slots=True, init=False)
class _Seq:
    request_id: str
    tokens: int  # prompt + generated tokens
    kv_len: int  # tokens whose KV is in memory
    generated: int  # generated tokens (the first one came from prefill)
    max_tokens: int
    reserved: int  # tokens of KV memory reserved (whole blocks)
    finish: str | None = None

    def __init__(
        self, request_id: str, tokens: int, kv_len: int, generated: int, max_tokens: int, reserved: int, finish: str | None = None
    ) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.kv_len = kv_len
        self.generated = generated
        self.max_tokens = max_tokens
        self.reserved = reserved
        self.finish = finish


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeStep:
    """One step's batch: ``decode`` generate a token each; ``flush`` only compute the KV of
    their final token (it completed a block). The model runs ``decode + flush`` in that order."""

    decode: tuple[str, ...]
    flush: tuple[str, ...]

    @property
    def batch(self) -> tuple[str, ...]:
        return self.decode + self.flush


@dataclass(slots=True, kw_only=True, init=False)
class StepOutcome:
    """What a step left: ``filled`` blocks ``(request_id, block_index)`` whose KV just became
    complete (persist them); ``leaving`` requests done (release and answer them), with reasons.
    Treat it as immutable: not ``frozen``, for the written ``__init__`` (see above)."""

    filled: tuple[tuple[str, int], ...]
    leaving: tuple[tuple[str, str], ...]

    def __init__(self, *, filled: tuple[tuple[str, int], ...], leaving: tuple[tuple[str, str], ...]) -> None:
        self.filled = filled
        self.leaving = leaving


class DecodeBatcher:
    """Waiting queue, running set and KV-memory reservations of one decode engine.

    Raises:
        ValueError: a non-positive capacity, block size or ``max_running``.
    """

    def __init__(self, *, capacity_tokens: int, block_tokens: int = 64, max_running: int = 64) -> None:
        if capacity_tokens < 1 or block_tokens < 1 or max_running < 1:
            raise ValueError(
                f"need positive capacity_tokens, block_tokens, max_running; got {capacity_tokens}, {block_tokens}, {max_running}"
            )
        self.capacity_tokens, self.block_tokens, self.max_running = capacity_tokens, block_tokens, max_running
        self._waiting: dict[str, _Seq] = {}  # FIFO
        self._running: dict[str, _Seq] = {}
        self.reserved_tokens = 0

    def footprint(self, prompt_tokens: int, max_tokens: int) -> int:
        """Tokens of KV memory a request reserves: its longest context in whole blocks."""
        return -(-(prompt_tokens + max_tokens) // self.block_tokens) * self.block_tokens

    # ---- receive -------------------------------------------------------------------------
    def add(self, request_id: str, *, prompt_tokens: int, max_tokens: int) -> None:
        """Queue a prefilled request (its first token already generated) for admission.

        Raises:
            DuplicateRequestError: the request is already here.
            InvalidRequestError: ``prompt_tokens < 1`` or ``max_tokens < 1``.
            KvCapacityError: its footprint exceeds the engine's whole KV memory.
        """
        if request_id in self._waiting or request_id in self._running:
            raise DuplicateRequestError(request_id)
        if prompt_tokens < 1 or max_tokens < 1:
            raise InvalidRequestError(request_id, f"needs prompt_tokens >= 1 and max_tokens >= 1, got {prompt_tokens}, {max_tokens}")
        need = self.footprint(prompt_tokens, max_tokens)
        if need > self.capacity_tokens:
            raise KvCapacityError(request_id, need, self.capacity_tokens)
        self._waiting[request_id] = _Seq(
            request_id, tokens=prompt_tokens + 1, kv_len=prompt_tokens, generated=1, max_tokens=max_tokens, reserved=need
        )

    def admit(self) -> list[str]:
        """Move waiting requests into the running set, FIFO, while each one's reservation fits
        the free memory and fewer than ``max_running`` run; returns them in order. The head
        that does not fit blocks the rest (no overtaking: admission order is arrival order)."""
        admitted = []
        for rid, seq in list(self._waiting.items()):
            if len(self._running) >= self.max_running or seq.reserved > self.free_tokens:
                break
            del self._waiting[rid]
            self._running[rid] = seq
            self.reserved_tokens += seq.reserved
            admitted.append(rid)
        return admitted

    def admit_ready(self) -> bool:
        """True when ``admit`` would admit the head of the waiting queue now."""
        head = next(iter(self._waiting.values()), None)
        return head is not None and len(self._running) < self.max_running and head.reserved <= self.free_tokens

    # ---- next batch ----------------------------------------------------------------------
    def next_step(self) -> DecodeStep | None:
        """The running requests that need the model this step (None when none does)."""
        decode = tuple(rid for rid, s in self._running.items() if s.finish is None)
        flush = tuple(rid for rid, s in self._running.items() if s.finish not in (None, CANCELLED) and self._needs_flush(s))
        return DecodeStep(decode=decode, flush=flush) if decode or flush else None

    def _needs_flush(self, s: _Seq) -> bool:
        return s.tokens % self.block_tokens == 0 and s.kv_len < s.tokens

    # ---- process result ------------------------------------------------------------------
    def finish_step(self, step: DecodeStep, finish: Mapping[str, str] | None = None) -> StepOutcome:
        """Account for a step that ran: every request of it gained one token of KV, each
        ``decode`` one a generated token. ``finish`` gives the requests whose new token ends
        them (reason, e.g. "stop"); reaching ``max_tokens`` ends one with "length". Requests
        evicted meanwhile are skipped."""
        finish = finish or {}
        decoding = set(step.decode)
        filled = []
        for rid in step.batch:
            s = self._running.get(rid)
            if s is None:
                continue
            s.kv_len += 1
            if s.finish is None and rid in decoding:
                s.tokens += 1
                s.generated += 1
                if s.generated >= s.max_tokens:
                    s.finish = "length"
                elif rid in finish:
                    s.finish = finish[rid]
            if s.kv_len % self.block_tokens == 0 and s.finish != CANCELLED:
                filled.append((rid, s.kv_len // self.block_tokens - 1))
        return StepOutcome(filled=tuple(filled), leaving=self._leave())

    def steps_left(self, request_id: str) -> int:
        """Steps a running request still takes if no stop token ends it: its decode steps up
        to ``max_tokens``, and one flush step when its final token completes a block."""
        s = self._running[request_id]
        if s.finish is not None:
            return 1 if s.finish != CANCELLED and self._needs_flush(s) else 0
        decode = s.max_tokens - s.generated
        return decode + (1 if (s.tokens + decode) % self.block_tokens == 0 else 0)

    def run_steps(self, request_id: str, steps: int) -> StepOutcome:
        """Account ``steps`` steps of one running request at once, as ``steps`` calls of
        ``finish_step`` with it in every batch would (no stop token: the length limit ends it).
        The simulator's fluid decode batch, which has no per-token events, settles each
        request this way when it leaves (``steps_left`` steps after it joined).

        Raises:
            KeyError: the request is not running.
        """
        s = self._running[request_id]
        bt = self.block_tokens
        before = s.kv_len
        decode = min(steps, s.max_tokens - s.generated) if s.finish is None else 0
        if decode > 0:
            s.tokens += decode
            s.generated += decode
            s.kv_len += decode
        if s.finish is None and s.generated >= s.max_tokens:
            s.finish = "length"  # its first token came from prefill and was its last
        if steps > decode and s.finish not in (None, CANCELLED) and self._needs_flush(s):
            s.kv_len += 1
        filled = tuple((request_id, b) for b in range(before // bt, s.kv_len // bt)) if s.finish != CANCELLED else ()
        leaving: tuple[tuple[str, str], ...] = ()
        if s.finish == CANCELLED or (s.finish is not None and not self._needs_flush(s)):
            leaving = ((request_id, s.finish),)
            self._release(request_id)
        return StepOutcome(filled=filled, leaving=leaving)

    def finish(self, request_id: str, reason: str) -> None:
        """Mark a request done outside a step (its first token was final, or "cancelled");
        it leaves at the next ``finish_step`` or ``drain`` once it needs no flush. A waiting
        request keeps its place: once admitted (the driver still takes its KV in and frees
        the buffer slot that held it) it leaves at the next ``drain``."""
        s = self._running.get(request_id) or self._waiting.get(request_id)
        if s is not None and (s.finish is None or reason == CANCELLED):
            s.finish = reason

    def drain(self) -> tuple[tuple[str, str], ...]:
        """The requests that can leave now (finished, no flush pending), released."""
        return self._leave()

    def _leave(self) -> tuple[tuple[str, str], ...]:
        out = []
        for rid, s in list(self._running.items()):
            if s.finish == CANCELLED or (s.finish is not None and not self._needs_flush(s)):
                out.append((rid, s.finish))
                self._release(rid)
        return tuple(out)

    def evict(self, request_id: str) -> bool:
        """Drop a request now, waiting or running (its memory is released); False if absent."""
        if self._waiting.pop(request_id, None) is not None:
            return True
        if request_id in self._running:
            self._release(request_id)
            return True
        return False

    def _release(self, request_id: str) -> None:
        s = self._running.pop(request_id)
        self.reserved_tokens -= s.reserved

    # ---- state ---------------------------------------------------------------------------
    @property
    def free_tokens(self) -> int:
        """KV memory not reserved by a running request (the engine's reported free HBM)."""
        return self.capacity_tokens - self.reserved_tokens

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[str, ...]:
        return tuple(self._waiting)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._running or request_id in self._waiting

    def context_tokens(self) -> int:
        """Tokens of the requests here, running and waiting (their current context)."""
        return sum(s.tokens for s in self._running.values()) + sum(s.tokens - 1 for s in self._waiting.values())

    def committed_tokens(self) -> int:
        """Σ ``prompt + max_tokens`` of the requests here, running and waiting: the engine's
        reported ``tok_e``, in the unit the scheduler charges a placement in (not the context
        so far, which would make every report undo most of the charge)."""
        return sum(s.tokens - s.generated + s.max_tokens for s in (*self._running.values(), *self._waiting.values()))

    @property
    def unreserved_tokens(self) -> int:
        """KV memory not reserved by a request here, running *or waiting* (the engine's reported
        free HBM): the scheduler charges a request's footprint from its placement, so one
        waiting for admission is already spent. Footprints are whole blocks, so this is at most
        ``block_tokens - 1`` per request below the scheduler's unrounded charge (the safe side)."""
        return self.free_tokens - sum(s.reserved for s in self._waiting.values())

    def kv_len(self, request_id: str) -> int:
        return self._running[request_id].kv_len

    def finish_reason(self, request_id: str) -> str | None:
        """Why the request (running or waiting) is done, or None while it is not."""
        s = self._running.get(request_id) or self._waiting.get(request_id)
        return None if s is None else s.finish
