"""Tenants in manifests, quotas and pool prices: every example applies on a fresh database, documents in any
order, members naming existing users, owners limited to members, bad quotas named by document and field
with nothing written; the same rules as field errors on the REST API; usage summarised with its spend."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from apps.gateway.models import UsageRecord
from apps.pools.manifests import (
    API_VERSION,
    ManifestError,
    manifests_apply,
    manifests_export,
    manifests_parse,
)
from apps.pools.models import TokenEntitlement, TokenPool
from apps.tenancy.models import Membership, Tenant
from apps.tenancy.services import SYSTEM
from tests.pools.test_api_isolation import client_as

EXAMPLES = Path(settings.BASE_DIR) / "examples"


def _manifest_files() -> list[Path]:
    """The example files that are manifests (the load generator's scenario is not)."""
    return [p for p in sorted(EXAMPLES.glob("*.yaml"))
            if all(isinstance(d, dict) and d.get("apiVersion") == API_VERSION
                   for d in yaml.safe_load_all(p.read_text()) if d is not None)]


@pytest.mark.django_db
@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: p.name)
def test_every_example_applies_on_a_fresh_database(path: Path) -> None:
    assert not Tenant.objects.exists()
    result = manifests_apply(actor=SYSTEM, documents=path.read_text())
    assert result.count("created") == len(result.documents) > 0
    assert manifests_apply(actor=SYSTEM, documents=path.read_text()).count("unchanged") == len(result.documents)


def test_the_examples_include_the_readme_manifest() -> None:
    assert {"qwen3-8b.yaml", "demo.yaml"} <= {p.name for p in _manifest_files()}


def _docs(*, quota: dict[str, Any] | None = None, pricing: dict[str, Any] | None = None,
          tenant_quota: dict[str, Any] | None = None, members: list[dict[str, str]] | None = None) -> list[Any]:
    """Entitlement first, pool last: apply puts them in order."""
    docs = [d for d in manifests_parse((EXAMPLES / "qwen3-8b.yaml").read_text())]
    tenant, pool, ent = docs
    pool["spec"].pop("pricing")
    ent["spec"].pop("quota")
    tenant["spec"].pop("quota")  # the example's money quota needs the prices popped above
    if pricing is not None:
        pool["spec"]["pricing"] = pricing
    if quota is not None:
        ent["spec"]["quota"] = quota
    if tenant_quota is not None:
        tenant["spec"]["quota"] = tenant_quota
    if members is not None:
        tenant["spec"]["members"] = members
    return [ent, tenant, pool]


@pytest.mark.django_db
def test_tenants_members_and_quotas_apply_in_any_order_and_export() -> None:
    users = get_user_model().objects
    alice = users.create_user("alice")
    users.create_user("bob")
    docs = _docs(pricing={"inputPerMillion": 0.5, "outputPerMillion": 1.5, "currency": "EUR"},
                 quota={"amount": 12.5, "currency": "EUR", "window": "month", "timezone": "Europe/Paris"},
                 tenant_quota={"tokens": 1000000, "window": "day"},
                 members=[{"user": "alice", "role": "owner"}, {"user": "bob"}])
    result = manifests_apply(actor=SYSTEM, documents=docs)
    assert [(d.kind, d.action) for d in result.documents] == [
        ("TokenEntitlement", "created"), ("Tenant", "created"), ("TokenPool", "created")]
    tenant = Tenant.objects.get(slug="acme")
    assert (tenant.name, tenant.quota_tokens, tenant.quota_window) == ("Acme Corp", 1000000, "day")
    assert set(Membership.objects.values_list("user__username", "role")) == {("alice", "owner"), ("bob", "member")}
    ent = TokenEntitlement.objects.get()
    assert (ent.quota_amount, ent.quota_currency, ent.quota_timezone) == (Decimal("12.5"), "EUR", "Europe/Paris")
    assert TokenPool.objects.get().price_output_per_million == Decimal("1.5")
    exported = manifests_export(user=SYSTEM)
    assert manifests_apply(actor=SYSTEM, documents=exported).count("unchanged") == 3
    # The member list is declarative: bob goes, alice stays owner.
    docs[1]["spec"]["members"] = [{"user": "alice", "role": "owner"}]
    assert manifests_apply(actor=SYSTEM, documents=docs).count("updated") == 1
    assert list(Membership.objects.values_list("user__username", flat=True)) == ["alice"]
    # An owner may change members but not the quota.
    docs[1]["spec"]["members"] = [{"user": "alice", "role": "owner"}, {"user": "bob", "role": "member"}]
    manifests_apply(actor=alice, documents=[docs[1]])
    assert Membership.objects.count() == 2
    docs[1]["spec"]["quota"] = {"tokens": 5, "window": "day"}
    with pytest.raises(ManifestError, match="only platform operators") as caught:
        manifests_apply(actor=alice, documents=[docs[1]])
    assert caught.value.forbidden
    assert Tenant.objects.get().quota_tokens == 1000000


