"""A task group whose lifetime spans calls: the background tasks a transport owns.

A transport is started in one call and closed in another, often from different tasks, so
an anyio task group (whose scope must be entered and left by one task) cannot hold its
accept loop and connection readers. ``TaskSet`` is the same idea without that rule: every
task it spawns belongs to it, a task that fails is logged instead of lost, and ``aclose``
cancels and awaits them all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

__all__ = ["TaskSet"]

_log = logging.getLogger(__name__)


class TaskSet:
    """Owns background tasks; ``aclose`` cancels and awaits every one still running."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a task owned by this set.

        Raises:
            RuntimeError: the set is closed.
        """
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self._owner}: cannot start {name!r} after close")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self._owner}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def aclose(self) -> None:
        """Cancel every task and wait until all have finished (idempotent)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
