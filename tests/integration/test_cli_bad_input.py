"""Bad command-line input anywhere in ``dualpath`` gets a one-line message and exit code 2, never a traceback.

Each case runs the real command in a subprocess; only inputs that are refused before anything
starts are listed, so a case that is wrongly accepted fails on its exit code (its process group
is killed if it starts to serve).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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
    pytest.param("up --compute modeled --scale 0.5", marks=pytest.mark.slow),  # imports torch: ~2 s of CPU
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


@pytest.mark.parametrize("args", BAD, ids=lambda a: a or "(nothing)")  # ~10 s of CPU in all
def test_bad_input_is_refused_with_one_line_and_exit_code_2(args: str, tmp_path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dualpath.cli", *args.split()],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # it was accepted and started something: take it all down
        out, err = proc.communicate()
        pytest.fail(f"`dualpath {args}` was not refused within 60 s")
    assert "Traceback" not in err + out, err
    assert proc.returncode == 2, (proc.returncode, err[-500:])
    assert err.strip() or out.strip(), "refused without saying why"