@pytest.mark.django_db
@pytest.mark.parametrize(("change", "field", "message"), [
    ({"quota": {"tokens": -5, "window": "day"}}, "spec.quota.tokens", "must be positive"),
    ({"quota": {"tokens": 5, "window": "fortnight"}}, "spec.quota.window", "unknown window 'fortnight'"),
    ({"quota": {"tokens": 5}}, "spec.quota.window", "is required"),
    ({"quota": {"amount": 5, "currency": "USD", "window": "day"}}, "spec.quota", "pool 'qwen3-8b' has no prices"),
    ({"quota": {"amount": 5, "currency": "usd", "window": "day"},
      "pricing": {"inputPerMillion": 1, "outputPerMillion": 2, "currency": "USD"}}, "spec.quota.currency",
     "three capital letters"),
    ({"quota": {"tokens": 5, "window": "day", "timezone": "Mars/Olympus"}}, "spec.quota.timezone",
     "unknown timezone"),
    ({"tenant_quota": {"amount": 5, "currency": "EUR", "window": "month"},
      "pricing": {"inputPerMillion": 1, "outputPerMillion": 2, "currency": "USD"}}, "spec.poolRef.name",
     "priced in USD"),
    ({"members": [{"user": "nobody", "role": "owner"}]}, "spec.members[0].user", "unknown user 'nobody'"),
    ({"pricing": {"inputPerMillion": -1, "outputPerMillion": 2, "currency": "USD"}}, "spec.pricing.inputPerMillion",
     "zero or more"),
])
def test_bad_quotas_name_the_document_and_field_and_write_nothing(change: dict[str, Any], field: str,
                                                                  message: str) -> None:
    with pytest.raises(ManifestError) as caught:
        manifests_apply(actor=SYSTEM, documents=_docs(**change))
    assert any(issue.field == field and message in issue.message for issue in caught.value.issues), [
        str(i) for i in caught.value.issues]
    assert not (Tenant.objects.exists() or TokenPool.objects.exists() or TokenEntitlement.objects.exists())


@pytest.mark.api
@pytest.mark.django_db
def test_rest_quota_fields_and_errors(admin: Any) -> None:
    manifests_apply(actor=SYSTEM, documents=_docs())
    client = client_as(admin)
    url = "/api/v1/entitlements/sample-entitlement/"
    for body, field in (({"quota_tokens": -1, "quota_window": "day"}, "quota_tokens"),
                        ({"quota_tokens": 10, "quota_window": "week"}, "quota_window"),
                        ({"quota_amount": "5", "quota_currency": "USD", "quota_window": "day"}, "quota_amount"),
                        ({"quota_tokens": 10}, "quota_window")):
        response = client.patch(url, body, format="json")
        assert response.status_code == 400, (body, response.json())
        assert field in response.json(), (body, response.json())
    ok = client.patch(url, {"quota_tokens": 10, "quota_window": "day"}, format="json")
    assert ok.status_code == 200 and ok.json()["quota_tokens"] == 10
    bad_tenant = client.patch("/api/v1/tenants/acme/", {"quota_amount": "5", "quota_currency": "USD",
                                                         "quota_window": "month"}, format="json")
    assert bad_tenant.status_code == 400 and "quota_currency" in bad_tenant.json()
    priced = client.patch("/api/v1/pools/qwen3-8b/", {"price_input_per_million": "0.5",
                                                       "price_output_per_million": "2", "price_currency": "USD"},
                          format="json")
    assert priced.status_code == 200, priced.json()
    assert client.patch("/api/v1/tenants/acme/", {"quota_amount": "5", "quota_currency": "USD",
                                                  "quota_window": "month"}, format="json").status_code == 200
    # Prices a money quota relies on cannot be dropped.
    dropped = client.patch("/api/v1/pools/qwen3-8b/", {"price_input_per_million": None,
                                                       "price_output_per_million": None, "price_currency": ""},
                           format="json")
    assert dropped.status_code == 400 and "price_currency" in dropped.json()


