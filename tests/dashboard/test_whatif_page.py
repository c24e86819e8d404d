"""The "What if" page of a pool (issue 26): the form, the report's table, the Plotly figures (admitted and refused
per entitlement side by side for recorded / current / proposed; TTFT distributions), the same rights as the REST
endpoint (operators; owners of the pool's tenants, who see their own rows), apply's errors for a bad manifest."""

from __future__ import annotations

import json
from typing import Any

import pytest

from apps.dashboard.whatif import outcome_figure, ttft_figure
from apps.pools.models import TokenEntitlement
from tests.dashboard.conftest import client_for, create_entitlement, create_pool
from tests.simulator.test_replay import PROPOSED_ACME_CHAT as PROPOSED
from tests.simulator.test_replay import SINCE, UNTIL, record_two_tenants

pytestmark = pytest.mark.django_db



@pytest.fixture
def recorded(superuser: Any, acme: Any, globex: Any) -> None:
    pool = create_pool(superuser, name="qwen3-8b")
    for tenant, name in ((acme, "acme-chat"), (globex, "globex-chat")):
        create_entitlement(superuser, tenant, pool, name, concurrency=2, queue_max=0, slo_target_ms=2000,
                           tokens_per_second=100, kv_cache_gib=2, service_class="guaranteed")
    record_two_tenants(acme.pk, globex.pk)


def test_an_owner_replays_a_proposal_and_sees_its_rows_and_charts(recorded: None, owner: Any) -> None:
    page = client_for(owner).post("/pools/qwen3-8b/whatif/", {"since": SINCE, "until": UNTIL, "manifest": PROPOSED})
    assert page.status_code == 200, page.content.decode()[:2000]
    html = page.content.decode()
    assert 'data-entitlement="acme-chat" data-column="proposed"' in html and "globex-chat" not in html
    outcomes = json.loads(page.context["outcome_json"])
    names = {trace["name"] for trace in outcomes["data"]}
    assert {"recorded: admitted", "current: refused", "proposed: refused"} <= names
    proposed = next(t for t in outcomes["data"] if t["name"] == "proposed: refused")
    current = next(t for t in outcomes["data"] if t["name"] == "current: refused")
    assert proposed["x"] == ["acme-chat"] and proposed["y"][0] > current["y"][0]
    ttft = json.loads(page.context["ttft_json"])
    assert [trace["name"] for trace in ttft["data"]] == ["recorded", "current", "proposed"]
    assert TokenEntitlement.objects.get(name="acme-chat").concurrency == 2


def test_a_bad_manifest_shows_applys_errors(recorded: None, superuser: Any) -> None:
    page = client_for(superuser).post("/pools/qwen3-8b/whatif/", {
        "since": SINCE, "until": UNTIL, "manifest": PROPOSED.replace("concurrency: 1", "concurrency: -1")})
    assert page.status_code == 400
    assert "spec.resources.concurrency" in page.content.decode()
    page = client_for(superuser).post("/pools/qwen3-8b/whatif/", {"since": "yesterday"})
    assert page.status_code == 400 and "--since: expected a duration" in page.content.decode()


def test_who_may_open_it(recorded: None, member: Any, superuser: Any) -> None:
    assert client_for(member).get("/pools/qwen3-8b/whatif/").status_code == 403
    assert client_for(superuser).get("/pools/qwen3-8b/whatif/").status_code == 200
    assert 'href="/pools/qwen3-8b/whatif/"' in client_for(superuser).get("/pools/qwen3-8b/").content.decode()


def test_figures_leave_out_columns_the_report_has_not() -> None:
    column = {"offered": 3, "admitted": 2, "rejected": 1, "rejected_by_reason": {"x": 1}}
    report = {"entitlements": {"a": {"recorded": column, "current": column}},
              "ttft_s": {"a": {"recorded": [0.1], "current": []}}}
    assert [t["name"] for t in outcome_figure(report)["data"]] == [
        "recorded: admitted", "recorded: refused", "current: admitted", "current: refused"]
    assert [t["name"] for t in ttft_figure(report)["data"]] == ["recorded"]
