"""Browser admin UI pages (login required)."""

from __future__ import annotations

from django.urls import path

from apps.audit.views import audit_page
from apps.dashboard import live_pages, tenant_pages, views
from apps.dashboard.usage import usage_page
from apps.dashboard.whatif import pool_whatif

app_name = "ui"
urlpatterns = [
    path("", views.home, name="home"),
    path("entitlements/", views.entitlement_list, name="entitlement-list"),
    path("entitlements/new/", views.entitlement_create, name="entitlement-create"),
    path("entitlements/<str:name>/", views.entitlement_detail, name="entitlement-detail"),
    path("entitlements/<str:name>/live/", live_pages.entitlement_live, name="entitlement-live"),
    path("entitlements/<str:name>/edit/", views.entitlement_edit, name="entitlement-edit"),
    path("entitlements/<str:name>/revoke/", views.entitlement_delete, name="entitlement-delete"),
    path("keys/", views.key_list, name="key-list"),
    path("keys/new/", views.key_create, name="key-create"),
    path("keys/<int:key_id>/revoke/", views.key_revoke, name="key-revoke"),
    path("keys/<int:key_id>/rotate/", views.key_rotate, name="key-rotate"),
    path("pools/", views.pool_list, name="pool-list"),
    path("pools/new/", views.pool_create, name="pool-create"),
    path("pools/<str:name>/", views.pool_detail, name="pool-detail"),
    path("pools/<str:name>/live/", live_pages.pool_live, name="pool-live"),
    path("pools/<str:name>/whatif/", pool_whatif, name="pool-whatif"),
    path("pools/<str:name>/edit/", views.pool_edit, name="pool-edit"),
    path("pools/<str:name>/delete/", views.pool_delete, name="pool-delete"),
    path("pools/<str:name>/replicas/<int:replica_id>/toggle/", views.replica_toggle, name="replica-toggle"),
    path("usage/", usage_page, name="usage"),
    path("audit/", audit_page, name="audit"),
    path("tenants/", tenant_pages.tenant_list, name="tenant-list"),
    path("tenants/new/", tenant_pages.tenant_create, name="tenant-create"),
    path("tenants/<str:slug>/", tenant_pages.tenant_detail, name="tenant-detail"),
    path("tenants/<str:slug>/edit/", tenant_pages.tenant_edit, name="tenant-edit"),
    path("tenants/<str:slug>/delete/", tenant_pages.tenant_delete, name="tenant-delete"),
    path("tenants/<str:slug>/members/", tenant_pages.membership_add, name="membership-add"),
    path("tenants/<str:slug>/members/<int:membership_id>/remove/", tenant_pages.membership_remove, name="membership-remove"),
    # The site runs under uvicorn (ASGI), where Django serves no static files by itself; the UI's own CSS comes
    # through here. Under runserver/live_server the static handler answers first and this route is not reached.
    path("vendor/plotly.min.js", live_pages.plotly_js, name="plotly-js"),
    path("static/<path:path>", views.static_asset, name="static"),
]
