"""Reading the gateway's `/metrics` as an operator does: with the `METRICS_TOKEN` bearer (every label)."""

from __future__ import annotations

import httpx

# The token the tests' gateways are given (the `metrics_token` fixture, or METRICS_TOKEN in a site's env).
METRICS_TOKEN = "test-metrics-token"


def scrape(url: str, *, token: str = METRICS_TOKEN, timeout: float = 10) -> str:
    response = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=timeout)
    response.raise_for_status()
    return response.text
