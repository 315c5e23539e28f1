"""Bad command-line input anywhere in ``dualpath`` gets a one-line message and exit code 2, never a traceback.

Each case runs the real command in a subprocess (one per core at a time: most of a case is Python
start-up); only inputs that are refused before anything starts are listed, so a case that is
wrongly accepted fails on its exit code (its process group is killed if it starts to serve).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BAD = [
    "",
    "nosuch",
    "service nosuch",
    "service scheduler --policy nosuch",
    "service scheduler --read-path sideways",
    "service traffic-manager --buffer-mb abc",
    "up --topology 3X",
    "up --engines-per-node 0",
    "up --replicas 0",
    "up --model /nonexistent",
    "up --mode weird",
    "up --compute modeled --target nosuch",
    "up --snic-gbps -3",
    "bench nosuch",
    "bench scheduler --engines 10000",
    "bench scheduler --engines 0",
    "bench transfer --nosuch",
    "loadgen",
    "loadgen --url notaurl --dataset 32k",
    "loadgen --url http://127.0.0.1:9 --dataset nosuch",
    "loadgen --url http://127.0.0.1:9 --dataset 32k --agents 0",
    "loadgen --url http://127.0.0.1:9 --dataset 32k --rate -1",
    "experiment nosuch",
    "experiment offline --agents 0",
    "experiment online --dataset nosuch",
    "experiment online --target nosuch",
    "trace nosuch",
    "trace show",
    "trace show some-request --file /nonexistent/spans.jsonl",
    "make-tiny-model",
    "demo --nosuch",
]

SLOW = ["up --compute modeled --scale 0.5"]  # imports torch: ~2 s of CPU


def _run(args: str, cwd: Path) -> tuple[int | None, str]:
    """Exit code and output of ``dualpath ARGS``; None when it was not refused within 60 s."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dualpath.cli", *args.split()],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # it was accepted and started something: take it all down
        out, _ = proc.communicate()
        return None, out
    return proc.returncode, out


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, tuple[int | None, str]]:
    cwd = tmp_path_factory.mktemp("cli")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(BAD, pool.map(lambda a: _run(a, cwd), BAD)))


def _check(args: str, rc: int | None, out: str) -> None:
    assert rc is not None, f"`dualpath {args}` was not refused within 60 s"
    assert "Traceback" not in out, out
    assert rc == 2, (rc, out[-500:])
    assert out.strip(), "refused without saying why"


@pytest.mark.parametrize("args", BAD, ids=lambda a: a or "(nothing)")  # ~10 s of CPU in all
def test_bad_input_is_refused_with_one_line_and_exit_code_2(args: str, answers) -> None:
    _check(args, *answers[args])


@pytest.mark.slow
@pytest.mark.parametrize("args", SLOW)
def test_bad_input_that_needs_torch_to_check_is_refused_too(args: str, tmp_path) -> None:
    _check(args, *_run(args, tmp_path))
