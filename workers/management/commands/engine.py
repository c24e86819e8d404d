"""`python manage.py engine --model DIR --policy token-pd --kv-budget-mib N --port P`: serve our engine.

A thin wrapper: the engine needs no database; the command exists so operators start every process of
the project the same way.
"""

from __future__ import annotations

import argparse

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Serve the tokenpools inference engine (continuous batching + Token-PD) with vLLM's HTTP API."
    requires_system_checks: list[str] = []
    requires_migrations_checks = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from backends.engine.server import add_engine_arguments

        add_engine_arguments(parser)

    def handle(self, *args: object, **options: object) -> None:
        from backends.engine.server import serve, settings_from_arguments

        namespace = argparse.Namespace(**options)
        self.stdout.write(
            f"engine: model={namespace.model} policy={namespace.policy} "
            f"kv_budget_mib={namespace.kv_budget_mib} "
            f"listening on http://{namespace.host}:{namespace.port}"
        )
        serve(settings_from_arguments(namespace), namespace.host, namespace.port, namespace.threads)
