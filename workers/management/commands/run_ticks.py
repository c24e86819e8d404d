"""`python manage.py run_ticks`: the periodic ticks as a standalone loop (no broker needed)."""

from __future__ import annotations

import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workers.ticks import Ticker, run_tick, tick_specs


class Command(BaseCommand):
    help = "Run the control-plane ticks (EWMA, AIMD, scrape, autoscale, expiry, usage rollup) in a loop."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("ticks", nargs="*", help="only these ticks (default: all)")
        parser.add_argument("--once", action="store_true", help="run each tick once and exit")
        parser.add_argument("--list", dest="list_ticks", action="store_true", help="list the ticks and their periods")

    def handle(self, *args: Any, ticks: list[str], once: bool, list_ticks: bool, **options: Any) -> None:
        try:
            specs = tick_specs(ticks or None)
        except (KeyError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        if list_ticks:
            for spec in specs.values():
                self.stdout.write(f"{spec.name:14} every {spec.period_s:g}s  {spec.description}")
            return
        if once:
            failed = [name for name in specs if run_tick(name).value == "failed"]
            for name in specs:
                self.stdout.write(f"{name}: {'failed' if name in failed else 'ran'}")
            if failed:
                raise CommandError(f"failed ticks: {', '.join(failed)}")
            return
        ticker = Ticker(specs)

        def _stop(signum: int, frame: Any) -> None:
            ticker.stop(wait=False)

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        self.stdout.write("running ticks: " + ", ".join(f"{s.name} every {s.period_s:g}s" for s in specs.values()))
        ticker.run_forever()