@pytest.mark.api
@pytest.mark.django_db
def test_usage_summary_reports_spend_per_day_and_month(admin: Any) -> None:
    docs = _docs(pricing={"inputPerMillion": 0.5, "outputPerMillion": 2, "currency": "USD"})
    manifests_apply(actor=SYSTEM, documents=docs)
    tenant = Tenant.objects.get()
    minute = timezone.now().replace(day=15, hour=12, minute=0, second=0, microsecond=0)  # a month away from its turn
    for offset, (prompt, completion) in enumerate(((1_000_000, 500_000), (2_000_000, 0))):
        UsageRecord.objects.create(tenant=tenant, entitlement="sample-entitlement",
                                   minute=minute - timezone.timedelta(minutes=offset), requests=3,
                                   prompt_tokens=prompt, completion_tokens=completion)
    client = client_as(admin)
    month = client.get("/api/v1/usage/summary/?period=month").json()
    assert len(month) == 1
    # 3M prompt tokens at 0.5/M + 0.5M output tokens at 2/M
    assert month[0]["spend"] == {"amount": "2.500000", "currency": "USD"}
    assert (month[0]["prompt_tokens"], month[0]["requests"]) == (3_000_000, 6)
    assert client.get("/api/v1/usage/summary/?period=week").status_code == 400


@pytest.mark.api
@pytest.mark.django_db
def test_quota_status_on_rest_and_pages(admin: Any) -> None:
    """Used (the usage records of the current window), remaining and reset of an entitlement's and a tenant's
    quota: on the REST API and, with a bar, on their pages."""
    docs = _docs(quota={"tokens": 1000, "window": "day"},
                 pricing={"inputPerMillion": 100_000, "outputPerMillion": 200_000, "currency": "USD"},
                 tenant_quota={"amount": 10, "currency": "USD", "window": "month"})
    manifests_apply(actor=SYSTEM, documents=docs)
    tenant = Tenant.objects.get()
    now = timezone.now().replace(second=0, microsecond=0)
    UsageRecord.objects.create(tenant=tenant, entitlement="sample-entitlement", minute=now, requests=2,
                               prompt_tokens=30, completion_tokens=10)
    UsageRecord.objects.create(tenant=tenant, entitlement="sample-entitlement", minute=now - timezone.timedelta(days=40),
                               requests=1, prompt_tokens=900, completion_tokens=0)  # an older window: not counted
    client = client_as(admin)
    ent = client.get("/api/v1/entitlements/sample-entitlement/").json()["quota_status"]
    assert (ent["unit"], ent["limit"], ent["used"], ent["remaining"], ent["used_percent"]) == ("tokens", 1000, 40,
                                                                                               960, 4.0)
    reset = timezone.datetime.fromisoformat(ent["resets_at"].replace("Z", "+00:00"))
    assert reset.hour == 0 and 0 < (reset - timezone.now()).total_seconds() <= 86400
    # The tenant's money quota: 30 prompt tokens at 0.1 USD each and 10 completion tokens at 0.2 USD each.
    shared = client.get("/api/v1/tenants/acme/").json()["quota_status"]
    assert (shared["unit"], shared["limit"], shared["used"], shared["remaining"]) == ("USD", 10, 5, 5)
    assert shared["window_id"] == timezone.now().strftime("%Y-%m")
    browser = Client()
    browser.force_login(admin)
    page = browser.get("/entitlements/sample-entitlement/").content.decode()
    assert 'data-dimension="quota"' in page and "960 tokens remaining" in page and "width: 4.0%" in page
    tenant_page = browser.get("/tenants/acme/").content.decode()
    assert "5 USD remaining" in tenant_page and "width: 50.0%" in tenant_page
    # No quota: null on the API, said so on the page.
    client.patch("/api/v1/entitlements/sample-entitlement/", {"quota_tokens": None, "quota_window": ""},
                 format="json")
    assert client.get("/api/v1/entitlements/sample-entitlement/").json()["quota_status"] is None
    assert "No quota" in browser.get("/entitlements/sample-entitlement/").content.decode()
