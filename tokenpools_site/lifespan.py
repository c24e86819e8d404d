"""The site's ASGI lifespan: what starts with the server and what its stop waits for.

At startup: the in-process ticker (when no Celery broker runs the ticks) and the gateway (so the first
request pays no start-up). At shutdown, after the server stopped accepting and let in-flight requests
finish for its drain timeout (`serve` gives uvicorn GATEWAY_DRAIN_TIMEOUT_S): the gateway releases what
is still held, cancels what still runs, flushes usage and closes its store; then the ticker stops.
"""

from __future__ import annotations

import gc
import logging
import sys
from typing import Any

from apps.gateway.asgi import gateway_application
from workers.ticks import start_in_process_ticker, stop_in_process_ticker

logger = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.001


def freeze_startup_heap() -> None:
    """Move everything alive after start-up (Django, the apps, the first snapshot) out of the collector's reach.

    A full (generation 2) collection scans every tracked object, and a started site holds a few hundred
    thousand: each one stopped the event loop for 50-80 ms, every request waiting behind it (most of the
    gateway's added p99 under paced load). Frozen objects are still freed by reference counting; only cycles
    among them are never collected, and start-up leaves none worth the scan."""
    gc.collect()
    gc.freeze()


def favour_the_event_loop() -> None:
    """Threads of this process (the in-process ticker, the database writes of usage and the request log) hold the
    interpreter's lock up to the switch interval before the event loop gets it back: 5 ms by default, paid by
    every request that arrives meanwhile. 1 ms bounds that wait; a switch costs microseconds, and only while a
    thread is busy."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


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
                favour_the_event_loop()
                freeze_startup_heap()
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
