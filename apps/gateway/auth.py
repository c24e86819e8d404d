"""The authenticate step: the bearer key to its entitlement, through the cached snapshot (one SHA-256
and one dict lookup; no database), and the model asked for to the key's pool. Who the tenant is comes from
the key alone: nothing a client sends names its tenant or raises its priority."""

from __future__ import annotations

from apps.gateway.context import RequestContext
from apps.gateway.errors import invalid_api_key, model_not_found
from apps.gateway.snapshot import KeyEntry, PoolInfo, Snapshot


def authenticate(ctx: RequestContext, snapshot: Snapshot, now_epoch: float) -> KeyEntry:
    header = ctx.header(b"authorization")
    if not header or header[:7].lower() != "bearer ":
        raise invalid_api_key("You did not provide an API key (Authorization: Bearer <key>).")
    entry = snapshot.key_for(header[7:].strip(), now_epoch)
    if entry is None:
        raise invalid_api_key()
    ctx.entry = entry
    return entry


def authorize_model(snapshot: Snapshot, entry: KeyEntry, model: str) -> PoolInfo:
    """The pool serving `model` (its name or its backend model's), if the key's entitlement is bound to it;
    otherwise the model does not exist for this key (a 404, as OpenAI answers an unknown model)."""
    pool = snapshot.pool_for_model(model)
    if pool is None or pool.name != entry.pool_name:
        raise model_not_found(model)
    return pool
