"""The usage page: each user sees their tenants' tokens and spend per month and a daily chart, nothing of
other tenants; spend is priced at the pool's prices."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.gateway.models import UsageRecord
from apps.pools.services import pool_update
from tests.dashboard.conftest import create_entitlement


@pytest.mark.django_db
def test_usage_page_shows_own_tenants_spend(superuser: Any, acme: Any, globex: Any, owner: Any, pool: Any) -> None:
    pool_update(actor=superuser, pool=pool, price_input_per_million=Decimal("1"),
                price_output_per_million=Decimal("4"), price_currency="USD")
    create_entitlement(superuser, acme, pool, "acme-chat")
    create_entitlement(superuser, globex, pool, "globex-chat")
    minute = timezone.now().replace(second=0, microsecond=0)
    UsageRecord.objects.create(tenant=acme, entitlement="acme-chat", minute=minute, requests=2,
                               prompt_tokens=500_000, completion_tokens=250_000)
    UsageRecord.objects.create(tenant=globex, entitlement="globex-chat", minute=minute, requests=9,
                               prompt_tokens=7, completion_tokens=7)
    client = Client()
    client.force_login(owner)
    page = client.get("/usage/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "acme-chat" in html and "globex-chat" not in html
    assert "1.500000 USD" in html  # 0.5M x 1 + 0.25M x 4 per million
    figure = json.loads(page.context["figure_json"])
    assert [trace["name"] for trace in figure["data"]] == ["acme/acme-chat"]
    assert figure["data"][0]["y"] == [1.5]
    assert Client().get("/usage/").status_code == 302  # login required
