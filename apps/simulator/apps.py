from __future__ import annotations

from django.apps import AppConfig


class SimulatorConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.simulator"
    label = "simulator"
