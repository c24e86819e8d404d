"""Websocket routes of the live dashboards (imported by tokenpools_site.asgi)."""

from __future__ import annotations

from django.urls import path

from apps.dashboard.consumers import EntitlementLiveConsumer, OverviewConsumer, PoolLiveConsumer

websocket_urlpatterns = [
    path("ws/overview/", OverviewConsumer.as_asgi()),
    path("ws/pools/<str:name>/", PoolLiveConsumer.as_asgi()),
    path("ws/entitlements/<str:name>/", EntitlementLiveConsumer.as_asgi()),
]
