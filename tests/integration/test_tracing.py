"""Tracing and metrics on real processes.

A real stack exports its spans over OTLP/HTTP to a receiver this test runs (the protobuf
payloads are decoded as a collector would) and to a JSON-lines file; a 2-turn conversation
whose second turn takes the DE read path must leave one trace per request spanning every
service, with the scheduling decision and one transfer span per layer. Metrics: a service
started with ``--metrics-port`` answers a Prometheus scrape with ``dualpath_*`` metrics.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import openai_client, start_stack

from dualpath.bus.embedded import free_port
from dualpath.cli.trace import main as trace_main
from dualpath.telemetry.receiver import TraceReceiver

pytestmark = pytest.mark.slow

LAYERS = 2  # the tiny_model fixture's
SERVICES = {"gateway", "scheduler", "kv-persistence", "traffic-manager", "prefill-engine-p0e0", "decode-engine-d0e0"}


@dataclass
class TracedRun:
    spans: list[dict]
    file: Path
    rids: list[str]
    paths: list[str]
    cached: list[int]
    exit_codes: dict = field(default_factory=dict)
    query_url: str = ""  # the receiver's Jaeger-style query API, up while the module's tests run


@pytest.fixture(scope="module")
def traced_run(tiny_model, tmp_path_factory) -> Iterator[TracedRun]:
    base = tmp_path_factory.mktemp("tracing")
    receiver = TraceReceiver().start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.otlp_url,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "DUALPATH_TRACE_FILE": str(base / "spans.jsonl"),
    }
    stack = start_stack(tiny_model, base / "storage", base / "run", extra_env=env)
    rids, paths, cached = [], [], []
    try:
        client = openai_client(stack.url, 60)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": "You are a coding agent. Read the repository layout carefully first. " * 4}]
        for text, path in (("List the files that hold the scheduler.", "pe"), ("Tool output: core.py. Open it.", "de")):
            messages.append({"role": "user", "content": text})
            r = client.chat.completions.create(
                model=model, messages=messages, max_tokens=6, temperature=0, extra_body={"dualpath_read_path": path}
            )
            rids.append(r.id)
            paths.append(r.model_extra["dualpath"]["read_path"])
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
    finally:
        codes = stack.stop()  # each service flushes its spans on exit
    spans = [asdict(s) for s in receiver.spans]
    try:
        yield TracedRun(
            spans=spans, file=base / "spans.jsonl", rids=rids, paths=paths, cached=cached, exit_codes=codes, query_url=receiver.query_url
        )
    finally:
        receiver.stop()


def _trace_of(run: TracedRun, rid: str) -> list[dict]:
    roots = [s for s in run.spans if s["name"] == "request" and s["attributes"].get("request_id") == rid]
    assert len(roots) == 1, f"expected one root span for {rid}, got {len(roots)}"
    return [s for s in run.spans if s["trace_id"] == roots[0]["trace_id"]]


def test_every_service_stops_on_sigterm_and_the_second_turn_reads_hits_on_the_de_path(traced_run):
    # none had to be killed (uvicorn re-raises SIGTERM after its graceful shutdown: -15)
    assert all(code in (0, -15) for code in traced_run.exit_codes.values()), traced_run.exit_codes
    assert traced_run.paths[1] == "de" and traced_run.cached[1] > 0


def test_each_request_is_one_trace_across_every_service_with_resolvable_parents(traced_run):
    traces = {s["trace_id"] for rid in traced_run.rids for s in _trace_of(traced_run, rid)}
    assert len(traces) == 2  # one trace per request, not shared
    assert {s["name"] for s in traced_run.spans if s["parent_id"] is None} == {"request"}  # and no other traces (HTTP, probes)
    for rid in traced_run.rids:
        spans = _trace_of(traced_run, rid)
        assert SERVICES <= {s["service"] for s in spans}
        ids = {s["span_id"] for s in spans}
        roots = [s for s in spans if s["parent_id"] is None]
        assert [r["name"] for r in roots] == ["request"]
        assert all(s["parent_id"] in ids for s in spans if s["parent_id"] is not None)
        by_id = {s["span_id"]: s for s in spans}
        # cross-process links: engine and scheduler spans hang under the gateway's root
        for name in ("scheduler.decision", "prefill.request", "decode.request"):
            span = next(s for s in spans if s["name"] == name)
            assert by_id[span["parent_id"]]["service"] == "gateway"
        commit = next(s for s in spans if s["name"] == "index.commit")
        assert commit["service"] == "kv-persistence" and by_id[commit["parent_id"]]["service"] == "traffic-manager"


def test_the_root_span_has_the_client_view_of_latency_and_the_read_path(traced_run):
    root = next(s for s in _trace_of(traced_run, traced_run.rids[1]) if s["name"] == "request")
    a = root["attributes"]
    assert a["dualpath.read_path"] == "de" and a["cached_tokens"] == traced_run.cached[1]
    assert a["completion_tokens"] == 6 and a["ttft_s"] > 0 and a["tpot_s"] > 0
    assert a["finish_reason"] == "length"


def test_the_decision_span_carries_the_choice_and_what_the_policy_compared(traced_run):
    decision = next(s for s in _trace_of(traced_run, traced_run.rids[1]) if s["name"] == "scheduler.decision")
    a = decision["attributes"]
    assert a["prefill_engine"] == "p0e0" and a["decode_engine"] == "d0e0"
    assert a["read_side"] in ("pe", "de") and a["read_path"] == "de"  # forced by the request
    assert a["policy"] == "dualpath"
    for key in ("read_q_pe", "read_q_de", "tok_e_prefill", "tok_e_decode"):
        assert isinstance(a[key], int), key
    assert a["hit_tokens"] == traced_run.cached[1]


def test_every_prefill_batch_span_carries_its_predicted_time_under_the_compute_quota(traced_run):
    """The torch backend predicts from its start-up profile; the quota is the default 300 ms."""
    batches = [s["attributes"] for s in traced_run.spans if s["name"] == "prefill.batch"]
    assert len(batches) >= 2
    for a in batches:
        assert a["predicted_by"] == "profile" and a["quota_s"] == pytest.approx(0.3) and a["predicted_s"] > 0
        assert a["chunked"] is False and a["over_quota"] is False  # short prompts: whole requests, well under the quota
        assert a["predicted_s"] <= a["quota_s"]
        assert len(a["request_cached_tokens"]) == len(a["request_new_tokens"]) == a["requests"]
        assert sum(a["request_new_tokens"]) == a["new_tokens"] and sum(a["request_cached_tokens"]) == a["cached_tokens"]


def test_the_de_path_turn_has_one_fetch_and_one_store_span_per_layer(traced_run):
    spans = _trace_of(traced_run, traced_run.rids[1])
    batch = next(s for s in spans if s["name"] == "prefill.batch")
    fetch = [s for s in spans if s["name"] == "kv.fetch"]
    store = [s for s in spans if s["name"] == "kv.store"]
    assert sorted(s["attributes"]["layer"] for s in fetch) == list(range(LAYERS))
    assert sorted(s["attributes"]["layer"] for s in store) == list(range(LAYERS))
    for s in fetch + store:
        assert s["parent_id"] == batch["span_id"]
        assert s["attributes"]["path"] == "de" and s["attributes"]["traffic_class"] == "kv" and s["attributes"]["bytes"] > 0
        assert s["attributes"]["transfer_s"] >= 0 and s["attributes"]["wait_s"] >= 0
    assert all(s["attributes"]["src"] == "d0" and s["attributes"]["dst"] == "p0" for s in fetch)  # DE buffer -> PE
    assert sum(s["attributes"]["bytes"] for s in fetch) == batch["attributes"]["fetch_bytes"]
    load = next(s for s in spans if s["name"] == "storage.read")
    assert load["service"] == "traffic-manager" and load["attributes"]["node"] == "d0" and load["attributes"]["loaded_blocks"] > 0


def test_the_first_turn_fetches_nothing_and_stores_every_layer(traced_run):
    spans = _trace_of(traced_run, traced_run.rids[0])
    assert not [s for s in spans if s["name"] == "kv.fetch"]
    assert sorted(s["attributes"]["layer"] for s in spans if s["name"] == "kv.store") == list(range(LAYERS))


def test_trace_show_prints_the_request_tree_from_the_span_file(traced_run, capsys):
    assert trace_main(["show", traced_run.rids[1], "--file", str(traced_run.file)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert traced_run.rids[1] in lines[0]
    cols = lines[2].split()  # the root comes first: offset 0, the whole request's duration
    assert cols[0] == "0.00" and cols[2:4] == ["request", "[gateway]"] and float(cols[1]) > 0
    for name in ("scheduler.decision", "prefill.batch", "kv.fetch", "storage.read", "decode.request", "index.commit"):
        assert name in out, name
    assert "├─ " in out and "└─ " in out  # a tree, not a flat list
    assert "read_side=" in out and "layer=1" in out


def test_trace_show_over_the_jaeger_query_api_prints_the_tree_the_span_file_gives(traced_run, capsys):
    """The receiver's Jaeger-shaped answers carry what the exporter sent: the same tree as the file."""
    rid = traced_run.rids[1]
    assert trace_main(["show", rid, "--file", str(traced_run.file)]) == 0
    from_file = capsys.readouterr().out
    assert trace_main(["show", rid, "--jaeger", traced_run.query_url]) == 0
    from_query = capsys.readouterr().out
    tree = [line.split()[2:] for line in from_query.splitlines()[2:]]  # span names and services, offsets aside
    assert tree == [line.split()[2:] for line in from_file.splitlines()[2:]] and len(tree) > 10
    services = httpx.get(traced_run.query_url + "/api/services", timeout=5).json()["data"]
    assert set(services) >= SERVICES
    assert trace_main(["show", "chatcmpl-nope", "--jaeger", traced_run.query_url]) == 1


