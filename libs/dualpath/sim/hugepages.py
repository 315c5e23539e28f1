"""The simulator's heap on transparent huge pages: fewer TLB misses, the same results.

A large run keeps hundreds of MiB of small objects alive (requests, flows, events, the
scheduler's ledger: hundreds of MiB at 48P96D with 48K agents) and touches them in no order:
with 4 KiB pages most touches also miss the TLB, so the cost per simulated turn grows with the
cluster. 2 MiB pages take that cost down at the largest sizes (docs/paper.md keeps the
measurements); the results are bit for bit the same (memory layout decides no result).

Two parts, each used only where the kernel offers transparent huge pages
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``), both off
with ``DUALPATH_HUGE_PAGES=0``:

- ``enable()``: CPython's object arenas (pymalloc, every object of 512 bytes or less) come
  from a huge-page region: the C extension ``dualpath.sim._hugepages``, built with the
  mypyc extensions (``dualpath compiled build``); without that build this part is off;
- ``reexec()``: glibc's malloc (list and dict arrays, numpy) on huge pages. glibc reads
  ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` only at process start, so the ``dualpath sim``
  command re-executes itself once with it set (the process keeps its pid).

``dualpath sim`` calls both (``prepare``) before anything else; ``status()`` says what this
process runs with, and the reports carry it next to the compiled status.
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENV", "available", "enable", "plain_env", "prepare", "reexec", "stats", "status"]

ENV = "DUALPATH_HUGE_PAGES"  # "0": neither part
TUNABLE = "glibc.malloc.hugetlb=1"
RESERVE_BYTES = 64 << 30  # address space for arenas (nothing is committed until touched; arenas beyond it: as before)
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"

_state = "off: not enabled"


def available() -> str:
    """'' when this process may use transparent huge pages, else why not."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    try:
        with open(_THP) as f:
            mode = f.read()
    except OSError:
        return "the kernel has no transparent huge pages"
    if "[never]" in mode:
        return "transparent huge pages are off in this kernel ([never])"
    return ""


def _tunable_set() -> bool:
    return TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def reexec() -> None:
    """Re-execute this process with glibc's malloc on huge pages, once (returns when nothing
    is to be done: not available, already set, or not glibc)."""
    if available() or _tunable_set() or not sys.platform.startswith("linux"):
        return
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def plain_env() -> dict[str, str]:
    """This process's environment without the tunable ``reexec`` added: for programs it
    starts that should run as they would on their own (the testbed ``validate`` runs)."""
    env = dict(os.environ)
    rest = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t != TUNABLE]
    if rest:
        env["GLIBC_TUNABLES"] = ":".join(rest)
    else:
        env.pop("GLIBC_TUNABLES", None)
    return env


def enable(reserve_bytes: int = RESERVE_BYTES) -> str:
    """Put CPython's object arenas on huge pages from now on (once per process); returns ``status()``."""
    global _state
    if _state.startswith("on ("):
        return _state
    why = available()
    if why:
        _state = f"off: {why}"
        return _state
    try:
        from dualpath.sim import _hugepages  # type: ignore[attr-defined]
    except ImportError:  # it loads with the mypyc extensions, from the same build
        from dualpath.compiled import status as compiled_status

        arenas = f"the C extension is not loaded (compiled code: {compiled_status()})"
    else:
        arenas = _hugepages.install(reserve_bytes)
    if _tunable_set():
        _state = "on (object arenas, glibc malloc)" if not arenas else f"on (glibc malloc; object arenas off: {arenas})"
    else:
        _state = "on (object arenas)" if not arenas else f"off: {arenas}"
    return _state


def prepare() -> str:
    """What ``dualpath sim`` does first: ``reexec()`` then ``enable()``."""
    reexec()
    return enable()


def status() -> str:
    """``on (...)`` with the parts in use, or ``off: why``."""
    return _state


def stats() -> dict[str, int]:
    """The arena allocator's counts (empty when it is not installed)."""
    if not _state.startswith("on (object arenas"):
        return {}
    from dualpath.sim import _hugepages  # type: ignore[attr-defined]

    return dict(_hugepages.stats())
