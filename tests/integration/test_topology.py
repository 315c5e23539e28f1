"""xPyD topologies with several engines per node: every engine registers and serves."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys

import httpx
import pytest
from conftest import openai_client, start_stack

pytestmark = pytest.mark.slow


def test_2p1d_with_two_engines_per_node_spreads_requests_over_engines(tiny_model, tmp_path):
    s = start_stack(tiny_model, tmp_path / "storage", tmp_path / "run", topology="2P1D", engines_per_node=2)
    try:
        health = httpx.get(s.url + "/health").json()
        assert (health["prefill_engines"], health["decode_engines"]) == (4, 2)
        client = openai_client(s.url)
        model = client.models.list().data[0].id

        def one(i: int):
            r = client.completions.create(model=model, prompt=f"request number {i} " * 20, max_tokens=8, temperature=0)
            return r.model_extra["dualpath"]

        with cf.ThreadPoolExecutor(8) as pool:
            infos = list(pool.map(one, range(12)))
        assert len({i["prefill_engine"] for i in infos}) >= 2
        assert len({i["decode_engine"] for i in infos}) == 2
        assert {i["prefill_engine"][:2] for i in infos} == {"p0", "p1"}
    finally:
        codes = s.stop()
    assert all(c in (0, -15) for c in codes.values()), codes


def test_bad_topology_is_refused_with_a_clear_message():
    out = subprocess.run([sys.executable, "-m", "dualpath.cli", "up", "--topology", "3X"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "1P1D" in out.stderr


def test_every_service_prints_its_flags_and_environment_variables():
    for name in ("gateway", "scheduler", "kv-persistence", "traffic-manager", "prefill-engine", "decode-engine"):
        out = subprocess.run([sys.executable, "-m", "dualpath.cli", "service", name, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "--nats-url" in out.stdout and "DUALPATH_NATS_URL" in out.stdout


def test_make_tiny_model_command_writes_a_loadable_checkpoint(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dualpath.cli",
            "make-tiny-model",
            str(tmp_path / "m"),
            "--layers",
            "3",
            "--hidden",
            "96",
            "--heads",
            "6",
            "--kv-heads",
            "2",
            "--vocab",
            "400",
            "--seed",
            "7",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    from dualpath.model import Decoder, Tokenizer

    d = Decoder.load(tmp_path / "m")
    assert (d.num_layers, d.kv_heads, d.config.vocab_size) == (3, 2, 400)
    assert Tokenizer.from_dir(tmp_path / "m").decode(Tokenizer.from_dir(tmp_path / "m").encode("abc")) == "abc"
