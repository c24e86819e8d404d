"""The site's ASGI lifespan: what starts with the server and what its stop waits for.

At startup: the in-process ticker (when no Celery broker runs the ticks) and the gateway (so the first
request pays no start-up). At shutdown, after the server stopped accepting and let in-flight requests
finish for its drain timeout (`serve` gives uvicorn GATEWAY_DRAIN_TIMEOUT_S): the gateway releases what
is still held, cancels what still runs, flushes usage and closes its store; then the ticker stops.
"""

from __future__ import annotations

import logging
from typing import Any

from apps.gateway.asgi import gateway_application
from workers.ticks import start_in_process_ticker, stop_in_process_ticker

logger = logging.getLogger(__name__)


def with_lifespan(app: Any) -> Any:
    """Wrap the site's ASGI app: the lifespan is answered here (the site's router does not speak it),
    every other scope goes to `app` untouched."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    # The gateway's own services: the ticks that need its in-process store reach it through them.
                    start_in_process_ticker(services=gateway_application().loops.tick_services())
                except Exception as exc:
                    logger.exception("in-process ticker did not start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                try:
                    await gateway_application().start()
                except Exception:  # the database may not be migrated yet: the first request retries
                    logger.exception("the gateway did not start; the first request will try again")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await gateway_application().stop()
                except Exception:
                    logger.exception("gateway stop failed")
                stop_in_process_ticker()
                await send({"type": "lifespan.shutdown.complete"})
                return

    return wrapped
