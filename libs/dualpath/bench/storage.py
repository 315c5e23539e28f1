"""``dualpath bench storage``: the traffic manager's block reads and writes against ``fio``.

For each block size (the Full Blocks of the bundled targets at the default 64 tokens, the tiny
test model's, and 256 KiB), ``files`` block files are written and read back through the
traffic manager's own path: ``StorageIO`` over a ``BlockStore``, into a ``MemoryRegion`` (the
node buffer a transport serves), checksums verified, ``qd`` requests in flight (its default
read parallelism; each request keeps ``FANOUT`` groups of files in flight, so up to
``qd * FANOUT`` files move at once). The StorageIO, its threads and the event loop are made
once and kept across passes, as a node keeps them. In the same run ``fio`` moves the same
number of files of the same size at the requested queue depth (``qd`` psync jobs, one whole
file per I/O), in the same mode:

- ``buffered`` / ``direct``: reads from a cold page cache (``posix_fadvise(DONTNEED)`` on
  every file before each pass, ours and fio's alike: fio's ``invalidate``), buffered or
  ``O_DIRECT``;
- ``write-buffered`` / ``write-direct``: new files, each fsynced after its write (ours also
  renames it into place and fsyncs its directory: the atomic write the format promises; fio
  keeps one file open at a time, without which its ``fsync`` lands on the next, empty file).

fio's files are the block file's size (4 KiB of padded header, then the payload) rounded up
to 4 KiB (what ``O_DIRECT`` needs); each side's GB/s is the bytes it moved over its own time.
Ours and fio's passes alternate, round by round, and each figure is the median of ``rounds``
passes (an even number by default, so each side goes first, and follows the other's writes,
equally often), so load from other processes on a shared machine falls on both alike. A
write pass removes the files of the last one first, and waits for the filesystem to be done
with them, untimed. A benchmark prints figures; the tests assert behaviour.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dualpath.kv import PAYLOAD_OFFSET, BlockStore, model_digest
from dualpath.node.storage_io import FANOUT, BlockFormat, StorageIO
from dualpath.transfer.region import MemoryRegion

__all__ = ["FIO_HINT", "MODES", "FioMissingError", "block_formats", "fio_args", "format_report", "main", "run_bench"]

KIB, MIB = 1 << 10, 1 << 20
MODES = ("buffered", "direct", "write-buffered", "write-direct")
FIO_HINT = "install it: apt-get install -y fio (Debian/Ubuntu), dnf install fio (Fedora)"
_TINY = BlockFormat(layers=2, block_tokens=64, bytes_per_token_layer=128, dtype="bfloat16")  # make_tiny_model's defaults
_DIGEST = model_digest("bench-storage")


class FioMissingError(RuntimeError):
    """Raised by ``run_bench`` when no ``fio`` executable is on ``PATH``."""

    def __init__(self) -> None:
        super().__init__(f"fio not found on PATH; {FIO_HINT}")


def block_formats(block_tokens: int = 64) -> dict[str, BlockFormat]:
    """The Full Block of each bundled target (one per distinct size), the tiny model's and 256 KiB."""
    from dualpath.cost import TARGETS

    out: dict[str, BlockFormat] = {
        "tiny": _TINY,
        "256k": BlockFormat(layers=1, block_tokens=1, bytes_per_token_layer=256 * KIB, dtype="uint8"),
    }
    seen = {f.block_bytes for f in out.values()}
    for name, t in TARGETS.items():
        fmt = BlockFormat(layers=t.layers, block_tokens=block_tokens, bytes_per_token_layer=t.kv_bytes_per_token_layer, dtype="bfloat16")
        if fmt.block_bytes not in seen:
            seen.add(fmt.block_bytes)
            out[name] = fmt
    return dict(sorted(out.items(), key=lambda kv: kv[1].block_bytes))


