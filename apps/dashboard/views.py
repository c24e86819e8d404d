"""Server-rendered admin UI pages: the overview, entitlements, API keys and pools (the tenant pages are in
tenant_pages.py, the live dashboards in live_pages.py, the flow they share in page_flow.py).

Thin views (conventions 3 and 4): a page reads through the selectors, which are scoped to the signed-in
user and raise ``Http404`` for other tenants' objects; a form posts to a view that parses it, calls one
service and redirects with a message. The services enforce the roles (superuser, owner, member) and raise
``PermissionDenied`` (403) or ``ValidationError`` (shown on the form). Every page needs a login, every
form carries the CSRF token, and every state-changing action is POST-only.
"""

from __future__ import annotations

import datetime as dt
from functools import partial
from typing import Any

from asgiref.sync import async_to_sync
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.staticfiles.views import serve as staticfiles_serve
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from apps.dashboard import overview_selectors
from apps.dashboard import selectors as page_selectors
from apps.dashboard.forms import ApiKeyForm, EntitlementForm, PoolForm
from apps.dashboard.overview_figures import OVERVIEW_FIGURES
from apps.dashboard.page_flow import (
    GET_OR_POST,
    AuthenticatedRequest,
    redirect_with_success,
    require_superuser,
    service_form_page,
)
from apps.gateway.quotas import entitlement_quota_status, tenant_quota_status
from apps.pools import selectors as pool_selectors
from apps.pools import services as pool_services
from apps.pools.models import EntitlementState
from apps.tenancy import selectors as tenancy_selectors
from apps.tenancy import services as tenancy_services
from apps.tenancy.models import ApiKey, Role

ENTITLEMENTS_PER_PAGE = 100


# --- static assets ---------------------------------------------------------------------------------


@require_GET
def static_asset(request: HttpRequest, path: str) -> HttpResponseBase:
    """A file from the static folders (finders), for deployments without a static file server in front.

    No login: the login page needs its stylesheet. ``serve`` normalises the path and only answers with
    files the static finders know, so nothing outside the static folders can be read.
    """
    served = staticfiles_serve(request, path, insecure=True)
    response: HttpResponseBase = served
    if isinstance(served, StreamingHttpResponse):
        # Our assets are small; a plain response spares the ASGI handler from draining a sync file iterator
        # (which it warns about) and the file handle is closed here.
        body = served.getvalue()
        served.close()
        response = HttpResponse(body, content_type=served["Content-Type"])
        if served.has_header("Last-Modified"):
            response["Last-Modified"] = served["Last-Modified"]
    response["Cache-Control"] = "public, max-age=3600"
    return response


# --- home --------------------------------------------------------------------------------------------


@login_required
@require_GET
def home(request: AuthenticatedRequest) -> HttpResponse:
    """The overview: live figures (first drawn here, then pushed over /ws/overview/) above the counts."""
    overview = page_selectors.home_overview(user=request.user)
    now = dt.datetime.now(dt.UTC)
    scope = overview_selectors.overview_scope(user=request.user)
    live = overview_selectors.overview_get(user=request.user, now=now,
                                           samples=async_to_sync(overview_selectors.pool_histories)(scope.pools))
    return render(request, "dashboard/home.html", {
        "overview": overview, "live": live,
        "overview_figure_ids": [fid for fid, _ in OVERVIEW_FIGURES]})


# --- entitlements ------------------------------------------------------------------------------------


@login_required
@require_GET
def entitlement_list(request: AuthenticatedRequest) -> HttpResponse:
    state = request.GET.get("state") or None
    if state not in EntitlementState.values:
        state = None
    entitlements = pool_selectors.entitlement_list(user=request.user, state=state)
    owned = tenancy_selectors.owned_tenant_ids(user=request.user)
    # A page at a time: a platform with a key per team has thousands (10,000 took 2.1 s a page unpaginated).
    page = Paginator(entitlements, ENTITLEMENTS_PER_PAGE).get_page(request.GET.get("page"))
    return render(
        request,
        "dashboard/entitlement_list.html",
        {
            "entitlements": page.object_list,
            "page": page,
            "query": f"state={state}&" if state else "",
            "states": EntitlementState.values,
            "current_state": state,
            "can_create": bool(owned),
        },
    )


