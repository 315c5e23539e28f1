"""Sustained overload: past the scheduler's queue bound the gateway answers 429 with Retry-After
(never a hang, never a 5xx), the requests it admits complete, and no service's memory grows."""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import httpx
import pytest
from conftest import start_stack
from faultkit import model_of

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_overload_is_refused_with_429_and_retry_after_and_memory_stays_flat(tiny_model, tmp_path):
    s = start_stack(
        tiny_model, tmp_path / "storage", tmp_path / "run", extra_env={"DUALPATH_MAX_QUEUE": "2", "DUALPATH_REQUEST_TIMEOUT": "60"}
    )
    http = httpx.Client(base_url=s.url, timeout=70)
    try:
        model = model_of(s)
        body = {"model": model, "prompt": "overload " + "the agent keeps calling tools " * 8, "max_tokens": 48, "temperature": 0}

        def ask(_i: int) -> tuple[int, str | None]:
            r = http.post("/v1/completions", json=body)
            return r.status_code, r.headers.get("retry-after")

        def wave(n: int) -> list[tuple[int, str | None]]:
            with cf.ThreadPoolExecutor(n) as pool:
                return list(pool.map(ask, range(n)))

        wave(8)  # warm-up: every process has allocated what it needs
        procs = [(n, p.pid) for n, p in s.procs if not n.startswith("nats")]
        rss0 = {n: _rss_kib(pid) for n, pid in procs}
        codes: list[tuple[int, str | None]] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:  # sustained: waves of 48 concurrent requests for 10 s
            codes += wave(48)
        rss1 = {n: _rss_kib(pid) for n, pid in procs}
        refused = [c for c in codes if c[0] == 429]
        print(
            f"\nOVERLOAD {len(codes)} requests: {sum(c[0] == 200 for c in codes)} answered, {len(refused)} refused with 429; "
            f"RSS growth: " + ", ".join(f"{n} {100 * (rss1[n] - rss0[n]) / rss0[n]:+.1f}%" for n in rss0)
        )
        assert {c for c, _ in codes} <= {200, 429}, sorted({c for c, _ in codes})
        assert refused, "the queue bound was never reached"
        assert all(ra is not None and int(ra) >= 1 for _, ra in refused)
        assert sum(c == 200 for c, _ in codes) > 0
        for n in rss0:
            assert rss1[n] <= rss0[n] * 1.10 + 4096, (n, rss0[n], rss1[n])  # flat within 10% (+4 MiB of allocator slack)
    finally:
        http.close()
        s.stop()
