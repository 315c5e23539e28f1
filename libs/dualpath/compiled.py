"""The simulator's hot path compiled with mypyc: the same source, run as C extensions.

``dualpath sim`` spends its time in the decision cores, the policy, the cost model and the
simulator's event loop and network (``MODULES``): pure Python, called millions of times per
run. mypyc compiles those very files (no second copy of any algorithm) into C extensions that
give the same results, several times faster. The build is optional and kept out of the source
tree:

    dualpath compiled build         # what scripts/setup.sh runs (with --if-stale)
    dualpath compiled build --pgo   # profile-guided: ~5 min, a faster simulator at scale
    dualpath compiled status        # which code this process runs, and why

``--pgo`` compiles twice: once instrumented, then, after a short training run of the
simulator (``PGO_TRAINING``) with that build, again with the C compiler told which branches
and calls are hot. The training only steers code layout and inlining: results are the same.

The same build compiles the hand-written C extensions in ``NATIVE`` (the simulator's heap
on huge pages, ``dualpath.sim.hugepages``; the shm transport's batch copier,
``dualpath.transfer.shm``). The extensions live in
``<venv>/dualpath-compiled/`` with a manifest of the SHA-256 of every source they were
built from. ``activate()`` (called when ``dualpath`` is imported) installs
an import hook that loads them only while every hash still matches: an edited source runs as
pure Python until the next build, never as a stale extension. ``DUALPATH_COMPILED=0``
turns the hook off (pure Python everywhere).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["MODULES", "activate", "build", "build_dir", "compiled", "status"]

#: The modules compiled (dotted names). Each must type-check under mypyc; errors and rarely
#: called modules stay pure Python (an extension calls them as any Python code would).
MODULES = (
    "dualpath.core.decode_batcher",
    "dualpath.core.prefill_batcher",
    "dualpath.core.scheduler",
    "dualpath.core.scheduler_events",
    "dualpath.core.scheduler_members",
    "dualpath.core.scheduler_queue",
    "dualpath.core.scheduler_request",
    "dualpath.cost.model",
    "dualpath.kv.hits",
    "dualpath.node.buffer",
    "dualpath.node.prefetch",
    "dualpath.node.slots",
    "dualpath.policy.balance",
    "dualpath.policy.baselines",
    "dualpath.policy.history",
    "dualpath.policy.index",
    "dualpath.policy.inter",
    "dualpath.policy.intra",
    "dualpath.policy.registry",
    "dualpath.policy.split",
    "dualpath.policy.state",
    "dualpath.policy.thresholds",
    "dualpath.policy.values",
    "dualpath.sim.agent",
    "dualpath.sim.clock",
    "dualpath.sim.decode",
    "dualpath.sim.metrics",
    "dualpath.sim.minheap",
    "dualpath.sim.network",
    "dualpath.sim.prefetch",
    "dualpath.sim.prefill",
    "dualpath.sim.request",
    "dualpath.sim.scheduling",
    "dualpath.sim.series",
    "dualpath.sim.sharedlink",
    "dualpath.sim.simulation",
    "dualpath.sim.storage",
)

#: Hand-written C extensions built with them (dotted name -> source, relative to ``libs``).
NATIVE = {
    "dualpath.sim._hugepages": "dualpath/sim/_hugepages.c",
    "dualpath.transfer._copier": "dualpath/transfer/_copier.c",
}

#: What a profile-guided build trains on (``dualpath`` arguments): short simulations of both
#: modes, at a small and a mid scale, so the policy's paths at many engines are covered too.
PGO_TRAINING = (
    "sim offline --target ds660b --topology 4P8D --agents 2048 --dataset 64k --modes basic,dualpath --until 200 --progress never",
    "sim offline --target ds660b --topology 12P24D --agents 12288 --dataset 64k --modes dualpath --until 100 --progress never",
)

# Compiler and linker flags for the mypyc group: calls between the group's own functions bind
# inside its library (no PLT indirection per call, and the compiler may inline them).
_CFLAGS = ("-fno-semantic-interposition",)
_LDFLAGS = ("-Wl,-Bsymbolic-functions",)

GROUP = "dualpath_compiled"  # mypyc's shared library of the group: <GROUP>__mypyc
ENV = "DUALPATH_COMPILED"  # "0": never load the extensions
DIR_ENV = "DUALPATH_COMPILED_DIR"  # where they are built and loaded from (default: in the venv)
MANIFEST = "manifest.json"

_SOURCE_ROOT = Path(__file__).resolve().parent.parent  # holds the dualpath package
_state = "pure Python: not activated"


def build_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or Path(sys.prefix) / "dualpath-compiled")


def _source(module: str) -> Path:
    return _SOURCE_ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dependencies(modules: tuple[str, ...]) -> list[str]:
    """The compiled modules and every ``dualpath`` module they import (mypyc reads those types
    and may fold their constants): a change to any of them makes the build stale."""
    import ast

    seen = set(modules)
    for module in modules:
        for node in ast.walk(ast.parse(_source(module).read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:  # a module, or a package's __init__
                if name.split(".")[0] == "dualpath":
                    seen.update(n for n in (name, f"{name}.__init__") if _source(n).is_file())
    return sorted(seen)


def _stale(manifest: dict) -> str:
    """Why ``manifest`` does not describe the sources and interpreter here ('' if it does)."""
    if manifest.get("python") != sys.implementation.cache_tag:
        return f"built for {manifest.get('python')}, this is {sys.implementation.cache_tag}"
    if tuple(manifest.get("modules", {})) != MODULES or tuple(manifest.get("native", {})) != tuple(NATIVE):
        return "the list of compiled modules changed"
    for module, digest in manifest.get("native_sources", {}).items():
        path = _SOURCE_ROOT / NATIVE[module]
        if not path.is_file() or _digest(path) != digest:
            return f"{NATIVE[module]} changed since the build"
    for module, digest in manifest.get("sources", {}).items():
        path = _source(module)
        if not path.is_file() or _digest(path) != digest:
            return f"{path.relative_to(_SOURCE_ROOT)} changed since the build"
    return ""


def _check(root: Path) -> tuple[str, dict[str, Path], bool]:
    """The build in ``root``: ``("", extension file per module, whether it is profile-guided)``
    when it can be loaded here, else ``(why not, {}, False)``."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return "not built", {}, False
    try:
        why = _stale(manifest)
        files = (
            {} if why else {name: root / rel for name, rel in {**manifest["modules"], **manifest["native"], **manifest["group"]}.items()}
        )
    except (KeyError, TypeError, AttributeError):
        return "its manifest is malformed", {}, False
    if not why and not all(f.is_file() for f in files.values()):
        return "an extension file is missing", {}, False
    return why, files, not why and manifest.get("pgo") is True