@login_required
@require_http_methods(GET_OR_POST)
def entitlement_create(request: AuthenticatedRequest) -> HttpResponse:
    tenants = page_selectors.owned_tenants(user=request.user)
    if not tenants.exists():
        raise PermissionDenied("only owners of a tenant may create entitlements")
    pools = pool_selectors.pool_list(user=request.user)

    def initial() -> dict[str, Any]:
        # Preselect what leaves no choice (a single tenant) and the pool the "New entitlement here" link names.
        values: dict[str, Any] = {"tenant": tenants.first()} if tenants.count() == 1 else {}
        pool_name = request.GET.get("pool")
        if pool_name and pools.filter(name=pool_name).exists():
            values["pool"] = pool_name
        return values

    return service_form_page(
        request,
        "dashboard/entitlement_form.html",
        make_form=partial(EntitlementForm, tenants=tenants, pools=pools),
        initial=initial,
        save=lambda data: pool_services.entitlement_create(actor=request.user, **data),
        on_saved=lambda entitlement: redirect_with_success(
            request,
            f"Entitlement {entitlement.name} created: {entitlement.state} ({entitlement.state_reason}).",
            "ui:entitlement-detail",
            name=entitlement.name,
        ),
        creating=True,
    )


@login_required
@require_GET
def entitlement_detail(request: AuthenticatedRequest, name: str) -> HttpResponse:
    entitlement = pool_selectors.entitlement_get(user=request.user, name=name)
    role = tenancy_selectors.user_role(user=request.user, tenant=entitlement.tenant)
    keys = tenancy_selectors.apikey_list(user=request.user, entitlement=entitlement)
    return render(
        request,
        "dashboard/entitlement_detail.html",
        {
            "entitlement": entitlement,
            "history": pool_selectors.entitlement_state_changes(user=request.user, entitlement=entitlement),
            "keys": keys,
            "can_edit": role == Role.OWNER,
            "quota": entitlement_quota_status(entitlement),
            "tenant_quota": tenant_quota_status(entitlement.tenant),
        },
    )


@login_required
@require_http_methods(GET_OR_POST)
def entitlement_edit(request: AuthenticatedRequest, name: str) -> HttpResponse:
    entitlement = pool_selectors.entitlement_get(user=request.user, name=name)
    if not tenancy_selectors.user_is_owner(user=request.user, tenant=entitlement.tenant):
        raise PermissionDenied("only owners of the tenant may change its entitlements")
    pools = pool_selectors.pool_list(user=request.user)
    return service_form_page(
        request,
        "dashboard/entitlement_form.html",
        make_form=partial(EntitlementForm, tenants=None, pools=pools),
        initial=lambda: EntitlementForm.initial_for(entitlement),
        save=lambda data: pool_services.entitlement_update(actor=request.user, entitlement=entitlement, **data),
        on_saved=lambda updated: redirect_with_success(
            request,
            f"Entitlement {updated.name} saved: {updated.state} ({updated.state_reason}).",
            "ui:entitlement-detail",
            name=updated.name,
        ),
        creating=False,
        entitlement=entitlement,
    )


@login_required
@require_POST
def entitlement_delete(request: AuthenticatedRequest, name: str) -> HttpResponse:
    entitlement = pool_selectors.entitlement_get(user=request.user, name=name)
    pool_services.entitlement_delete(actor=request.user, entitlement=entitlement)
    return redirect_with_success(
        request, f"Entitlement {name} revoked; its keys no longer work and its capacity is freed.", "ui:entitlement-list"
    )


# --- API keys ----------------------------------------------------------------------------------------


@login_required
@require_GET
def key_list(request: AuthenticatedRequest) -> HttpResponse:
    return render(
        request,
        "dashboard/key_list.html",
        {
            "rows": page_selectors.key_rows(user=request.user),
            "can_create": pool_selectors.entitlement_list(user=request.user).exists(),
            "rotation_graces": ROTATION_GRACES,
        },
    )


@never_cache  # the response to a successful POST carries the secret: no cache may keep it
@login_required
@require_http_methods(GET_OR_POST)
def key_create(request: AuthenticatedRequest) -> HttpResponse:
    entitlements = pool_selectors.entitlement_list(user=request.user)

    def initial() -> dict[str, Any]:
        wanted = request.GET.get("entitlement")
        return {"entitlement": wanted} if wanted and entitlements.filter(name=wanted).exists() else {}

    def created(key_and_secret: tuple[ApiKey, str]) -> HttpResponse:
        key, secret = key_and_secret
        # Rendered, not redirected: the secret exists only in this response and is never stored.
        return render(request, "dashboard/key_created.html", {"key": key, "secret": secret}, status=201)

    return service_form_page(
        request,
        "dashboard/key_form.html",
        make_form=partial(ApiKeyForm, entitlements=entitlements),
        initial=initial,
        save=lambda data: tenancy_services.apikey_create(actor=request.user, **data),
        on_saved=created,
    )


