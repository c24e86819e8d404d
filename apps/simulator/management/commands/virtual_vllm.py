"""``python manage.py virtual_vllm --port P --max-num-seqs N ...``: the virtual vLLM server
(backends.virtual_vllm), vLLM's OpenAI API and metrics timed by the simulator's instance model."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Serve vLLM's OpenAI API and /metrics from the simulator's instance model, in real time."

    def add_arguments(self, parser) -> None:  # type: ignore[no-untyped-def]
        from backends.virtual_vllm.cli import add_arguments

        add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        import argparse

        from backends.virtual_vllm.cli import banner, config_from_args, serve

        namespace = argparse.Namespace(**options)
        try:
            config = config_from_args(namespace)
        except ValueError as error:
            # Bad flags exit 2 with the problem named, like every other command of the simulator.
            self.stderr.write(f"virtual_vllm: error: {error}")
            sys.exit(2)
        self.stdout.write(banner(config, options["host"], options["port"]))
        serve(config, options["host"], options["port"], options["log_level"])
