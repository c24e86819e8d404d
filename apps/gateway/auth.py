"""The authenticate step: the bearer key to its entitlement, through the cached snapshot (one SHA-256
and one dict lookup; no database). Who the tenant is comes from the key alone: nothing a client sends
names its tenant or raises its priority."""

from __future__ import annotations

from apps.gateway.context import RequestContext
from apps.gateway.errors import invalid_api_key
from apps.gateway.snapshot import KeyEntry, Snapshot


def authenticate(ctx: RequestContext, snapshot: Snapshot, now_epoch: float) -> KeyEntry:
    header = ctx.header(b"authorization")
    if not header or header[:7].lower() != "bearer ":
        raise invalid_api_key("You did not provide an API key (Authorization: Bearer <key>).")
    entry = snapshot.key_for(header[7:].strip(), now_epoch)
    if entry is None:
        raise invalid_api_key()
    ctx.entry = entry
    return entry
