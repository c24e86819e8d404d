from __future__ import annotations

from django.apps import AppConfig


class WorkersConfig(AppConfig):
    """Registers the workers' management commands (``engine``, ``run_ticks``)."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "workers"
    label = "workers"
