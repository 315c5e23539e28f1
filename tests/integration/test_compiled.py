"""The mypyc build of the simulator's hot path (``dualpath.compiled``): the extensions give
the pure Python's results bit for bit, and a source edited after the build never runs as a
stale extension."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath import compiled

# Small runs that go through every compiled module: both read paths, round robin, split
# reads, prefetch (retained and staged copies), tight decode buffers, Oracle.
_RUNS = r"""
import hashlib, json, sys
import dualpath
from dualpath.compiled import compiled, status, MODULES
from dualpath.sim import SimConfig, Simulation, Workload

out = {"status": status(), "compiled": [m for m in MODULES if compiled(m)], "runs": {}}
cases = {
    "basic": dict(mode="basic"),
    "dualpath": dict(mode="dualpath"),
    "dualpath-rr": dict(mode="dualpath-rr"),
    "oracle": dict(mode="oracle"),
    "split": dict(mode="split"),
    "prefetch": dict(mode="prefetch"),
    "tight-buffer": dict(mode="dualpath", dram_buffer_gb=2.0),
}
for name, kw in cases.items():
    cfg = SimConfig(target="ds27b", prefill_nodes=1, decode_nodes=2, engines_per_node=2, decode_ep=4, **kw)
    sim = Simulation(cfg, Workload(dataset="32k", agents=24, turns=5, start_at=0.5, seed=3, tool_gap_s=2.0))
    m = sim.run()
    h = hashlib.sha1()
    for a in (m.submit, m.ttft, m.queue, m.exec, m.ttst, m.tpot, m.e2e, m.agent_end):
        h.update(a.tobytes())
    out["runs"][name] = [h.hexdigest(), sim.end_time, sim.loop.events, m.turns_done, m.hit_tokens]
json.dump(out, sys.stdout)
"""


def _run(**env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _RUNS], env={**os.environ, **env}, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _probe(code: str, build: Path) -> str:
    """What ``code`` prints in a fresh interpreter that looks for the build in ``build``."""
    env = {**os.environ, compiled.DIR_ENV: str(build)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True).stdout


@pytest.mark.slow
def test_the_compiled_hot_path_gives_the_pure_pythons_results_bit_for_bit():
    if not compiled.status().startswith("mypyc"):
        pytest.skip(f"no mypyc build: {compiled.status()}")
    fast, pure = _run(), _run(**{compiled.ENV: "0"})
    assert fast["compiled"] == list(compiled.MODULES), fast["status"]
    assert pure["compiled"] == [] and pure["status"] == f"pure Python: {compiled.ENV}=0"
    assert fast["runs"] == pure["runs"]
    assert len({tuple(v) for v in fast["runs"].values()}) == len(fast["runs"])  # the cases differ from each other


def test_a_source_changed_after_the_build_runs_as_pure_python(tmp_path: Path):
    """A manifest whose hash of one source no longer matches: nothing is loaded from the build."""
    root = tmp_path / "build"
    real = compiled.build_dir()
    if (real / compiled.MANIFEST).is_file():  # the real extensions, one hash spoiled
        shutil.copytree(real, root)
        manifest = json.loads((root / compiled.MANIFEST).read_text())
    else:  # no build here: a manifest that would otherwise match
        suffix = ".so"
        manifest = {
            "python": sys.implementation.cache_tag,
            "modules": {m: m.replace(".", "/") + suffix for m in compiled.MODULES},
            "native": {m: m.replace(".", "/") + suffix for m in compiled.NATIVE},
            "group": {f"{compiled.GROUP}__mypyc": f"{compiled.GROUP}__mypyc{suffix}"},
            "sources": {},
            "native_sources": {},
        }
        root.mkdir()
    spoiled = json.loads(json.dumps(manifest))
    spoiled["sources"]["dualpath.sim.network"] = "0" * 64
    (root / compiled.MANIFEST).write_text(json.dumps(spoiled))
    probe = "import dualpath.sim.network as n; from dualpath.compiled import status; print(status()); print(n.__file__)"
    state, file = _probe(probe, root).splitlines()
    assert state.startswith("pure Python: compiled build is stale (dualpath/sim/network.py changed since the build)")
    assert file.endswith("network.py")
    # a hand-written C extension's source, likewise
    spoiled = json.loads(json.dumps(manifest))
    (name, source), *_ = compiled.NATIVE.items()
    spoiled["native_sources"][name] = "0" * 64
    (root / compiled.MANIFEST).write_text(json.dumps(spoiled))
    probe = "from dualpath.compiled import status; print(status())"
    assert _probe(probe, root).strip().startswith(f"pure Python: compiled build is stale ({source} changed since the build)")


def test_no_build_is_pure_python_and_says_how_to_build(tmp_path: Path):
    state = _probe("from dualpath.compiled import status; print(status())", tmp_path / "none")
    assert state.strip() == "pure Python: not built (dualpath compiled build)"


def test_profile_training_refuses_a_build_it_did_not_run_and_accepts_the_real_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``build(pgo=True)`` trains on its instrumented build: a training run that ran pure
    Python (here: an empty directory for a build) would steer the compiler with nothing."""
    tiny = "sim offline --target ds27b --topology 1P1D --agents 4 --dataset 32k --turns 2 --modes dualpath --progress never"
    monkeypatch.setattr(compiled, "PGO_TRAINING", (tiny,))
    with pytest.raises(RuntimeError, match="did not run the instrumented build"):
        compiled._train(tmp_path)
    if compiled.status().startswith("mypyc"):
        compiled._train(compiled.build_dir())  # the build this process runs: accepted


def test_a_manifest_says_whether_the_build_is_profile_guided(tmp_path: Path):
    if not compiled.status().startswith("mypyc"):
        pytest.skip(f"no fresh compiled build: {compiled.status()}")
    root = tmp_path / "build"
    shutil.copytree(compiled.build_dir(), root)
    manifest = json.loads((root / compiled.MANIFEST).read_text())
    probe = "from dualpath.compiled import status; print(status())"
    for pgo, said in ((True, ", profile-guided)"), (False, " modules)")):
        (root / compiled.MANIFEST).write_text(json.dumps({**manifest, "pgo": pgo}))
        assert _probe(probe, root).strip().endswith(said)
