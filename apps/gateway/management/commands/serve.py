"""``python manage.py serve --host H --port P``: the ASGI site (UI, REST API, gateway, websockets)."""

from __future__ import annotations

import math

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Serve the tokenpools ASGI application with uvicorn."

    def add_arguments(self, parser) -> None:  # type: ignore[no-untyped-def]
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (needs REDIS_URL above 1)")
        parser.add_argument("--log-level", default="info")

    def handle(self, *args, **options) -> None:  # type: ignore[no-untyped-def]
        import uvicorn
        from django.conf import settings

        port = options["port"]
        if not 0 < port < 65536:
            raise CommandError(f"--port must be between 1 and 65535, got {port}")
        if options["workers"] > 1 and not settings.REDIS_URL:
            # Limits live in each process's memory without Redis: several processes would each enforce them.
            raise CommandError("--workers above 1 needs REDIS_URL so that every process enforces one set of limits")
        from apps.gateway.config import GatewayConfig
        from apps.gateway.http_guard import GuardedHttpToolsProtocol

        drain_s = GatewayConfig.from_settings().drain_timeout_s
        self.stdout.write(f"tokenpools serving on http://{options['host']}:{port}/")
        # On SIGTERM uvicorn stops accepting, lets in-flight requests finish for `drain_s`, cancels the rest,
        # then runs the lifespan shutdown (tokenpools_site.lifespan): releases, usage flush, store closed.
        uvicorn.run(
            "tokenpools_site.asgi:application",
            host=options["host"],
            port=port,
            workers=options["workers"],
            log_level=options["log_level"],
            lifespan="on",
            timeout_graceful_shutdown=max(1, math.ceil(drain_s)),
            # Idle and slow connections are closed: after a response (keep-alive), and before a request's
            # headers are complete (SERVER_HEADER_TIMEOUT_S, apps/gateway/http_guard.py).
            http=GuardedHttpToolsProtocol,
            timeout_keep_alive=settings.SERVER_KEEPALIVE_TIMEOUT_S,
        )
