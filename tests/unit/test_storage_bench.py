"""``dualpath bench storage``: its rows, its fio command lines and how it refuses (no figures asserted)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dualpath.bench import main as bench_main
from dualpath.bench import storage
from dualpath.node.storage_io import BlockFormat

SMALL = {"small": BlockFormat(layers=2, block_tokens=4, bytes_per_token_layer=512, dtype="bfloat16")}


def _fake_fio(gbps: float, calls: list[list[str]]):
    """A stand-in for ``subprocess.run`` that answers every fio pass with ``gbps``."""

    def run(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        if args[:2] == ["fio", "--version"]:
            return subprocess.CompletedProcess(args, 0, "fio-fake\n", "")
        calls.append(args)
        side = "write" if "--rw=write" in args else "read"
        report = {"jobs": [{side: {"io_bytes": int(gbps * 1e9), "runtime": 1000, "bw_bytes": int(gbps * 1e9)}}]}
        return subprocess.CompletedProcess(args, 0, "note: a warning first\n" + json.dumps(report), "")

    return run


def test_every_row_has_the_keys_and_its_ratio_is_ours_over_fio_of_the_same_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(storage.shutil, "which", lambda name: "/usr/bin/fio")
    monkeypatch.setattr(storage.subprocess, "run", _fake_fio(0.5, calls))
    result = storage.run_bench(directory=tmp_path, formats=SMALL, qd=2, total_bytes=1 << 16, rounds=2)
    assert [r["mode"] for r in result["rows"]] == list(storage.MODES)
    for row in result["rows"]:
        assert {"block_bytes", "mode", "ours_gbps", "fio_gbps", "ratio"} <= row.keys()
        assert row["block_bytes"] == 2 * 4 * 512
        assert row["fio_gbps"] == 0.5
        assert row["ratio"] == pytest.approx(row["ours_gbps"] / row["fio_gbps"], abs=2e-3)
    assert len(calls) == 2 * len(storage.MODES)  # one fio pass per mode and round
    assert list(tmp_path.iterdir()) == []  # the run's files are gone
    assert storage.format_report(result).count(" small ") == len(storage.MODES)


def test_fio_runs_at_the_same_queue_depth_file_size_and_mode(tmp_path: Path) -> None:
    args = storage.fio_args("direct", tmp_path, 8192, 8, 4)
    assert {"--numjobs=4", "--nrfiles=2", "--filesize=8192", "--bs=8192", "--rw=read", "--direct=1", "--invalidate=1"} <= set(args)
    args = storage.fio_args("write-buffered", tmp_path, 8192, 8, 4)
    assert {"--rw=write", "--direct=0", "--fsync=1", "--openfiles=1", "--end_fsync=1", "--create_on_open=1"} <= set(args)
    with pytest.raises(ValueError):
        storage.fio_args("sideways", tmp_path, 8192, 8, 4)


def test_the_bench_refuses_clearly_when_fio_is_missing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(storage.shutil, "which", lambda name: None)
    assert bench_main(["storage", "--quick"]) == 1
    assert "apt-get install -y fio" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--bogus"], ["--qd", "0"], ["--rounds", "0"], ["--modes", "sideways"], ["--dir", "/nonexistent/x"]])
def test_a_bad_flag_exits_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_main(["storage", *argv])
    assert exc.value.code == 2


def test_block_sizes_cover_the_tiny_model_256_kib_and_each_bundled_target() -> None:
    from dualpath.cost import TARGETS

    sizes = {f.block_bytes for f in storage.block_formats().values()}
    assert 2 * 64 * 128 in sizes and 256 * 1024 in sizes
    assert {t.layers * 64 * t.kv_bytes_per_token_layer for t in TARGETS.values()} <= sizes
