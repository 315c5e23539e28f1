"""Worker threads that copy memory off the event loop, with a hand-off as cheap as it gets.

A same-node batch of a megabyte or more is copied outside the event loop so the loop keeps
serving while it runs. ``anyio.to_thread.run_sync`` pays, per call, a capacity limiter, a
context copy and a worker found or started: on a small host several times what these
threads cost, and of the order of the copy of a megabyte itself (docs/results.md has the
figures). These threads are started once per process and wait on one queue; a batch is one
``put`` and one ``call_soon_threadsafe`` back.

The copies release the GIL (``ctypes.memmove``, numpy's ``copyto``), so several threads
copy at once where the host has the cores and the memory bandwidth.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import anyio

__all__ = ["THREADS", "run_copy", "submit_copy", "wait_copy"]

#: Copy threads per process: enough for concurrent batches to use a node's memory bandwidth,
#: few enough to leave cores to the engine's own threads.
THREADS = max(1, min(4, os.cpu_count() or 1))

_Job = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop, asyncio.Future[Any]]

_lock = threading.Lock()
_jobs: queue.SimpleQueue[_Job] | None = None


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():  # cannot happen while the waiter is shielded; kept so a late result never raises
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _worker(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        fn, args, loop, fut = jobs.get()
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the waiting task, raised there
            traceback.clear_frames(exc.__traceback__)  # its frames' locals (the batch's views) go now
            error = exc
        # The batch's views go before the caller can learn that the copy ended: a caller that
        # closes its region right after must not find them still alive here.
        del fn, args
        try:
            loop.call_soon_threadsafe(_settle, fut, result, error)
        except RuntimeError:  # the loop was closed meanwhile: nobody is waiting
            pass
        del loop, fut, result, error


def _queue() -> queue.SimpleQueue[_Job]:
    global _jobs
    jobs = _jobs
    if jobs is not None:
        return jobs
    with _lock:
        if _jobs is None:
            jobs = queue.SimpleQueue()
            for i in range(THREADS):
                threading.Thread(target=_worker, args=(jobs,), name=f"dualpath-copy-{i}", daemon=True).start()
            _jobs = jobs
        return _jobs


def _after_fork() -> None:
    global _jobs, _lock
    _jobs = None  # a forked child has none of the parent's threads: start its own on first use
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork)


def submit_copy(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """Hand ``fn(*args)`` to a copy thread now; ``wait_copy`` the future it returns."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    _queue().put((fn, args, loop, fut))
    return fut


async def wait_copy(fut: asyncio.Future[Any]) -> Any:
    """The result of a ``submit_copy`` (or its exception, raised here).

    Not cancellable midway, like ``anyio.to_thread.run_sync``: a cancelled caller waits
    for the copy to end before the cancellation is delivered, so no batch is still writing
    into memory its caller believes free."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        # The copy cannot be stopped: wait it out, then let the cancellation through. Shielded
        # from anyio, which would otherwise cancel the wait again on every turn of the loop.
        with anyio.CancelScope(shield=True):
            while not fut.done():
                with contextlib.suppress(asyncio.CancelledError):  # a plain task.cancel(), again
                    await asyncio.wait((fut,))
        if not fut.cancelled():
            fut.exception()  # retrieved: a failed copy nobody waits for is not logged as lost
        raise


async def run_copy(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a copy thread and return its result (``submit_copy``, then
    ``wait_copy``)."""
    return await wait_copy(submit_copy(fn, *args))
