"""``dualpath bench scheduler|transfer|storage|loadgen|index|structured|engine [--json]``: benchmarks that print measured figures.

A benchmark is not a test: it asserts nothing, it measures and reports (compare ratios
measured in the same run; absolute timings on shared machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

__all__ = ["main"]


def _scheduler(ns) -> tuple[dict, Callable[[dict], str]]:
    from dualpath.bench.scheduler import format_report, run_bench

    kw: dict = {"engines": ns.engines}
    if ns.seconds:
        kw["seconds"] = ns.seconds
    if ns.warmup is not None:
        kw["warmup_s"] = ns.warmup
    return run_bench(**kw), format_report


def _check(ns) -> str:
    """A one-line complaint about bad flags, or ""."""
    if ns.what == "scheduler":
        from dualpath.bench.scheduler import validate_engines
        from dualpath.policy.errors import InvalidTopologyError

        try:
            validate_engines(ns.engines)
        except InvalidTopologyError as exc:
            return exc.reason
        if ns.seconds < 0 or (ns.warmup is not None and ns.warmup < 0):
            return "--seconds and --warmup must not be negative"
    return ""


def _transfer(ns) -> tuple[dict, Callable[[dict], str]]:
    from dualpath.bench.transfer import format_report, run_bench

    kw: dict = {"data_tls": ns.data_tls}
    if ns.quick:
        kw.update(block_sizes=(4096, 262144, 1 << 20), batch_sizes=(1, 16, 256), point_seconds=0.05, with_mooncake=False)
    return run_bench(**kw), format_report


BENCHES = {"scheduler": _scheduler, "transfer": _transfer}


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv[:1] == ["loadgen"]:  # the load generator's own overhead benchmark has its own flags
        from dualpath.bench.loadgen import main as loadgen_bench

        return loadgen_bench(argv[1:])
    if argv[:1] == ["index"]:  # the replicated index's load benchmark has its own flags
        from dualpath.bench.index import main as index_bench

        return index_bench(argv[1:])
    if argv[:1] == ["structured"]:  # constrained decoding's per-token cost has its own flags
        from dualpath.bench.structured import main as structured_bench

        return structured_bench(argv[1:])
    if argv[:1] == ["storage"]:  # block reads and writes against fio has its own flags
        from dualpath.bench.storage import main as storage_bench

        return storage_bench(argv[1:])
    if argv[:1] == ["engine"]:  # our decoder against transformers' on one checkpoint
        from dualpath.bench.engine import main as engine_bench

        return engine_bench(argv[1:])
    p = argparse.ArgumentParser(prog="dualpath bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=sorted([*BENCHES, "loadgen", "index", "structured", "engine", "storage"]))
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--engines", type=int, default=1152, help="scheduler: cluster size in GPUs (engines)")
    p.add_argument("--seconds", type=float, default=0.0, help="scheduler: virtual seconds measured (0 = the benchmark's default, 10)")
    p.add_argument("--warmup", type=float, default=None, help="scheduler: virtual seconds before measuring (default 8)")
    p.add_argument("--quick", action="store_true", help="transfer: fewer points (a smoke run)")
    p.add_argument(
        "--data-tls", action="store_true", help="transfer: also tcp over mutual TLS (a tcp+tls column, and what TLS costs beside tcp)"
    )
    ns = p.parse_args(argv)
    problem = _check(ns)
    if problem:
        print(f"dualpath bench {ns.what}: {problem}", file=sys.stderr)
        return 2
    result, fmt = BENCHES[ns.what](ns)
    if ns.json:
        json.dump(result, sys.stdout, indent=2, default=str)
        print()
    else:
        print(fmt(result))
    return 0
