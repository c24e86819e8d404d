"""DRF permission classes for the platform-operator-only actions.

Everything tenant-scoped is decided by the services (403) and the selectors (404); these classes only
refuse early what no tenant user may do at all, before any input is parsed.
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission


def _is_operator(request: Any) -> bool:
    user = request.user
    return bool(user and user.is_authenticated and user.is_active and user.is_superuser)


class SuperuserOrReadOnly(BasePermission):
    """Any signed-in user reads; only superusers write (pools)."""

    message = "only platform operators (superusers) may change this"

    def has_permission(self, request: Any, view: Any) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        return request.method in SAFE_METHODS or _is_operator(request)


class SuperuserCreates(BasePermission):
    """Only superusers use the collection's create (tenants, users); object rights are the services'."""

    message = "only platform operators (superusers) may create this"

    def has_permission(self, request: Any, view: Any) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        return getattr(view, "action", None) != "create" or _is_operator(request)
