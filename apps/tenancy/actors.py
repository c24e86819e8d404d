"""Who reads and acts: a login (or the anonymous user) from a request, or the system operator.

Selectors take such a ``user`` and services such an ``actor``; both only ask the duck-typed flags
(``is_active``, ``is_superuser``, ``is_authenticated``, ``pk``), so ``SYSTEM`` stands in for a superuser
that owns no rows.
"""

from __future__ import annotations

from typing import TypeAlias

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser


class SystemActor:
    """The operator running a management command: acts with superuser rights, owns no rows."""

    is_superuser = True
    is_staff = True
    is_active = True
    is_authenticated = True
    is_anonymous = False
    pk = None
    id = None
    username = "system"

    def __str__(self) -> str:
        return "system"


SYSTEM = SystemActor()

AnyUser: TypeAlias = AbstractBaseUser | AnonymousUser | SystemActor
"""``request.user`` (a login or the anonymous user) or ``SYSTEM``."""
