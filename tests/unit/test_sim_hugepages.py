"""The simulator's heap on huge pages (``dualpath.sim.hugepages``): same results, and an
arena allocator that survives what CPython asks of it. Each check runs in a fresh process:
the allocator, once installed, stays for the life of the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dualpath.compiled import status as compiled_status
from dualpath.sim import hugepages

needs_huge_pages = pytest.mark.skipif(
    bool(hugepages.available()) or not compiled_status().startswith("mypyc"),
    reason=f"huge pages: {hugepages.available() or 'available'}; compiled code: {compiled_status()}",
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (hugepages.ENV, "GLIBC_TUNABLES")}
    return {**env, **extra}


@needs_huge_pages
def test_a_simulation_on_huge_pages_reports_the_same_figures():
    argv = [sys.executable, "-m", "dualpath.cli", "sim", "offline", "--topology", "2P4D", "--agents", "96", "--turns", "4"]
    argv += ["--modes", "basic,dualpath", "--progress", "never", "--json"]
    on = json.loads(subprocess.run(argv, env=_env(), capture_output=True, text=True, check=True, timeout=300).stdout)
    off = json.loads(subprocess.run(argv, env=_env(**{hugepages.ENV: "0"}), capture_output=True, text=True, check=True, timeout=300).stdout)
    assert on["huge_pages"] == "on (object arenas, glibc malloc)"  # the command re-executed itself with the tunable
    assert off["huge_pages"] == f"off: {hugepages.ENV}=0"
    for mode in ("basic", "dualpath"):
        a, b = on["modes"][mode], off["modes"][mode]
        assert a["jct_s"] == b["jct_s"] and a["events"] == b["events"]
        assert a["latency_s"] == b["latency_s"]


@needs_huge_pages
def test_arenas_are_reused_and_other_sizes_pass_through():
    # Object churn frees whole arenas (they are handed out again); deep recursion makes the
    # interpreter take frame-stack chunks through the same hook in other sizes (passed on
    # to the previous allocator: handing one out as an arena corrupted the heap).
    script = textwrap.dedent(
        """
        import sys
        from dualpath.sim import hugepages
        assert hugepages.enable().startswith("on (object arenas"), hugepages.status()
        def deep(n):
            return 0 if n == 0 else 1 + deep(n - 1)
        sys.setrecursionlimit(100000)
        for round in range(6):
            junk = [[i, str(i)] for i in range(300000)]
            assert deep(20000 + 5000 * round) == 20000 + 5000 * round
            del junk
        total = sum(len(str(i)) for i in range(200000))
        s = hugepages.stats()
        assert s["arenas_served"] > 20 and s["arenas_reused"] > 20 and s["passed_on"] > 0, s
        print(total)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == sum(len(str(i)) for i in range(200000))


def test_off_says_why():
    out = subprocess.run(
        [sys.executable, "-c", "from dualpath.sim import hugepages; print(hugepages.enable())"],
        env=_env(**{hugepages.ENV: "0"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == f"off: {hugepages.ENV}=0"


def test_programs_the_simulator_starts_get_the_environment_without_its_tunable(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.malloc.arena_max=2:{hugepages.TUNABLE}")
    assert hugepages.plain_env()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    monkeypatch.setenv("GLIBC_TUNABLES", hugepages.TUNABLE)
    assert "GLIBC_TUNABLES" not in hugepages.plain_env()
