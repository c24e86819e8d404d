"""deploy/grafana/tokenpools.json (issue 28, item 4): a valid dashboard whose every query reads a metric and
labels that a real gateway's /metrics exports, so the dashboard and the exporter cannot drift apart.

The gateway serves traffic that makes every family the dashboard reads carry series (an admission, a quota
refusal, a queue wait, an entitlement's and a tenant's quota, a replica reporting KV use, the store's view),
then its /metrics, read with the METRICS_TOKEN bearer as Prometheus scrapes it, is the reference."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.promql import PromQLError, Usage, extract, label_values_query
from tests.support.metrics import scrape

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tokenpools.json"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "scrape.yaml"
# Labels Prometheus itself attaches to every scraped series (the target's), not the gateway's.
TARGET_LABELS = frozenset({"instance", "job"})
BODY = {"model": "tiny-model", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4}
_SERIES = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? \S+$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

Exported = dict[str, dict[str, set[str]]]


def parse_exposition(text: str) -> tuple[set[str], Exported]:
    """(the families of # TYPE lines, series name -> label -> values seen)."""
    families: set[str] = set()
    series: Exported = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            families.add(line.split()[2])
        elif line and not line.startswith("#"):
            match = _SERIES.match(line)
            assert match, line
            labels = series.setdefault(match.group(1), {})
            for name, value in _LABEL.findall(match.group(2) or ""):
                labels.setdefault(name, set()).add(value)
    return families, series


def problems(usage: Usage, families: set[str], series: Exported) -> list[str]:
    """Every metric the expression reads must be exported with series; every label it matches must be one of
    that metric's, every literal `=` value one it carried; every grouping label one of the expression's
    metrics' (or a target label)."""
    found: list[str] = []
    known: set[str] = set(TARGET_LABELS)
    for metric, matchers in usage.metrics.items():
        family = re.sub(r"_(bucket|sum|count)$", "", metric)
        if metric not in families and family not in families:
            found.append(f"{metric}: no such metric family on /metrics")
            continue
        if metric not in series:
            found.append(f"{metric}: exported without series (the test's traffic must produce some)")
            continue
        labels = series[metric]
        known.update(labels)
        for label, values in matchers.items():
            if label not in labels:
                found.append(f"{metric}: no label {label!r} (it has {sorted(labels)})")
                continue
            for value in values:
                if value not in labels.get(label, ()):
                    found.append(f"{metric}: {label}={value!r} never exported")
    found.extend(f"label {label!r} of by/on/group_left is on none of {sorted(usage.metrics)}"
                 for label in sorted(usage.grouping - known))
    return found


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every variable's label_values() selector."""
    found = [(f"panel {p['id']} {p['title']!r}", t["expr"]) for p in board["panels"] for t in p.get("targets", ())]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = label_values_query(variable["query"]["query"])
            found.append((f"variable {variable['name']}", f"max by ({label}) ({selector})"))
    return found


def _fire(h: Any, secret: str, count: int) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:
            return await asyncio.gather(*(client.post(h.url + "/v1/chat/completions", json=BODY,
                                                      headers=h.auth(secret)) for _ in range(count)))
    return asyncio.run(run())


@pytest.fixture
def exported(gateway_factory: Any, upstream_factory: Any, acme: Any, metrics_token: str,
             memory_control: Any) -> tuple[set[str], Exported]:
    acme.quota_tokens, acme.quota_window = 100_000, "day"
    acme.save()
    upstream, _ = upstream_factory(first_token_delay_s=0.2, waiting=0, kv_usage=0.25)
    own = {"concurrency": 1, "quota_tokens": 50_000, "quota_window": "day"}
    h = gateway_factory(upstreams=[upstream], entitlement=own,
                        extra_entitlements={"acme-batch": {"service_class": "elastic", "quota_tokens": 1,
                                                           "quota_window": "day"}})
    answers = _fire(h, h.secret, 2)  # concurrency 1: the second waits in the entitlement's queue
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    refused = _fire(h, h.secrets["acme-batch"], 1)[0]
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded", refused.text
    memory_control.desired_replicas_set({h.pool.name: 2})
    h.server.call(h.gateway.loops.health_check())  # the replicas' /health and vLLM metrics (KV use)
    h.server.call(h.gateway.loops.store_view())  # debt, burst, quotas and in-flight as the store holds them
    return parse_exposition(scrape(h.url))


@pytest.mark.django_db
def test_every_metric_and_label_the_dashboard_reads_is_one_the_gateway_exports(
        exported: tuple[set[str], Exported]) -> None:
    families, series = exported
    found: list[str] = []
    for where, expr in queries(dashboard()):
        found.extend(f"{where}: {problem}" for problem in problems(extract(expr), families, series))
    assert not found, "\n".join(found)


@pytest.mark.django_db
def test_the_check_catches_an_unknown_metric_label_value_and_function(exported: tuple[set[str], Exported]) -> None:
    families, series = exported
    assert problems(extract("sum(rate(gateway_requests_admited_total[5m]))"), families, series) == [
        "gateway_requests_admited_total: no such metric family on /metrics"]
    assert problems(extract('sum by (tenant) (gateway_requests_rejected_total{quota="tiny"})'), families, series) == [
        "gateway_requests_rejected_total: no label 'quota' (it has ['entitlement', 'pool', 'reason', "
        "'service_class', 'tenant'])"]
    assert problems(extract('sum by (entitlement) (tokenpools_tenant_quota_used_tokens)'), families, series) == [
        "label 'entitlement' of by/on/group_left is on none of ['tokenpools_tenant_quota_used_tokens']"]
    assert problems(extract('tokenpools_tenant_quota_limit_tokens{tenant="globex"}'), families, series) == [
        "tokenpools_tenant_quota_limit_tokens: tenant='globex' never exported"]
    # A histogram is read through its series: the bare family name has none.
    assert problems(extract("gateway_ttft_seconds"), families, series) == [
        "gateway_ttft_seconds: exported without series (the test's traffic must produce some)"]
    with pytest.raises(PromQLError, match="unknown function"):
        extract("histogram_quantle(0.99, rate(gateway_ttft_seconds_bucket[5m]))")
    with pytest.raises(PromQLError, match="unbalanced parentheses"):
        extract("sum(rate(gateway_tokens_total[5m])")


def test_the_reader_finds_metrics_and_labels_inside_functions_and_label_lists() -> None:
    usage = extract('histogram_quantile(0.99, sum by (le, entitlement) (rate(gateway_ttft_seconds_bucket'
                    '{pool=~"$pool", entitlement="a"}[$__rate_interval]) * on(entitlement) group_left(tenant) '
                    'max by (entitlement, tenant) (tokenpools_entitlement_info)))')
    assert usage.metrics == {"gateway_ttft_seconds_bucket": {"pool": [], "entitlement": ["a"]},
                             "tokenpools_entitlement_info": {}}
    assert usage.grouping == {"le", "entitlement", "tenant"}
    assert extract("sum(gateway_pending_releases) > 0 and on() vector(1)").metrics == {"gateway_pending_releases": {}}


def test_the_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource_variable() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"pool", "tenant", "entitlement"} <= variables.keys()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), ids
    drawn = [p for p in board["panels"] if p["type"] != "row"]
    assert len(drawn) >= 10
    for p in drawn:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for target in p["targets"]:
            assert target["expr"].strip() and target["refId"], p["title"]
            assert target["datasource"]["uid"] == "${datasource}", p["title"]
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}"
    # The families the issue asks for are all drawn.
    exprs = " ".join(t["expr"] for p in drawn for t in p["targets"])
    for family in ("gateway_requests_admitted_total", "gateway_requests_rejected_total", "tokenpools_queue_depth",
                   "tokenpools_queue_wait_seconds_bucket", "gateway_ttft_seconds_bucket",
                   "tokenpools_entitlement_slo_ttft_seconds", "gateway_tokens_total",
                   "tokenpools_entitlement_tokens_per_second", "tokenpools_entitlement_debt",
                   "tokenpools_entitlement_burst", "tokenpools_entitlement_quota_used_tokens",
                   "tokenpools_tenant_quota_used_tokens", "flow_control_pool_budget",
                   "tokenpools_replica_kv_usage", "gateway_tier_requests_total"):
        assert family in exprs, family


def test_the_scrape_config_sends_the_metrics_token() -> None:
    text = SCRAPE_CONFIG.read_text()
    assert "metrics_path: /metrics" in text
    assert re.search(r"authorization:\s*\n\s*type: Bearer\s*\n\s*credentials_file:", text), text