@login_required
@require_POST
def key_revoke(request: AuthenticatedRequest, key_id: int) -> HttpResponse:
    key = tenancy_selectors.apikey_get(user=request.user, key_id=key_id)
    tenancy_services.apikey_revoke(actor=request.user, key=key)
    return redirect_with_success(request, f"Key {key.prefix}… revoked.", "ui:key-list")


# The grace periods the key list offers for a rotation (seconds, label).
ROTATION_GRACES = ((0, "revoke the old one now"), (3600, "old one valid 1 hour"), (86400, "old one valid 1 day"),
                   (7 * 86400, "old one valid 7 days"))


@never_cache  # the response carries the new secret: no cache may keep it
@login_required
@require_POST
def key_rotate(request: AuthenticatedRequest, key_id: int) -> HttpResponse:
    """A new secret replacing the key (shown once, as after creation); the old one keeps working for the grace
    period chosen in the list (a day unless told)."""
    key = tenancy_selectors.apikey_get(user=request.user, key_id=key_id)
    allowed = {str(seconds): seconds for seconds, _label in ROTATION_GRACES}
    grace = allowed.get(request.POST.get("grace_period_s", "86400"))
    if grace is None:
        return HttpResponse("unknown grace period", status=400, content_type="text/plain")
    try:
        new_key, secret = tenancy_services.apikey_rotate(actor=request.user, key=key, grace_s=grace)
    except ValidationError as error:  # an expired key
        messages.error(request, " ".join(error.messages))
        return redirect("ui:key-list")
    return render(request, "dashboard/key_created.html", {"key": new_key, "secret": secret, "replaced": key},
                  status=201)


# --- pools -------------------------------------------------------------------------------------------


@login_required
@require_GET
def pool_list(request: AuthenticatedRequest) -> HttpResponse:
    return render(request, "dashboard/pool_list.html", {"rows": page_selectors.pool_rows(user=request.user)})


@login_required
@require_GET
def pool_detail(request: AuthenticatedRequest, name: str) -> HttpResponse:
    pool = pool_selectors.pool_get(user=request.user, name=name)
    return render(
        request,
        "dashboard/pool_detail.html",
        {
            "pool": pool,
            "page": page_selectors.pool_page(user=request.user, pool=pool),
            "can_create_entitlement": bool(tenancy_selectors.owned_tenant_ids(user=request.user)),
        },
    )


@login_required
@require_http_methods(GET_OR_POST)
def pool_create(request: AuthenticatedRequest) -> HttpResponse:
    require_superuser(request)
    return service_form_page(
        request,
        "dashboard/pool_form.html",
        make_form=PoolForm,
        save=lambda data: pool_services.pool_create(actor=request.user, **data),
        on_saved=lambda pool: redirect_with_success(request, f"Pool {pool.name} created.", "ui:pool-detail", name=pool.name),
        creating=True,
    )


@login_required
@require_http_methods(GET_OR_POST)
def pool_edit(request: AuthenticatedRequest, name: str) -> HttpResponse:
    require_superuser(request)
    pool = pool_selectors.pool_get(user=request.user, name=name)
    return service_form_page(
        request,
        "dashboard/pool_form.html",
        make_form=partial(PoolForm, editing=True),
        initial=lambda: PoolForm.initial_for(pool),
        save=lambda data: pool_services.pool_update(actor=request.user, pool=pool, **data),
        on_saved=lambda updated: redirect_with_success(
            request, f"Pool {updated.name} saved; its entitlements were re-evaluated.", "ui:pool-detail",
            name=updated.name,
        ),
        creating=False,
        pool=pool,
    )


@login_required
@require_POST
def pool_delete(request: AuthenticatedRequest, name: str) -> HttpResponseBase:
    require_superuser(request)
    pool = pool_selectors.pool_get(user=request.user, name=name)
    try:
        pool_services.pool_delete(actor=request.user, pool=pool)
    except ValidationError as exc:
        for message in exc.messages:
            messages.error(request, message)
        return redirect("ui:pool-detail", name=name)
    return redirect_with_success(request, f"Pool {name} deleted.", "ui:pool-list")


@login_required
@require_POST
def replica_toggle(request: AuthenticatedRequest, name: str, replica_id: int) -> HttpResponse:
    require_superuser(request)
    pool = pool_selectors.pool_get(user=request.user, name=name)
    replica = page_selectors.pool_replica(pool=pool, replica_id=replica_id)
    if replica is None:
        raise Http404("no such replica in this pool")
    enabled = not replica.enabled
    pool_services.replica_set_enabled(actor=request.user, replica=replica, enabled=enabled)
    return redirect_with_success(
        request,
        f"Replica {replica.url} {'enabled' if enabled else 'disabled'}; the pool's entitlements were re-evaluated.",
        "ui:pool-detail",
        name=pool.name,
    )
