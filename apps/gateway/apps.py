from __future__ import annotations

from django.apps import AppConfig


class GatewayConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.gateway"
    label = "gateway"

    def ready(self) -> None:
        from apps.gateway.signals import connect_signals

        connect_signals()