def test_trace_show_of_an_unknown_request_fails_with_a_clear_message(traced_run, capsys):
    assert trace_main(["show", "chatcmpl-nope", "--file", str(traced_run.file)]) == 1
    assert "no trace of request 'chatcmpl-nope'" in capsys.readouterr().err


def _scrape(url: str, want: str, proc: subprocess.Popen, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-2000:]
        try:
            text = httpx.get(url, timeout=2).text
            if want in text:
                return text
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{want} not scraped from {url} in {timeout:.0f}s:\n{text[-2000:]}")


def _run_service(module: str, nats_url: str, port: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, "--nats-url", nats_url, "--namespace", f"m{port}", "--metrics-port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_the_scheduler_serves_its_queue_metrics_for_prometheus(nats_server):
    port = free_port()
    proc = _run_service("services.scheduler", nats_server.url, port)
    try:
        text = _scrape(f"http://127.0.0.1:{port}/metrics", "dualpath_scheduler_queue", proc)
    finally:
        _stop(proc)
    assert "dualpath_scheduler_queue 0.0" in text and "dualpath_scheduler_running 0.0" in text
    assert 'dualpath_scheduler_engines{role="prefill"} 0.0' in text
    assert 'service_name="scheduler"' in text  # target_info: which service this is


def test_a_traffic_manager_serves_read_queue_buffer_and_snic_metrics(nats_server, tmp_path):
    port = free_port()
    proc = _run_service(
        "services.traffic_manager",
        nats_server.url,
        port,
        "--node-id",
        "n0",
        "--storage",
        str(tmp_path),
        "--buffer-mb",
        "4",
        "--snic-gbps",
        "100",
        "--scale",
        "1000",
    )
    try:
        text = _scrape(f"http://127.0.0.1:{port}/metrics", "dualpath_storage_read_q", proc)
    finally:
        _stop(proc)
    assert 'dualpath_storage_read_q{node="n0"} 0.0' in text
    assert 'dualpath_buffer_size_bytes{node="n0"} 4.194304e+06' in text and 'dualpath_buffer_used_bytes{node="n0"} 0.0' in text
    assert 'dualpath_nic_bytes_total{nic="n0-snic-read",traffic_class="kv"} 0.0' in text
    assert 'dualpath_nic_utilization{nic="n0-snic-write"} 0.0' in text
