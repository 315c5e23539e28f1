"""Shared fixtures: a tiny checkpoint on disk, a real nats-server, a whole DualPath stack, and a
listener on the scheduler's submit subject."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from dualpath.bus.embedded import EmbeddedNats, free_port


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"  # nats-py needs asyncio


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 checkpoint made on disk (loaded by the same code as a real one)."""
    from dualpath.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=0)


def spawn_nats(cmd: list[str], url: str, log: Path, timeout: float = 15.0) -> subprocess.Popen:
    """Start a ``nats-server`` command (a ``nats_servers`` spec's ``cmd``), appending its output
    to ``log``, and return once ``url``'s port accepts connections."""
    with log.open("a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    u = urlparse(url)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((u.hostname, u.port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"nats-server at {url} did not start:\n{log.read_text()[-2000:]}") from None
            time.sleep(0.05)


def pause(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped: the signal is delivered
    asynchronously, and on a busy host a thread still running can answer one more message."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue  # a thread that just exited
        if states and all(s in "Tt" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: thread states {states}"
        time.sleep(0.005)


@pytest.fixture()
def nats_server():
    """A real nats-server on a free loopback port, stopped afterwards."""
    server = EmbeddedNats().start()
    try:
        yield server
    finally:
        server.stop()


def start_stack(model: Path, storage: Path, run_dir: Path, *, topology: str = "1P1D", engines_per_node: int = 1, **kw):
    """Start a real stack (NATS + one process per service) and wait until it is ready."""
    from dualpath.cli.launcher.stack import Stack, StackConfig
    from dualpath.cli.launcher.topology import parse_topology

    cfg = StackConfig(
        model=str(model),
        topology=parse_topology(topology, engines_per_node),
        storage=str(storage),
        run_dir=str(run_dir),
        port=free_port(),
        buffer_mb=kw.pop("buffer_mb", 64),
        **kw,
    )
    _STACK_LOGS.append((_current_module(), Path(cfg.run_dir) / "logs"))
    stack = Stack(cfg)
    _STACKS.append(stack)
    return stack.start(timeout=float(os.environ.get("DUALPATH_TEST_READY_TIMEOUT", "120")))


_STACKS: list = []  # every stack start_stack made, checked for refused NATS operations when its module ends


# ---- SDK clients ---------------------------------------------------------------------------
# A test's SDK clients are closed when the test ends. One left to the garbage collector is closed
# by its own finalizer only when nothing holds it; in a reference cycle (a traceback, a stream)
# the collector may finalize its pooled sockets first, and their ResourceWarning fails whichever
# test the collection happens to run in.
_CLIENTS: list = []


def openai_client(url: str, timeout: float = 120.0):
    """The OpenAI SDK on the gateway at ``url`` (no retries), closed when the test ends."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    _CLIENTS.append(client)
    return client


def anthropic_client(url: str, timeout: float = 120.0):
    """The Anthropic SDK on the gateway at ``url`` (no retries), closed when the test ends."""
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=timeout)
    _CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_sdk_clients():
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


@pytest.fixture(scope="module", autouse=True)
def _collect_cycles_of_the_module():
    """Objects a module's tests left in reference cycles are collected when the module ends.

    A socket that a client library abandons in a cycle (nats.py does on a refused or dropped
    connection) is closed only by the garbage collector, and its ResourceWarning is raised in
    whichever test the next collection happens to run in, often a module later. Collecting here
    reports it in the module that made it, under that module's warning filters.

    What survives is frozen (``gc.freeze``): the imports (torch, transformers), the session's
    fixtures and caches, most of the heap, which every later full collection would otherwise walk
    again. Unreachable objects are still freed by their reference counts; only a cycle
    among them that becomes garbage later stays until the process ends."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _no_nats_permission_violations():
    """A stack's services use only the subjects their roles are granted: a refusal in any NATS
    server's log (a subject without a rule in ``dualpath.protocol.subjects``) fails the module.
    A test that provokes refusals on purpose sets ``stack.violations_expected = True``."""
    first = len(_STACKS)
    yield
    stacks, _STACKS[first:] = _STACKS[first:], []
    found = [v for s in stacks if not getattr(s, "violations_expected", False) for v in s.nats_violations()]
    assert not found, "NATS refused operations of the stack's services:\n" + "\n".join(found[:20])


# ---- service logs on failure --------------------------------------------------------------
# A test that drives a real stack fails on what its services did: the report carries each
# service's warnings and last lines, so a failure on CI can be read without the machine.
_STACK_LOGS: list[tuple[str, Path]] = []  # (test module, log folder) of each stack started
_LOG_TAIL = 12  # last lines of each service log
_LOG_WARNINGS = 20  # last warning/error lines of each service log


def _current_module() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").split("::", 1)[0]


def _service_log_digest(folder: Path) -> str:
    out = []
    for log in sorted(p for p in folder.glob("*.log") if not p.name.startswith("nats-")):  # not the NATS servers
        lines = log.read_text(errors="replace").splitlines()
        warnings = [ln for ln in lines if '"level": "warning"' in ln or '"level": "error"' in ln or "Traceback" in ln]
        out.append(f"--- {log.name}: {len(lines)} lines, {len(warnings)} warnings/errors")
        out += [f"  W {ln[:400]}" for ln in warnings[-_LOG_WARNINGS:]]
        out += [f"  | {ln[:400]}" for ln in lines[-_LOG_TAIL:]]
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    module = item.nodeid.split("::", 1)[0]
    if report.failed and call.when in ("setup", "call"):
        for mod, folder in _STACK_LOGS:
            if mod == module and folder.is_dir():
                report.sections.append((f"service logs {folder}", _service_log_digest(folder)))
    if call.when == "teardown":
        _STACK_LOGS[:] = [(m, f) for m, f in _STACK_LOGS if m == module]  # the module's stack may serve its next test


def prefetch_counters(stack) -> dict[str, dict]:
    """The latest prefetch counters each traffic manager reports (read as the stack's observer)."""

    import nats

    from dualpath.protocol.codec import decode
    from dualpath.protocol.messages import NodeReport

    async def collect() -> dict[str, dict]:
        from dualpath.protocol.subjects import Role, Subjects

        nc = await nats.connect(stack.nats_url.split(","), **stack.nats_options(Role.OBSERVER))
        seen: dict[str, dict] = {}

        async def on(msg) -> None:
            r = decode(msg.data, NodeReport)
            seen[r.node_id] = r.prefetch

        await nc.subscribe(Subjects(stack.namespace).node_reports, cb=on)
        await asyncio.sleep(1.0)
        await nc.close()
        return seen

    return asyncio.run(collect())


class SubmitTap:
    """Listens to the scheduler's submit subject (the sessions requests reach the scheduler with)
    and to the traffic managers' prefetch hints (the sessions the scheduler stages blocks for)."""

    def __init__(self, stack) -> None:
        from dualpath.protocol.subjects import Subjects

        self.url, self.subject = stack.nats_url, Subjects(stack.namespace).submit
        self.options = stack.nats_options()  # the operator: it taps subjects no service role reads
        self.sessions: dict[str, str] = {}  # request id -> session
        self.prefetch_subjects = Subjects(stack.namespace).tm_every_node("prefetch")
        self.prefetched: list[str] = []  # the session of each prefetch hint, in order
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        import nats

        from dualpath.protocol.codec import decode
        from dualpath.protocol.messages import PrefetchRequest, SubmitRequest

        nc = await nats.connect(self.url.split(","), **self.options)

        async def on(msg) -> None:
            req = decode(msg.data, SubmitRequest)
            self.sessions[req.request_id] = req.session

        async def on_hint(msg) -> None:
            self.prefetched.append(decode(msg.data, PrefetchRequest).session)

        await nc.subscribe(self.subject, cb=on)
        await nc.subscribe(self.prefetch_subjects, cb=on_hint)
        await nc.flush()
        self._ready.set()
        while not self._stop.is_set():
            await asyncio.sleep(0.05)
        await nc.close()

    def __enter__(self) -> SubmitTap:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)
        self._stop.set()
        self._thread.join(10)


def converse(
    url: str,
    model: str,
    turns: list[str],
    *,
    max_tokens: int,
    read_path: str = "auto",
    gap_s: float = 0.0,
    headers: dict[str, str] | None = None,
) -> list[dict]:
    """One greedy multi-turn conversation through the OpenAI client, with logprobs.

    Each turn appends the user text, then the served answer. ``gap_s`` is the agent's tool
    call time between turns. Per turn: text, logprobs, cached tokens, and the response's
    ``dualpath`` extension (read path, read split).
    """
    client = openai_client(url)
    messages, out = [{"role": "system", "content": "You are an agent."}], []
    for i, text in enumerate(turns):
        if i and gap_s:
            time.sleep(gap_s)
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0,
            logprobs=True,
            extra_body={"dualpath_read_path": read_path},
            extra_headers=headers or {},
        )
        c = r.choices[0]
        record = (r.model_extra or {}).get("dualpath", {})
        assert c.logprobs is not None and c.logprobs.content is not None and r.usage is not None
        details = r.usage.prompt_tokens_details
        out.append(
            {
                "text": c.message.content,
                "logprobs": [t.logprob for t in c.logprobs.content],
                "cached": details.cached_tokens if details else 0,
                "path": record.get("read_path"),
                "split": record.get("read_split"),
            }
        )
        messages.append({"role": "assistant", "content": c.message.content or ""})
    return out


def decode_from_memory(decoder, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens the decode engine's path gives: the prompt's KV from one full forward,
    packed into ``KvMemory`` as the engine holds it, then ``decode_step`` one token at a time."""
    from dualpath.engine.decode import DecodeSequence, KvMemory, decode_step

    spec = decoder.kv_spec
    memory = KvMemory(
        layers=decoder.num_layers, spec=spec, dtype=decoder.dtype, device=decoder.device, capacity_tokens=4096, block_tokens=16
    )
    logits, k, v = decoder.forward_full(prompt)
    kv = memory.allocate(len(prompt) + steps)
    for layer in range(decoder.num_layers):
        spec.pack_rows_into(kv[layer, :, : len(prompt)], k[layer], v[layer])
    seq = DecodeSequence(request_id="r", tokens=list(prompt), kv=kv, kv_len=len(prompt))
    out = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        out.append(int(decode_step(decoder, memory, [seq], [out[-1]])[0].argmax()))
    return out
