"""``ClusterSampler``: records node and engine reports from NATS while an experiment runs.

Traffic managers report cumulative storage bytes; engines report cumulative busy, modeled and
attention seconds. The sampler keeps a time series per node (SNIC utilisation over time) and
the last figures per engine (load balance, emulation overhead).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import nats

from dualpath.protocol import ProtocolError, decode
from dualpath.protocol.messages import EngineReport, NodeReport
from dualpath.protocol.subjects import Subjects

__all__ = ["ClusterSampler"]


class ClusterSampler:
    """Runs its own event loop in a thread; ``start()``, then ``stop()`` returns the samples."""

    def __init__(self, nats_url: str, namespace: str, **options: Any) -> None:
        """``options``: ``nats.connect`` arguments (a stack's ``nats_options(Role.OBSERVER)``)."""
        self.url, self.subjects, self.options = nats_url, Subjects(namespace), options
        self.nodes: dict[str, list[tuple[float, int, int]]] = {}  # node -> [(t, bytes_read, bytes_written)]
        self.engines: dict[str, dict] = {}  # engine -> last stats (+ role, node)
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._ready = threading.Event()

    def start(self) -> ClusterSampler:
        self._thread.start()
        self._ready.wait(10)
        return self

    def reset_clock(self) -> None:
        self.t0 = time.monotonic()

    async def _run(self) -> None:
        nc = await nats.connect(self.url.split(","), **self.options)

        async def on_node(msg) -> None:
            try:
                r = decode(msg.data, NodeReport)
            except ProtocolError:
                return
            self.nodes.setdefault(r.node_id, []).append((time.monotonic() - self.t0, r.bytes_read, r.bytes_written))

        async def on_engine(msg) -> None:
            try:
                r = decode(msg.data, EngineReport)
            except ProtocolError:
                return
            self.engines[r.engine_id] = {**r.stats, "role": int(r.role), "node": r.node_id}

        await nc.subscribe(self.subjects.node_reports, cb=on_node)
        await nc.subscribe(self.subjects.engine_reports, cb=on_engine)
        self._ready.set()
        while not self._stop.is_set():
            await asyncio.sleep(0.1)
        await nc.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
