"""``python manage.py loadgen --scenario FILE [--url U] [--duration S] [--seed N]``: real HTTP traffic
through the gateway from a scenario file (apps.simulator.loadgen)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Send a scenario's requests (per-key rates, lengths, phases) to the gateway; summary at the end."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--scenario", required=True, help="YAML scenario (see examples/loadgen/demo.yaml)")
        parser.add_argument("--url", default="http://127.0.0.1:8000", help="the site's base URL")
        parser.add_argument("--duration", type=float, default=None, help="seconds (default: the scenario's)")
        parser.add_argument("--seed", type=int, default=None, help="arrival seed (default: the scenario's)")
        parser.add_argument("--keys-file", default=settings.TOKENPOOLS_DEMO_KEYS,
                            help="JSON written by `seed_demo --write-keys`, for keys given as entitlement:NAME")
        parser.add_argument("--repeat", action="store_true",
                            help="start the scenario over when it ends, until stopped (the demo's traffic)")

    def handle(self, *args: Any, **options: Any) -> None:
        import logging

        from apps.simulator.loadgen import main

        # httpx logs every request at INFO, which would drown the one progress line a second.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        # Django colours all of stderr as errors on a terminal; the progress lines are not errors.
        self.stderr.style_func = None
        code = main(
            scenario_path=Path(options["scenario"]), url=options["url"], duration=options["duration"],
            seed=options["seed"], keys_file=Path(options["keys_file"]), repeat=options["repeat"],
            stdout=self.stdout, stderr=self.stderr,
        )
        if code:
            sys.exit(code)
