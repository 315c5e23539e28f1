"""``GET /metrics`` on the gateway's API port (``services.gateway.metrics_page``) and the Grafana
dashboard that the compose stack loads (``deploy/grafana``, ``deploy/compose/prometheus.yml``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from dualpath.protocol import messages as m
from services.gateway.metrics_page import ClusterFigures, Histogram, render_metrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "dualpath.json"
COMPOSE = REPO / "deploy" / "compose" / "compose.yaml"
PROMETHEUS = REPO / "deploy" / "compose" / "prometheus.yml"


def _state(**kw) -> m.StateReply:
    return m.StateReply(**{"prefill_engines": 1, "decode_engines": 2, "nodes": 2, "queued": 3, "running": 4, "policy": "dualpath", **kw})


def _page() -> str:
    fig = ClusterFigures()
    for ttft in (0.02, 0.3, 5.0):
        fig.ttft.observe(ttft)
    fig.tpot.observe(0.004)
    fig.requests[("de", "stop", "")] += 2
    fig.requests[("pe", "length", "")] += 1
    fig.prompt_tokens[""], fig.cached_tokens[""] = 400, 256
    return render_metrics(fig, _state(buffer_waits=7))


def test_page_is_valid_prometheus_text_with_the_cluster_figures():
    families = {f.name: f for f in text_string_to_metric_families(_page())}
    ttft = {s.labels.get("le"): s.value for s in families["dualpath_ttft_seconds"].samples if s.name.endswith("_bucket")}
    assert ttft["0.025"] == 1 and ttft["0.5"] == 2 and ttft["10"] == 3 and ttft["+Inf"] == 3
    assert families["dualpath_cached_token_ratio"].samples[0].value == 0.64
    by_path = {(s.labels["read_path"], s.labels["finish_reason"]): s.value for s in families["dualpath_requests"].samples}
    assert by_path == {("de", "stop"): 2, ("pe", "length"): 1}
    assert families["dualpath_queue_length"].samples[0].value == 3
    assert {s.labels["role"]: s.value for s in families["dualpath_engines"].samples} == {"prefill": 1, "decode": 2}


def test_an_open_gateways_page_has_no_tenant_label():
    families = {f.name: f for f in text_string_to_metric_families(_page())}
    assert [s.labels for s in families["dualpath_prompt_tokens"].samples] == [{}]
    assert all("tenant" not in s.labels for s in families["dualpath_requests"].samples)


def test_tokens_requests_and_refusals_are_labelled_by_tenant():
    fig = ClusterFigures()
    fig.requests[("de", "stop", "alice")] += 2
    fig.requests[("none", "stop", "bob")] += 1
    fig.prompt_tokens.update({"alice": 300, "bob": 100})
    fig.cached_tokens.update({"alice": 192, "bob": 0})
    fig.limited[("bob", "tokens_per_minute")] += 3
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(fig, None))}
    assert {s.labels["tenant"]: s.value for s in families["dualpath_cached_tokens"].samples} == {"alice": 192, "bob": 0}
    assert {s.labels["tenant"]: s.value for s in families["dualpath_prompt_tokens"].samples} == {"alice": 300, "bob": 100}
    assert families["dualpath_cached_token_ratio"].samples[0].value == 0.48
    by = {(s.labels["tenant"], s.labels["read_path"]): s.value for s in families["dualpath_requests"].samples}
    assert by == {("alice", "de"): 2, ("bob", "none"): 1}
    (refused,) = families["dualpath_rate_limited"].samples
    assert refused.labels == {"tenant": "bob", "limit": "tokens_per_minute"} and refused.value == 3


def test_page_without_a_scheduler_says_so_and_keeps_the_gateways_own_figures():
    text = render_metrics(ClusterFigures(), None)
    assert "dualpath_scheduler_up 0" in text and "dualpath_queue_length" not in text
    assert "dualpath_ttft_seconds_count 0" in text and "dualpath_cached_token_ratio 0" in text


def test_histogram_buckets_are_cumulative_with_le_upper_bounds():
    h = Histogram(bounds=(1.0, 2.0))
    for v in (1.0, 1.5, 3.0):
        h.observe(v)
    assert h.lines("x", "y")[2:5] == ['x_bucket{le="1"} 1', 'x_bucket{le="2"} 2', 'x_bucket{le="+Inf"} 3']


def _dashboard_metrics(job: str) -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return {name for e in exprs if f'job="{job}"' in e for name in re.findall(r"(dualpath_[a-z_]+?)(?:_bucket)?\{job=\"" + job, e)}


def test_every_api_metric_the_dashboard_queries_is_on_the_page():
    names = {line.split("{")[0].split(" ")[0] for line in _page().splitlines() if line and not line.startswith("#")}
    queried = _dashboard_metrics("dualpath-api")
    assert queried and queried <= {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_compose_stack_loads_the_dashboard_from_prometheus_that_scrapes_the_api_port_and_every_service():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    mounts = {v["target"]: (COMPOSE.parent / v["source"]).resolve() for v in services["grafana"]["volumes"]}
    assert mounts["/var/lib/grafana/dashboards"] == DASHBOARD.parent
    provider = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "dashboards" / "dualpath.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    uids = {t["datasource"]["uid"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]} and datasource["url"] == "http://prometheus:9090"
    scrape = {j["job_name"]: j["static_configs"][0]["targets"] for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    port = services["gateway"]["environment"]["DUALPATH_PORT"]
    assert scrape["dualpath-api"] == [f"gateway:{port}"]
    dualpath_services = {
        name for name, svc in services.items() if str(svc.get("command", [""])[0]) == "dualpath" and "service" in svc.get("command", [])
    }
    assert {t.split(":")[0] for t in scrape["dualpath-services"]} == dualpath_services
    assert compose["configs"]["prometheus-conf"]["file"] == "./prometheus.yml"