def fio_args(mode: str, directory: Path, file_bytes: int, files: int, qd: int) -> list[str]:
    """The fio command line of one pass: ``qd`` psync jobs, ``files // qd`` files each, one
    whole ``file_bytes`` file per I/O, in ``mode`` (one of ``MODES``).

    Raises:
        ValueError: ``mode`` is not one of ``MODES``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    write = mode.startswith("write")
    args = [
        "fio",
        "--name=bench",
        f"--directory={directory}",
        f"--numjobs={qd}",
        f"--nrfiles={max(1, files // qd)}",
        f"--filesize={file_bytes}",
        f"--bs={file_bytes}",
        f"--rw={'write' if write else 'read'}",
        "--ioengine=psync",
        f"--direct={int(mode.endswith('direct'))}",
        "--group_reporting",
        "--output-format=json",
    ]
    if write:
        # New files, each fsynced after its one write, space allocated by the writes, as ours
        # are. ``fsync=1`` alone syncs the wrong file when a job has several: fio moves on to
        # its next file (opened, empty) before the sync, so the one just written stays dirty
        # (strace: open A, write A, open B, fsync B) and fio's read pass then finds it in the
        # page cache, which ``invalidate`` cannot drop. One file open at a time puts each
        # fsync on the file just written; ``end_fsync`` syncs each job's last one.
        args += ["--fsync=1", "--openfiles=1", "--end_fsync=1", "--create_on_open=1", "--fallocate=none"]
    else:
        args += ["--invalidate=1"]
    return args


def _fio_gbps(out: str, write: bool) -> float:
    """GB/s of a fio JSON report (bytes over its own run time)."""
    report = json.loads(out[out.index("{") :])
    side = report["jobs"][0]["write" if write else "read"]
    return side["io_bytes"] / (side["runtime"] / 1e3) / 1e9 if side["runtime"] else side["bw_bytes"] / 1e9


def _remove(directory: Path) -> None:
    """Delete a pass's files before the next write pass, and wait until the filesystem has
    done with them: the journal commit that frees their blocks (and, on a filesystem mounted
    with ``discard``, the discards sent to the device then) would otherwise land inside
    whichever timed pass, ours or fio's, commits next."""
    shutil.rmtree(directory, ignore_errors=True)
    os.sync()


