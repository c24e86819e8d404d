"""REST API routes under /api/v1/ (tenants, users, memberships, pools, entitlements, keys, usage, requests,
audit, apply, diff, export)."""

from __future__ import annotations

from django.urls import path, re_path
from rest_framework.routers import DefaultRouter

from apps.audit.api import AuditEntryViewSet
from apps.gateway.api import RequestLogViewSet, UsageRecordViewSet
from apps.operations.api import ApiKeyViewSet, EntitlementViewSet, TenantViewSet
from apps.pools.api import ApplyView, DiffView, ExportView, PoolViewSet
from apps.simulator.api import WhatIfView
from apps.tenancy.api import MembershipViewSet, UserViewSet
from apps.tenancy.apiutils import NAME_IN_PATH, FormParser, JSONParser, MultiPartParser
from apps.tenancy.signin import LockoutObtainAuthToken

router = DefaultRouter()
router.register("tenants", TenantViewSet, basename="tenant")
router.register("users", UserViewSet, basename="user")
router.register("memberships", MembershipViewSet, basename="membership")
router.register("pools", PoolViewSet, basename="pool")
router.register("entitlements", EntitlementViewSet, basename="entitlement")
router.register("keys", ApiKeyViewSet, basename="apikey")
router.register("usage", UsageRecordViewSet, basename="usage")
router.register("requests", RequestLogViewSet, basename="request")
router.register("audit", AuditEntryViewSet, basename="audit")

urlpatterns = [
    path("apply", ApplyView.as_view(), name="apply"),
    path("diff", DiffView.as_view(), name="diff"),
    path("export", ExportView.as_view(), name="export"),
    # What if (issue 26): the pool's recorded traffic replayed under a proposed manifest.
    re_path(rf"^pools/(?P<name>{NAME_IN_PATH})/whatif/$", WhatIfView.as_view(), name="pool-whatif"),
    # Scripts trade a username and password for their API token here (POST username, password).
    # DRF's view names its own parsers; these also refuse NUL characters (a username is looked up). Failed
    # passwords are counted and lock out (429 with Retry-After; apps/tenancy/lockout.py).
    path("auth/token", LockoutObtainAuthToken.as_view(parser_classes=[FormParser, MultiPartParser, JSONParser]),
         name="auth-token"),
    *router.urls,
]
