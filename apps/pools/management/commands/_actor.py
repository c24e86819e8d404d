"""Who a management command acts as: the system operator, or ``--as USERNAME`` to act as a real user."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from apps.tenancy.services import SYSTEM


def resolve_actor(username: str | None) -> Any:
    if not username:
        return SYSTEM
    try:
        return get_user_model().objects.get(username=username, is_active=True)
    except get_user_model().DoesNotExist as exc:
        raise CommandError(f"no active user {username!r}") from exc
