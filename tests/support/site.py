"""The real site in a subprocess (`apps.simulator.live_site`), for end-to-end tests and benchmarks."""

from __future__ import annotations

from apps.simulator.live_site import (
    REPO,
    PreparedSite,
    manage,
    prepare_site,
    running_ticks,
    server_log,
    serving,
)

__all__ = ["REPO", "PreparedSite", "manage", "prepare_site", "running_ticks", "server_log", "serving"]