class _Finder(importlib.abc.MetaPathFinder):
    """Loads the listed modules from their extension files, and nothing else."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(self, fullname: str, path: object = None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def activate() -> str:
    """Install the import hook if a fresh build exists; returns ``status()``. Call before any
    compiled module is imported (``dualpath/__init__.py`` does)."""
    global _state
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return _state
    if os.environ.get(ENV, "1") == "0":
        _state = f"pure Python: {ENV}=0"
        return _state
    why, files, pgo = _check(build_dir())
    if why == "not built":
        _state = "pure Python: not built (dualpath compiled build)"
        return _state
    if why:
        _state = f"pure Python: compiled build is stale ({why}); rebuild: bash scripts/setup.sh"
        return _state
    if already := [m for m in MODULES if m in sys.modules]:
        _state = f"pure Python: {already[0]} was imported before the hook"
        return _state
    sys.meta_path.insert(0, _Finder(files))
    _state = f"mypyc ({len(MODULES)} modules{', profile-guided' if pgo else ''})"
    return _state


def status() -> str:
    """Which code runs the hot path in this process: ``mypyc (N modules)`` or ``pure Python: why``."""
    return _state


def compiled(module: str) -> bool:
    """Whether ``module`` (imported) runs as an extension."""
    return getattr(sys.modules[module], "__file__", "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


_SETUP = """\
import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from mypyc.build import mypycify


class parallel_build_ext(build_ext):
    # build_ext's -j builds extensions in parallel, but the C files of one extension one after
    # the other; the mypyc group is one extension of one C file per module (multi_file)
    def build_extensions(self):
        compile_files = self.compiler.compile

        def compile_in_parallel(sources, *args, **kwargs):
            with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                return [o for objs in pool.map(lambda s: compile_files([s], *args, **kwargs), sources) for o in objs]

        self.compiler.compile = compile_in_parallel
        try:
            super().build_extensions()
        finally:
            self.compiler.compile = compile_files


compiled = mypycify({files!r} + ["--ignore-missing-imports"], opt_level="3", multi_file=True, group_name="{group}")
for ext in compiled:
    ext.extra_compile_args = [*(ext.extra_compile_args or []), *{cflags!r}]
    ext.extra_link_args = [*(ext.extra_link_args or []), *{ldflags!r}]
