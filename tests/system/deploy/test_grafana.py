"""deploy/grafana: every PromQL query of the dashboard names only metrics (and labels) that a real server
exports, checked against the /metrics of a `python -m service` process serving the shipped tiny model after
one request (with --tenants, so the per-tenant series are there too); the queries parse (`promtool check
rules`, where installed); the panels cover what the dashboard promises; the compose file provisions it.
The PNG's renderer is checked for what it does without a server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.harness import API_KEY, REPO, TINY, require_models
from tests.system.server import launch

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read the provisioning files")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = REPO
GRAFANA = ROOT / "deploy/grafana"
DASHBOARD = json.loads((GRAFANA / "pagedserve.json").read_text())
METRIC = re.compile(r"\b(pagedserve:[a-zA-Z_][a-zA-Z0-9_:]*)(\{[^}]*\})?")
ADDED_BY_PROMETHEUS = {"instance", "job"}  # target labels every scraped series gets


def _targets() -> list[dict]:
    return [t for p in DASHBOARD["panels"] for t in p.get("targets", [])]


def _queries() -> list[str]:
    """Every PromQL expression: panel targets and the variables' label_values(...) queries."""
    variables = [v["query"]["query"] for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]
    return [t["expr"] for t in _targets()] + variables


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    """{sample name: its label names} scraped from a real server after one completion."""
    require_models(TINY)
    tmp = tmp_path_factory.mktemp("grafana")
    # the tenant series exist only with --tenants; a rate on the default tenant (which --api-key keys
    # serve) adds its bucket's gauge
    tenants = tmp / "tenants.toml"
    tenants.write_text("[tenants.default]\ntokens_per_minute = 60000\n")
    server = launch(
        ["--model", str(TINY), "--api-key", API_KEY, "--tenants", str(tenants)], tmp / "server.log"
    )
    try:
        status, _, _ = server.post(
            "/v1/completions", {"model": TINY.name, "prompt": "def add(a, b):", "max_tokens": 4}
        )
        assert status == 200
        status, _, body = server.get("/metrics")
        assert status == 200
    finally:
        server.stop()
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def test_every_query_names_metrics_the_server_exports(exported):
    named = set()
    for expr in _queries():
        found = METRIC.findall(expr)
        assert found, f"no pagedserve metric in {expr!r}"
        for name, selector in found:
            assert name in exported, f"{name} (in {expr!r}) is not on a real server's /metrics"
            labels = set(re.findall(r"(\w+)\s*=~?", selector))
            assert labels <= exported[name] | ADDED_BY_PROMETHEUS, (name, labels - exported[name])
            named.add(name)
        # grouping labels exist on some metric of the expression
        grouped = {
            label.strip()
            for group in re.findall(r"\b(?:by|ignoring)\s*\(([^)]*)\)", expr)
            for label in group.split(",")
        }
        available = set().union(*(exported[n] for n, _ in found)) | ADDED_BY_PROMETHEUS
        assert grouped <= available, (expr, grouped - available)
    # histograms are read through their buckets, counters through _total
    assert {
        "pagedserve:time_to_first_token_seconds_bucket",
        "pagedserve:inter_token_latency_seconds_bucket",
        "pagedserve:e2e_request_latency_seconds_bucket",
        "pagedserve:generation_tokens_total",
        "pagedserve:tenant_tokens_total",
        "pagedserve:tenant_queue_time_seconds_bucket",
        "pagedserve:tenant_rejections_total",
        "pagedserve:tenant_requests_in_flight",
        "pagedserve:tenant_tokens_available",
    } <= named


def test_the_autoscalers_series_is_exported(exported):
    values = yaml.safe_load((ROOT / "deploy/k8s/prometheus-adapter-values.yaml").read_text())
    for rule in values["rules"]["custom"]:
        [(name, selector)] = METRIC.findall(rule["seriesQuery"])
        assert name in exported and "model_name" in exported[name]


def test_the_metric_check_would_catch_a_wrong_name(exported):
    # what a dashboard written for vLLM's names, or a counter without its suffix, would use
    for wrong in (
        "pagedserve:generation_tokens",
        "pagedserve:gpu_cache_usage_perc",
        "pagedserve:time_to_first_token_seconds",
    ):
        assert wrong not in exported


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_queries_parse_as_promql(tmp_path):
    # each panel query as a recording rule, Grafana's variables filled as Grafana would
    rules = [
        {
            "record": f"dashboard:query_{n}",
            "expr": expr.replace("$__rate_interval", "1m").replace("$instance", ".*").replace("$model", ".*"),
        }
        for n, expr in enumerate(_queries())
        if not expr.startswith("label_values(")
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_panels_cover_the_dashboards_promise():
    titles = " | ".join(p["title"].lower() for p in DASHBOARD["panels"] if p["type"] != "row")
    for topic in (
        "throughput",
        "time to first token",
        "inter-token",
        "end-to-end",
        "queue",
        "kv-cache",
        "prefix-cache hit rate",
        "breaker",
        "failover",
        "degraded share",
        "leak",
        "memory",
    ):
        assert topic in titles, topic
    for metric in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        quantiles = {
            re.match(r"histogram_quantile\(([\d.]+),", t["expr"]).group(1)
            for t in _targets()
            if f"{metric}_bucket" in t["expr"]
        }
        assert quantiles == {"0.5", "0.95", "0.99"}, metric
    # per model: every query of a per-model metric can be narrowed by the model variable
    for target in _targets():
        for _name, selector in METRIC.findall(target["expr"]):
            if "model_name" in target["legendFormat"] and "ignoring" not in target["expr"]:
                assert 'model_name=~"$model"' in selector, target["expr"]


def test_dashboard_is_well_formed():
    assert DASHBOARD["uid"] == "pagedserve"
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        cell = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & cell, f"{panel['title']} overlaps another panel"
        cells |= cell
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert {t["refId"] for t in panel["targets"]} == {
                chr(65 + n) for n in range(len(panel["targets"]))
            }
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert variables == {"datasource", "instance", "model"}


def test_compose_provisions_the_dashboard_and_the_datasource():
    compose = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(v.removesuffix(":ro").split(":") for v in grafana["volumes"])
    assert all(v.endswith(":ro") for v in grafana["volumes"])
    assert mounts["./grafana/pagedserve.json"] == "/etc/grafana/dashboards/pagedserve.json"
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/pagedserve.yml").read_text())["providers"][
        0
    ]
    assert provider["options"]["path"] == "/etc/grafana/dashboards"
    assert mounts["./grafana/provisioning/dashboards/pagedserve.yml"].startswith(
        "/etc/grafana/provisioning/dashboards/"
    )
    datasources = "./grafana/provisioning/datasources/prometheus.yml"
    assert mounts[datasources].startswith("/etc/grafana/provisioning/datasources/")
    [source] = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert source["url"] == "http://prometheus:9090" and "prometheus" in grafana["depends_on"]
    assert "127.0.0.1:9090:9090" in compose["services"]["prometheus"]["ports"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]


def test_renderer_fills_variables_and_legends():
    from deploy.grafana.render_png import legend, promql

    assert (
        promql('rate(x{instance=~"$instance",model_name=~"$model"}[$__rate_interval])', "10s")
        == 'rate(x{instance=~".*",model_name=~".*"}[10s])'
    )
    assert legend("{{model_name}} p99", {"model_name": "tiny"}) == "tiny p99"
    assert legend("{{ instance }} leak", {}) == "leak"


def test_the_rendered_png_is_committed():
    png = GRAFANA / "dashboard.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
