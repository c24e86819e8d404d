"""``python manage.py virtual_vllm --port P --max-num-seqs N ...``: the virtual vLLM server
(apps.simulator.vllm_server), vLLM's OpenAI API and metrics timed by the simulator's instance model."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Serve vLLM's OpenAI API and /metrics from the simulator's instance model, in real time."

    def add_arguments(self, parser) -> None:  # type: ignore[no-untyped-def]
        from apps.simulator.vllm_server import add_arguments

        add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        import argparse

        from apps.simulator.simulation import build_latency
        from apps.simulator.vllm_server import config_from_args, serve

        namespace = argparse.Namespace(**options)
        try:
            config = config_from_args(namespace)
            build_latency(config.sim)
        except ValueError as error:
            # Bad flags exit 2 with the problem named, like every other command of the simulator.
            self.stderr.write(f"virtual_vllm: error: {error}")
            sys.exit(2)
        self.stdout.write(
            f"virtual vLLM ({config.model}, {config.sim.max_num_seqs} slots) on "
            f"http://{options['host']}:{options['port']}/"
        )
        serve(config, options["host"], options["port"], options["log_level"])
