"""The site's ASGI entry point sends `/v1/*` and `/metrics` to the gateway and the rest to Django."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from apps.gateway.asgi import gateway_application, is_gateway_path


@pytest.mark.parametrize(
    ("path", "gateway"),
    [("/v1/chat/completions", True), ("/v1/models", True), ("/metrics", True), ("/api/v1/pools/", False),
     ("/", False), ("/v1", True), ("/metricsx", False), ("/healthz", True), ("/readyz", True), ("/health", True),
     ("/healthzx", False)],
)
def test_paths_are_split_by_prefix(path: str, gateway: bool) -> None:
    assert is_gateway_path(path) is gateway


@pytest.mark.django_db(transaction=True)
def test_site_application_routes_to_both() -> None:
    from tokenpools_site.asgi import application

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            try:
                models = await client.get("/v1/models")
                api = await client.get("/api/v1/pools/")
            finally:
                await gateway_application().stop()
        return models, api

    models, api = asyncio.run(scenario())
    assert models.status_code == 401
    assert models.json()["error"]["code"] == "invalid_api_key"
    assert "x-request-id" in models.headers
    assert api.status_code in (401, 403)
    assert "x-request-id" not in api.headers
