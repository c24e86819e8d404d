"""Who may read `/metrics`, and what an anonymous reader is shown.

The gateway's metrics name entitlements and quotas (tenant-identifying), so:

- `METRICS_TOKEN` set: `Authorization: Bearer <token>` is required (401 otherwise, compared in constant
  time), and the holder sees every label.
- unset, `DEPLOYMENT=production`: refused (401) with a message saying to set `METRICS_TOKEN`; production
  never serves tenants' names to whoever can reach the port.
- unset, embedded: served, but without the labels that name a tenant's objects (`entitlement`, `quota`,
  `tenant`, which every per-entitlement series carries): counters and histograms are summed over them (by
  pool and their other labels), per-entitlement and per-tenant gauges left out; unless
  `METRICS_ANONYMOUS_LABELS=1` says the operator wants them (a private development box).

Settings are read at scrape time (a few attribute reads), so a test's `override_settings` applies.
"""

from __future__ import annotations

import hmac
from typing import Any

from django.conf import settings

from apps.gateway.errors import AUTHENTICATION, GatewayError

# Labels whose values identify a tenant or one of its objects.
TENANT_LABELS = frozenset({"entitlement", "quota", "tenant"})


def _bearer(scope: dict[str, Any]) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def metrics_hidden_labels(scope: dict[str, Any]) -> frozenset[str]:
    """The label names to hide from this reader (empty: show everything); raises a 401 `GatewayError`
    when the reader may not scrape at all."""
    token: str = settings.METRICS_TOKEN
    if token:
        given = _bearer(scope)
        # compare_digest on bytes: constant time whatever the (attacker-chosen) length and content.
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            raise GatewayError(401, "metrics_token_required", "Send Authorization: Bearer <METRICS_TOKEN>.",
                               error_type=AUTHENTICATION)
        return frozenset()
    if settings.PRODUCTION:
        raise GatewayError(401, "metrics_token_not_configured",
                           "/metrics is closed in production until METRICS_TOKEN is set on the server; "
                           "scrape it with Authorization: Bearer <METRICS_TOKEN>.", error_type=AUTHENTICATION)
    return frozenset() if settings.METRICS_ANONYMOUS_LABELS else TENANT_LABELS
