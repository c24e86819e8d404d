"""Model signals that make this process reload its snapshot at once (other processes poll a marker)."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete, post_save

from apps.gateway.snapshot import bump_local_version


def _changed(sender: Any, **kwargs: Any) -> None:
    # On commit: a write rolled back (an `apply --dry-run`, a failed apply) must not make this process reload,
    # and a reload before the commit would read the old rows anyway. Outside a transaction it runs at once.
    transaction.on_commit(bump_local_version, robust=True)


def connect_signals() -> None:
    from apps.pools.models import Replica, TokenEntitlement, TokenPool
    from apps.tenancy.models import ApiKey, Tenant

    for model in (ApiKey, TokenEntitlement, TokenPool, Replica, Tenant):
        post_save.connect(_changed, sender=model, dispatch_uid=f"gateway-snapshot-{model.__name__}")
        post_delete.connect(_changed, sender=model, dispatch_uid=f"gateway-snapshot-del-{model.__name__}")
