"""The gateway ASGI application (`/v1/*`, `/metrics`) and the path dispatcher the site uses.

`gateway_application()` builds the process-wide `Gateway` on first use; `dispatch(django_app)`
returns an ASGI app that sends `/v1/`, `/metrics` and the health probes' HTTP traffic to the gateway and
everything else (pages, the REST API, websockets, lifespan) to the site's own router.
"""

from __future__ import annotations

from typing import Any

from apps.gateway.app import Gateway
from apps.gateway.health import HEALTH_PATHS  # /healthz, /readyz, /health: probes answered by the gateway

_gateway: Gateway | None = None


def gateway_application() -> Gateway:
    global _gateway
    if _gateway is None:
        _gateway = Gateway()
    return _gateway


def is_gateway_path(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1" or path == "/metrics" or path in HEALTH_PATHS


def dispatch(site_app: Any) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and is_gateway_path(scope["path"]):
            await gateway_application()(scope, receive, send)
        else:
            await site_app(scope, receive, send)

    return app
