"""``python manage.py simulate ...``: the same command line as ``tokenpools-sim`` (apps.simulator.cli)."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "Simulate token-pool admission over a vLLM-like cluster in virtual time (see tokenpools-sim --help)."
    )

    def run_from_argv(self, argv: list[str]) -> None:
        # argv is [manage.py, simulate, ...]: hand the rest to the simulator's own parser, exit code and all.
        from apps.simulator.cli import main

        sys.exit(main(argv[2:]))

    def handle(self, *args: Any, **options: Any) -> None:  # pragma: no cover - call_command path
        from apps.simulator.cli import main

        code = main(list(args))
        if code:
            sys.exit(code)