def _drop_cache(directory: Path) -> None:
    """Drop every file under ``directory`` from the page cache (clean pages only: written
    files were fsynced)."""
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _Ours:
    """Our side of one block size: a StorageIO per mode (buffered, direct) over a store, a
    registered buffer and one event loop, all made once and kept across passes, as a node
    keeps them (fio's timed run leaves out its setup too)."""

    def __init__(self, root: Path, fmt: BlockFormat, files: int, qd: int) -> None:
        self.root, self.fmt, self.qd = root, fmt, qd
        self.hashes = [0x5EED0000 + i for i in range(files)]
        self.region = MemoryRegion(f"bench-storage-{uuid.uuid4().hex[:10]}", files * fmt.block_bytes)
        self.region.as_array()[:] = 7  # fault the pages in now, not inside the timed passes
        self._runner = asyncio.Runner()
        self._ios: dict[bool, StorageIO] = {}

    def close(self) -> None:
        for io in self._ios.values():
            io.close()
        self._runner.close()
        self.region.close()
        self.region.unlink()

    def _io(self, direct: bool) -> StorageIO:
        if direct not in self._ios:  # a store re-creates its directories when a pass removed them
            self._ios[direct] = StorageIO(BlockStore(self.root, direct=direct), max_parallel=self.qd)
        return self._ios[direct]

    def _requests(self) -> list[tuple[list[int], memoryview]]:
        """``qd`` requests, each a contiguous share of the blocks and of the buffer."""
        bb, n = self.fmt.block_bytes, len(self.hashes)
        cuts = [n * i // self.qd for i in range(self.qd + 1)]
        return [(self.hashes[a:b], self.region.buf[a * bb : b * bb]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]

    def write(self, direct: bool) -> float:
        _remove(self.root)
        io = self._io(direct)

        async def go() -> None:
            await asyncio.gather(*(io.write_blocks(_DIGEST, ids, self.fmt, view) for ids, view in self._requests()))

        return self._timed(go)

    def read(self, direct: bool) -> float:
        _drop_cache(self.root)
        io = self._io(direct)

        async def go() -> None:
            results = await asyncio.gather(*(io.read_blocks(_DIGEST, ids, self.fmt, view) for ids, view in self._requests()))
            loaded = sum(r.loaded for r in results)
            if loaded != len(self.hashes):
                raise RuntimeError(f"read back {loaded} of {len(self.hashes)} blocks")

        return self._timed(go)

    def _timed(self, go: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        self._runner.run(go())
        return len(self.hashes) * (PAYLOAD_OFFSET + self.fmt.block_bytes) / (time.perf_counter() - t0) / 1e9


def _files_for(block_bytes: int, total_bytes: int, qd: int, max_files: int) -> int:
    n = max(2 * qd, min(max_files, total_bytes // block_bytes))
    return n // qd * qd  # whole files per fio job


def run_bench(
    *,
    directory: str | Path | None = None,
    formats: dict[str, BlockFormat] | None = None,
    qd: int = 4,
    total_bytes: int = 256 * MIB,
    max_files: int = 1024,
    rounds: int = 6,
    modes: tuple[str, ...] = MODES,
) -> dict[str, Any]:
    """Measure every (block size, mode) for ours and fio; return a JSON-able dict whose
    ``rows`` each hold ``block_bytes``, ``mode``, ``ours_gbps``, ``fio_gbps`` and ``ratio``
    (ours over fio, both medians of this run).

    Raises:
        FioMissingError: no ``fio`` on ``PATH``.
        ValueError: a mode is not one of ``MODES``, or ``qd``/``rounds`` is below 1.
    """
    if shutil.which("fio") is None:
        raise FioMissingError
    if qd < 1 or rounds < 1 or any(m not in MODES for m in modes):
        raise ValueError(f"qd and rounds must be >= 1 and modes among {MODES}")
    formats = formats if formats is not None else block_formats()
    base = Path(tempfile.mkdtemp(prefix="dualpath-bench-storage-", dir=directory))
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        for name, fmt in formats.items():
            rows += _measure_size(base, name, fmt, qd, _files_for(fmt.block_bytes, total_bytes, qd, max_files), rounds, modes)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    version = subprocess.run(["fio", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "rows": rows,
        "qd": qd,
        "ours_files_in_flight": qd * FANOUT,  # qd requests, FANOUT groups of files in flight each
        "rounds": rounds,
        "directory": str(directory or tempfile.gettempdir()),
        "cache_drop": "posix_fadvise(DONTNEED) on every file before each read pass (fio: invalidate=1)",
        "fio": version,
        "cpus": os.cpu_count(),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def _measure_size(
    base: Path, name: str, fmt: BlockFormat, qd: int, files: int, rounds: int, modes: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Every mode of one block size, ours and fio alternating within each round."""
    ours = _Ours(base / f"ours-{name}", fmt, files, qd)
    fio_dir = base / f"fio-{name}"
    file_bytes = -(-(PAYLOAD_OFFSET + fmt.block_bytes) // 4096) * 4096
    got: dict[tuple[str, str], list[float]] = {}
    # reads need files: each round writes first (buffered before direct, so reads find them)
    order = sorted(modes, key=lambda m: ("write-buffered", "buffered", "direct", "write-direct").index(m))
    if "write-buffered" not in modes and any(not m.startswith("write") for m in modes):
        order = ["write-buffered", *order]  # files to read before the reads, not reported
    try:
        for r in range(rounds):
            for mode in order:
                write, direct = mode.startswith("write"), mode.endswith("direct")

                def run_ours(write: bool = write, direct: bool = direct) -> float:
                    return ours.write(direct) if write else ours.read(direct)

                def run_fio(mode: str = mode, write: bool = write) -> float:
                    if write:
                        _remove(fio_dir)
                    fio_dir.mkdir(parents=True, exist_ok=True)
                    out = subprocess.run(fio_args(mode, fio_dir, file_bytes, files, qd), capture_output=True, text=True, check=True)
                    return _fio_gbps(out.stdout, write)

                pair: list[tuple[str, Callable[[], float]]] = [("ours", run_ours), ("fio", run_fio)]
                for side, fn in pair if r % 2 == 0 else pair[::-1]:
                    got.setdefault((mode, side), []).append(fn())
    finally:
        ours.close()
    rows = []
    for mode in modes:
        o, f = statistics.median(got[(mode, "ours")]), statistics.median(got[(mode, "fio")])
        rows.append(
            {
                "block_bytes": fmt.block_bytes,
                "block": name,
                "files": files,
                "mode": mode,
                "ours_gbps": round(o, 3),
                "fio_gbps": round(f, 3),
                "ratio": round(o / f, 3),
                "ours_rounds": [round(x, 3) for x in got[(mode, "ours")]],
                "fio_rounds": [round(x, 3) for x in got[(mode, "fio")]],
            }
        )
    return rows


def format_report(d: dict[str, Any]) -> str:
    """The human-readable table of a ``run_bench`` result."""
    lines = [
        f"dualpath bench storage: ours (StorageIO + BlockStore into a MemoryRegion, checksums verified) vs fio, "
        f"queue depth {d['qd']} (ours: {d['qd']} requests, up to {d.get('ours_files_in_flight', d['qd'])} files in flight), "
        f"median of {d['rounds']} alternating rounds ({d['cpus']} CPUs, {d['elapsed_s']} s; {d['fio']})",
        f"reads from a cold page cache: {d['cache_drop']}",
        "",
        f"{'block':>8} {'bytes':>10} {'files':>6} {'mode':>15} {'ours GB/s':>10} {'fio GB/s':>9} {'ratio':>6}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in d["rows"]:
        head = f"{r['block']:>8} {r['block_bytes']:>10} {r['files']:>6} {r['mode']:>15}"
        lines.append(f"{head} {r['ours_gbps']:>10.3f} {r['fio_gbps']:>9.3f} {r['ratio']:>6.2f}")
    big = [r for r in d["rows"] if r["block_bytes"] >= 256 * KIB]
    if big:
        worst = min(big, key=lambda r: r["ratio"])
        lines += ["", f"blocks >= 256 KiB: worst ratio {worst['ratio']:.2f} ({worst['block']}, {worst['mode']}); aim >= 0.9"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``dualpath bench storage [--dir D] [--qd 4] [--total-mib 256] [--rounds 6] [--quick] [--json]``."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="dualpath bench storage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where the block files go (default: the temp dir); put it on the storage to measure")
    p.add_argument("--qd", type=int, default=4, help="requests (ours) and fio jobs in flight (default 4: StorageIO's read parallelism)")
    p.add_argument("--total-mib", type=int, default=256, help="bytes of files per block size, MiB (default 256; 1,024 files at most)")
    p.add_argument("--rounds", type=int, default=6, help="alternating ours/fio rounds; each figure is their median (default 6)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated modes (default all: {','.join(MODES)})")
    p.add_argument("--quick", action="store_true", help="a smoke run: 32 MiB per size, one round")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    ns = p.parse_args(argv)
    modes = tuple(m for m in ns.modes.split(",") if m)
    if ns.qd < 1 or ns.rounds < 1 or ns.total_mib < 1:
        p.error("--qd, --rounds and --total-mib must be at least 1")
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes must be among {', '.join(MODES)}")
    if ns.dir is not None and not Path(ns.dir).is_dir():
        p.error(f"--dir {ns.dir} is not a directory")
    total, rounds = (32 * MIB, 1) if ns.quick else (ns.total_mib * MIB, ns.rounds)
    try:
        result = run_bench(directory=ns.dir, qd=ns.qd, total_bytes=total, rounds=rounds, modes=modes)
    except FioMissingError as exc:
        print(f"dualpath bench storage: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if ns.json else format_report(result))
    return 0
