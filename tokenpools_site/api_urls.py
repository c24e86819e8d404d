"""REST API routes under /api/v1/ (tenants, users, pools, entitlements, keys, apply)."""

from __future__ import annotations

urlpatterns: list = []