native = [Extension(name, [source], extra_compile_args=["-O2"]) for name, source in {native!r}.items()]
setup(name="{group}", ext_modules=compiled + native, cmdclass={{"build_ext": parallel_build_ext}})
"""


def build(out: Path | None = None, if_stale: bool = False, pgo: bool = False) -> Path:
    """Compile ``MODULES`` with mypyc into ``out`` (default ``build_dir()``): a staged copy of
    the package is compiled, the extensions and the manifest are moved in at the end (a failed
    build leaves the previous one, or none). With ``pgo``, compile instrumented, train on
    ``PGO_TRAINING`` and compile again with the profile. Raises ``RuntimeError`` with the
    compiler's log (or the training run's output)."""
    import shutil
    import tempfile
    import time

    out = out or build_dir()
    if if_stale and not _check(out)[0]:
        print(f"[compiled] up to date in {out}", flush=True)
        return out
    sources = {m: _digest(_source(m)) for m in _dependencies(MODULES)}
    native_sources = {m: _digest(_SOURCE_ROOT / src) for m, src in NATIVE.items()}
    started = time.monotonic()
    how = "profile-guided: instrumented, trained, compiled again (~5 min)" if pgo else "~2-3 min"
    print(f"[compiled] mypyc: {len(MODULES)} modules (and {len(NATIVE)} C extensions) -> {out} ({how})", flush=True)
    with tempfile.TemporaryDirectory(prefix="dualpath-mypyc-") as tmp:
        stage = Path(tmp)
        shutil.copytree(_SOURCE_ROOT / "dualpath", stage / "dualpath", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        manifest = {"python": sys.implementation.cache_tag, "sources": sources, "native_sources": native_sources, "pgo": pgo}
        if pgo:
            # Both compiles run in the same stage directory: the profile's files are named
            # after the object files' paths.
            profile = stage / "profile"
            _compile(stage, [f"-fprofile-generate={profile}", "-fprofile-update=single"], [f"-fprofile-generate={profile}"])
            trainee = _install(stage, out.with_name(out.name + ".training"), {**manifest, "pgo": False})
            try:
                print(
                    f"[compiled] training on {len(PGO_TRAINING)} short simulations ({time.monotonic() - started:.0f} s so far)", flush=True
                )
                _train(trainee)
            finally:
                shutil.rmtree(trainee, ignore_errors=True)
            cflags = [f"-fprofile-use={profile}", "-fprofile-partial-training", "-Wno-missing-profile"]
            _compile(stage, cflags, [], force=True)
        else:
            _compile(stage, [], [])
        _install(stage, out, manifest)
    print(f"[compiled] built in {time.monotonic() - started:.0f} s", flush=True)
    return out


def _compile(stage: Path, cflags: list[str], ldflags: list[str], *, force: bool = False) -> None:
    """Run mypyc and the C compiler in ``stage`` (the package copied there), with ``cflags``
    and ``ldflags`` added for the mypyc group."""
    import subprocess

    files = [str(Path(*m.split(".")).with_suffix(".py")) for m in MODULES]
    setup = _SETUP.format(group=GROUP, files=files, native=NATIVE, cflags=[*_CFLAGS, *cflags], ldflags=[*_LDFLAGS, *ldflags])
    (stage / "setup.py").write_text(setup)
    log = stage / "build.log"
    with log.open("w") as f:  # -j: the extensions in parallel; parallel_build_ext: the C files of each
        rc = subprocess.call(
            [sys.executable, "setup.py", "build_ext", "--inplace", "-j", str(os.cpu_count() or 1), *(["--force"] if force else [])],
            cwd=stage,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, ENV: "0"},
        )
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"mypyc build failed (exit {rc}):\n{tail}")


def _install(stage: Path, out: Path, manifest: dict) -> Path:
    """Move the extensions built in ``stage`` into ``out`` with their manifest, replacing
    what was there only once everything is in place."""
    import shutil

    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    modules = {m: str(Path(*m.split(".")).with_suffix(suffix)) for m in MODULES}
    native = {m: str(Path(*m.split(".")).with_suffix(suffix)) for m in NATIVE}
    group = {f"{GROUP}__mypyc": f"{GROUP}__mypyc{suffix}"}
    new = out.with_name(out.name + ".new")
    shutil.rmtree(new, ignore_errors=True)
    for rel in [*modules.values(), *native.values(), *group.values()]:
        (new / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(stage / rel, new / rel)
    (new / MANIFEST).write_text(json.dumps({**manifest, "modules": modules, "native": native, "group": group}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    new.rename(out)
    return out


def _train(trainee: Path) -> None:
    """Run ``PGO_TRAINING`` on the instrumented build in ``trainee``.

    Raises:
        RuntimeError: a run failed, or did not run the instrumented extensions.
    """
    import shlex
    import subprocess

    env = {**os.environ, DIR_ENV: str(trainee), ENV: "1"}
    for args in PGO_TRAINING:
        run = subprocess.run([sys.executable, "-m", "dualpath.cli", *shlex.split(args)], env=env, capture_output=True, text=True)
        said = run.stdout + run.stderr
        if run.returncode != 0 or "code: mypyc" not in said:
            why = "it did not run the instrumented build" if run.returncode == 0 else f"exit {run.returncode}"
            raise RuntimeError(f"profile training failed ({why}): dualpath {args}\n{said[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="dualpath compiled", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the hot path with mypyc")
    b.add_argument("--if-stale", action="store_true", help="do nothing when the build matches the sources")
    b.add_argument("--out", type=Path, default=None, help=f"build directory (default: {build_dir()})")
    b.add_argument("--pgo", action="store_true", help="profile-guided: compile, train on short simulations, compile again (~5 min)")
    sub.add_parser("status", help="which code this process runs, and why")
    ns = p.parse_args(argv)
    if ns.command == "status":
        print(status())
        return 0
    try:
        build(ns.out, ns.if_stale, ns.pgo)
    except (RuntimeError, OSError) as e:
        print(f"[compiled] {e}", file=sys.stderr)
        return 1
    return 0
