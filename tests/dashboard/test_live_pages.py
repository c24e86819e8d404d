"""The live pages (server-rendered shells the JS fills) and plotly.js served from the plotly package."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import plotly
import pytest
from django.test import Client

from tests.dashboard.conftest import client_for

pytestmark = pytest.mark.django_db


def chart_ids(html: str) -> list[str]:
    return re.findall(r'id="fig-([a-z]+)"', html)


def test_live_pages_need_a_login(pool: Any, acme_entitlement: Any) -> None:
    for url in ("/pools/qwen-pool/live/", "/entitlements/acme-chat/live/"):
        response = Client().get(url)
        assert response.status_code == 302 and "/accounts/login/" in response["Location"]


def test_operator_pool_page_has_every_chart_and_the_socket(superuser: Any, pool: Any) -> None:
    response = client_for(superuser).get("/pools/qwen-pool/live/")
    html = response.content.decode()
    assert response.status_code == 200
    assert chart_ids(html) == ["admissions", "queue", "ttft", "tokens", "inflight", "wait", "debt", "aimd", "kv"]
    # Issue 28: the four an operator reads first come in their own grid, before the heading of the rest.
    primary, rest = html.split('class="live-more"')
    assert chart_ids(primary) == ["admissions", "queue", "ttft", "tokens"]
    assert 'data-ws="/ws/pools/qwen-pool/"' in html
    # Scripts come from this site only: plotly from the package, our JS from static/ (no CDN).
    scripts = re.findall(r'<script src="([^"]+)"', html)
    assert scripts == ["/vendor/plotly.min.js", "/static/js/live_socket.js", "/static/js/live.js"]


def test_tenant_member_pool_page_leaves_out_pool_wide_kv(member: Any, acme_entitlement: Any) -> None:
    html = client_for(member).get("/pools/qwen-pool/live/").content.decode()
    assert "kv" not in chart_ids(html)
    assert "Only your tenant" in html


def test_entitlement_page_is_scoped_to_its_tenant(member: Any, outsider: Any, acme_entitlement: Any) -> None:
    response = client_for(member).get("/entitlements/acme-chat/live/")
    assert response.status_code == 200
    assert 'data-ws="/ws/entitlements/acme-chat/"' in response.content.decode()
    assert client_for(outsider).get("/entitlements/acme-chat/live/").status_code == 404
    assert client_for(member).get("/pools/no-such-pool/live/").status_code == 404


def test_detail_pages_link_to_the_live_pages(member: Any, acme_entitlement: Any) -> None:
    client = client_for(member)
    assert 'href="/pools/qwen-pool/live/"' in client.get("/pools/qwen-pool/").content.decode()
    assert 'href="/entitlements/acme-chat/live/"' in client.get("/entitlements/acme-chat/").content.decode()


def test_plotly_js_is_the_package_file_and_cacheable() -> None:
    expected = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    client = Client()  # no login: a script, like the stylesheet
    response = client.get("/vendor/plotly.min.js")
    assert response.status_code == 200
    assert response.content == expected
    assert response["Content-Type"].startswith("text/javascript")
    assert "max-age=86400" in response["Cache-Control"] and "public" in response["Cache-Control"]
    again = client.get("/vendor/plotly.min.js", HTTP_IF_NONE_MATCH=response["ETag"])
    assert again.status_code == 304 and again.content == b""


def test_live_js_is_served_from_static() -> None:
    response = Client().get("/static/js/live.js")
    assert response.status_code == 200
    body = b"".join(response.streaming_content) if response.streaming else response.content
    assert b"Plotly.extendTraces" in body
