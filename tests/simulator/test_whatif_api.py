"""POST /api/v1/pools/NAME/whatif/ (issue 26): the replay of `manage.py replay` over REST, for operators and the
owners of the pool's tenants (an owner sees its own tenants' rows and the pool's totals), with the proposed
manifest validated as apply validates it for the user asking, and never persisted."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from apps.pools.models import TokenEntitlement
from tests.pools.factories import acme, admin, globex, make_entitlement, make_pool, member, outsider, owner  # noqa: F401
from tests.simulator.test_replay import PROPOSED_ACME_CHAT as PROPOSED
from tests.simulator.test_replay import SINCE, UNTIL, record_two_tenants

pytestmark = [pytest.mark.api, pytest.mark.django_db]

URL = "/api/v1/pools/qwen3-8b/whatif/"


@pytest.fixture
def shared_pool(admin: Any, acme: Any, globex: Any) -> None:  # noqa: F811
    pool = make_pool(admin)
    make_entitlement(admin, acme, pool, "acme-chat", concurrency=2, queue_max=0, slo_target_ms=2000)
    make_entitlement(admin, globex, pool, "globex-chat", concurrency=2, queue_max=0, slo_target_ms=2000)
    record_two_tenants(acme.pk, globex.pk)


def _post(user: Any, body: dict[str, Any]) -> Any:
    client = APIClient()
    client.force_authenticate(user)
    return client.post(URL, body, format="json")


def test_operator_sees_every_row_and_the_proposal_refuses_more(shared_pool: None, admin: Any) -> None:  # noqa: F811
    response = _post(admin, {"since": SINCE, "until": UNTIL, "manifest": PROPOSED})
    assert response.status_code == 200, response.content
    report = response.json()
    assert set(report["entitlements"]) == {"acme-chat", "globex-chat"}
    acme_row = report["entitlements"]["acme-chat"]
    assert acme_row["recorded"]["admitted"] == acme_row["current"]["admitted"] == 40, (acme_row, report["entitlements"]["globex-chat"])
    assert acme_row["proposed"]["rejected"] > acme_row["current"]["rejected"]
    assert report["pools"]["qwen3-8b"]["recorded"]["offered"] == 120
    assert TokenEntitlement.objects.get(name="acme-chat").concurrency == 2


def test_an_owner_sees_its_own_rows_and_the_pool_totals(shared_pool: None, owner: Any) -> None:  # noqa: F811
    response = _post(owner, {"since": SINCE, "until": UNTIL, "manifest": PROPOSED})
    assert response.status_code == 200, response.content
    report = response.json()
    assert set(report["entitlements"]) == {"acme-chat"}
    assert report["pools"]["qwen3-8b"]["current"]["offered"] == 120  # globex's traffic is in the pool's totals
    assert not any("globex" in caveat for caveat in report["caveats"])


def test_members_and_outsiders_may_not_run_it(shared_pool: None, member: Any, outsider: Any,  # noqa: F811
                                              admin: Any) -> None:  # noqa: F811
    assert _post(member, {"since": SINCE, "until": UNTIL}).status_code == 403
    TokenEntitlement.objects.filter(name="globex-chat").delete()  # the outsider's tenant leaves the pool
    assert _post(outsider, {"since": SINCE, "until": UNTIL}).status_code == 403
    client = APIClient()
    client.force_authenticate(admin)
    assert client.post("/api/v1/pools/nope/whatif/", {"since": "1h"}, format="json").status_code == 404


def test_an_owner_may_not_propose_another_tenants_change(shared_pool: None, owner: Any) -> None:  # noqa: F811
    other = PROPOSED.replace("acme-chat", "globex-chat").replace("tenantId: acme", "tenantId: globex")
    response = _post(owner, {"since": SINCE, "until": UNTIL, "manifest": other})
    assert response.status_code == 400  # globex is invisible to acme's owner: an unknown tenant, as apply says
    assert response.json()["errors"][0]["field"] == "spec.tenantId"


def test_bad_input_is_answered_with_field_errors(shared_pool: None, admin: Any) -> None:  # noqa: F811
    response = _post(admin, {"since": SINCE, "until": UNTIL, "manifest": PROPOSED.replace("concurrency: 1",
                                                                                          "concurrency: -1")})
    assert response.status_code == 400
    error = response.json()["errors"][0]
    assert (error["kind"], error["name"], error["field"]) == ("TokenEntitlement", "acme-chat",
                                                               "spec.resources.concurrency")
    response = _post(admin, {"since": "yesterday"})
    assert response.status_code == 400 and "since" in response.json()
    response = _post(admin, {"since": "2026-11-20T00:00:00Z", "until": "2026-11-21T00:00:00Z"})
    assert response.status_code == 400 and "no requests recorded" in response.json()["since"][0]


def test_a_window_too_large_for_a_web_request_is_a_field_error(shared_pool: None, admin: Any,  # noqa: F811
                                                               settings: Any) -> None:
    settings.WHATIF_MAX_RECORDS = 100  # the window holds 120
    response = _post(admin, {"since": SINCE, "until": UNTIL})
    assert response.status_code == 400, response.content
    assert "120 recorded requests" in response.json()["since"][0]
    assert "WHATIF_MAX_RECORDS" in response.json()["since"][0]
