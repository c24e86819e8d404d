"""ASGI entry point: `/v1/*` and `/metrics` to the gateway's raw ASGI app, other HTTP through Django,
websockets through Channels."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokenpools_site.settings")

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs the app registry ready)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402


def _websocket_routes() -> list:
    try:
        from apps.dashboard.routing import websocket_urlpatterns
    except ImportError:  # the dashboard's consumers arrive with the live-dashboard issue
        return []
    return list(websocket_urlpatterns)


site_application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(_websocket_routes()))),
    }
)

from apps.gateway.asgi import dispatch  # noqa: E402  (needs the app registry ready)
from tokenpools_site.lifespan import with_lifespan  # noqa: E402

# The gateway path skips Django's request handling entirely (ARCHITECTURE.md: no ORM per request).
# The lifespan starts the gateway (and the periodic ticks when no Celery broker runs them) and stops it
# cleanly: in-flight requests drain, nothing held stays held, usage is flushed.
application = with_lifespan(dispatch(site_application))
