"""The tick services that live with the workers: each reads what it needs, calls one app service, and
returns what it did (for logs and tests). The runners (Celery, `run_ticks`, the in-process ticker) call
them through `workers.ticks.run_tick`, which adds the no-overlap and log-and-continue rules.

The control loops of the gateway's state (debt/burst EWMA, AIMD) are services of the gateway
(`apps.gateway.ticks`); what these ticks publish for the gateway (replicas' saturation inputs, desired
replicas) goes into its control state.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from apps.gateway.ticks import control_state


def tick_scrape() -> Any:
    """Scrape every replica (stored on the replica rows) and publish each pool's instance snapshots
    in the control state, where gateways read saturation without touching the ORM."""
    from apps.pools.scrape import DEFAULT_TIMEOUT_S, pools_scrape

    summaries = pools_scrape(timeout_s=float(getattr(settings, "TOKENPOOLS_SCRAPE_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    state = control_state()
    for summary in summaries:
        state.instances_set(summary.pool, summary.snapshots)
    return summaries


def tick_autoscale() -> Any:
    from apps.pools.autoscale import pools_autoscale

    state = control_state()
    decisions = pools_autoscale(observed_tokens_per_second=state.pool_demand())
    state.desired_replicas_set({pool: decision.desired for pool, decision in decisions.items()})
    return decisions


def tick_expiry() -> int:
    from apps.pools.services import entitlements_expire

    return entitlements_expire()


def tick_usage_rollup() -> int:
    from workers.rollups import usage_rollup

    return usage_rollup()


def tick_request_log() -> int:
    from django.conf import settings

    from apps.gateway.request_log import request_log_prune

    return request_log_prune(days=settings.GATEWAY_REQUEST_LOG_DAYS)
