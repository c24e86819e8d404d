"""Server-rendered admin UI pages.

Thin views (conventions 3 and 4): a page reads through the selectors, which are scoped to the signed-in
user and raise ``Http404`` for other tenants' objects; a form posts to a view that parses it, calls one
service and redirects with a message. The services enforce the roles (superuser, owner, member) and raise
``PermissionDenied`` (403) or ``ValidationError`` (shown on the form). Every page needs a login, every
form carries the CSRF token, and every state-changing action is POST-only.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from asgiref.sync import async_to_sync
from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.contrib.staticfiles.views import serve as staticfiles_serve
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from apps.dashboard import overview_selectors
from apps.dashboard import selectors as page_selectors
from apps.dashboard.figures import PRIMARY_FIGURES
from apps.dashboard.forms import (
    QUOTA_NAMES,
    ApiKeyForm,
    EntitlementForm,
    MembershipForm,
    PoolForm,
    TenantForm,
    add_service_errors,
)
from apps.dashboard.overview_figures import OVERVIEW_FIGURES
from apps.gateway.quotas import entitlement_quota_status, tenant_quota_status
from apps.operations import tenants as tenant_operations
from apps.pools import selectors as pool_selectors
from apps.pools import services as pool_services
from apps.pools.models import EntitlementState
from apps.tenancy import selectors as tenancy_selectors
from apps.tenancy import services as tenancy_services
from apps.tenancy.models import ApiKey, Role

T = TypeVar("T")
GET_OR_POST = ["GET", "POST"]
ENTITLEMENTS_PER_PAGE = 100


class AuthenticatedRequest(HttpRequest):
    """What every view here receives: ``login_required`` guarantees a signed-in user (the default User model)."""

    user: User


def _require_superuser(request: AuthenticatedRequest) -> None:
    # Pools and tenants are platform resources; a page to change them is not even shown to tenant users.
    if not request.user.is_superuser:
        raise PermissionDenied("only platform operators (superusers) manage this")


def _call_service(form: Any, call: Callable[[], T]) -> T | None:
    """Run the service; on ValidationError put its messages on the form and return None."""
    try:
        return call()
    except ValidationError as exc:
        add_service_errors(form, exc)
        return None


def _service_form_page(
    request: AuthenticatedRequest,
    template: str,
    *,
    make_form: Callable[..., forms.Form],
    save: Callable[[dict[str, Any]], T],
    on_saved: Callable[[T], HttpResponse],
    initial: Callable[[], dict[str, Any]] | None = None,
    **context: Any,
) -> HttpResponse:
    """The one flow of every create and edit page: a GET shows ``make_form(initial=...)``; a POST binds
    ``make_form(request.POST)``, hands the cleaned data to ``save`` (one service call) and answers with
    ``on_saved(result)``. An invalid form, or a service's ValidationError, shows the page again with the
    errors. ``initial`` is a callable so that its queries run only for the GET that shows it."""
    if request.method == "POST":
        form = make_form(request.POST)
        if form.is_valid():
            saved = _call_service(form, lambda: save(form.cleaned_data))
            if saved is not None:
                return on_saved(saved)
    else:
        form = make_form(initial=initial() if initial is not None else None)
    return render(request, template, {"form": form, **context})


def _redirect_with_success(request: AuthenticatedRequest, message: str, to: str, **url_kwargs: Any) -> HttpResponse:
    messages.success(request, message)
    return redirect(to, **url_kwargs)


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

    return _service_form_page(
        request,
        "dashboard/entitlement_form.html",
        make_form=partial(EntitlementForm, tenants=tenants, pools=pools),
        initial=initial,
        save=lambda data: pool_services.entitlement_create(actor=request.user, **data),
        on_saved=lambda entitlement: _redirect_with_success(
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
    return _service_form_page(
        request,
        "dashboard/entitlement_form.html",
        make_form=partial(EntitlementForm, tenants=None, pools=pools),
        initial=lambda: EntitlementForm.initial_for(entitlement),
        save=lambda data: pool_services.entitlement_update(actor=request.user, entitlement=entitlement, **data),
        on_saved=lambda updated: _redirect_with_success(
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
    return _redirect_with_success(
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

    return _service_form_page(
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
    return _redirect_with_success(request, f"Key {key.prefix}… revoked.", "ui:key-list")


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
    _require_superuser(request)
    return _service_form_page(
        request,
        "dashboard/pool_form.html",
        make_form=PoolForm,
        save=lambda data: pool_services.pool_create(actor=request.user, **data),
        on_saved=lambda pool: _redirect_with_success(request, f"Pool {pool.name} created.", "ui:pool-detail", name=pool.name),
        creating=True,
    )


@login_required
@require_http_methods(GET_OR_POST)
def pool_edit(request: AuthenticatedRequest, name: str) -> HttpResponse:
    _require_superuser(request)
    pool = pool_selectors.pool_get(user=request.user, name=name)
    return _service_form_page(
        request,
        "dashboard/pool_form.html",
        make_form=partial(PoolForm, editing=True),
        initial=lambda: PoolForm.initial_for(pool),
        save=lambda data: pool_services.pool_update(actor=request.user, pool=pool, **data),
        on_saved=lambda updated: _redirect_with_success(
            request, f"Pool {updated.name} saved; its entitlements were re-evaluated.", "ui:pool-detail",
            name=updated.name,
        ),
        creating=False,
        pool=pool,
    )


@login_required
@require_POST
def pool_delete(request: AuthenticatedRequest, name: str) -> HttpResponseBase:
    _require_superuser(request)
    pool = pool_selectors.pool_get(user=request.user, name=name)
    try:
        pool_services.pool_delete(actor=request.user, pool=pool)
    except ValidationError as exc:
        for message in exc.messages:
            messages.error(request, message)
        return redirect("ui:pool-detail", name=name)
    return _redirect_with_success(request, f"Pool {name} deleted.", "ui:pool-list")


@login_required
@require_POST
def replica_toggle(request: AuthenticatedRequest, name: str, replica_id: int) -> HttpResponse:
    _require_superuser(request)
    pool = pool_selectors.pool_get(user=request.user, name=name)
    replica = page_selectors.pool_replica(pool=pool, replica_id=replica_id)
    if replica is None:
        raise Http404("no such replica in this pool")
    enabled = not replica.enabled
    pool_services.replica_set_enabled(actor=request.user, replica=replica, enabled=enabled)
    return _redirect_with_success(
        request,
        f"Replica {replica.url} {'enabled' if enabled else 'disabled'}; the pool's entitlements were re-evaluated.",
        "ui:pool-detail",
        name=pool.name,
    )


# --- tenants (superusers) ----------------------------------------------------------------------------


@login_required
@require_GET
def tenant_list(request: AuthenticatedRequest) -> HttpResponse:
    _require_superuser(request)
    tenants = page_selectors.tenants_with_counts(user=request.user)
    return render(request, "dashboard/tenant_list.html", {"tenants": tenants})


@login_required
@require_http_methods(GET_OR_POST)
def tenant_create(request: AuthenticatedRequest) -> HttpResponse:
    _require_superuser(request)
    return _service_form_page(
        request,
        "dashboard/tenant_form.html",
        make_form=TenantForm,
        save=lambda data: tenant_operations.tenant_save(actor=request.user, **data),
        on_saved=lambda tenant: _redirect_with_success(
            request, f"Tenant {tenant.slug} created.", "ui:tenant-detail", slug=tenant.slug
        ),
        creating=True,
    )


@login_required
@require_GET
def tenant_detail(request: AuthenticatedRequest, slug: str) -> HttpResponse:
    _require_superuser(request)
    tenant = tenancy_selectors.tenant_get(user=request.user, slug=slug)
    return render(
        request,
        "dashboard/tenant_detail.html",
        {
            "tenant": tenant,
            "memberships": tenancy_selectors.membership_list(user=request.user, tenant=tenant),
            "entitlements": pool_selectors.entitlement_list(user=request.user, tenant=tenant),
            "keys": tenancy_selectors.apikey_list(user=request.user, tenant=tenant),
            "membership_form": MembershipForm(),
            "quota": tenant_quota_status(tenant),
        },
    )


@login_required
@require_http_methods(GET_OR_POST)
def tenant_edit(request: AuthenticatedRequest, slug: str) -> HttpResponse:
    _require_superuser(request)
    tenant = tenancy_selectors.tenant_get(user=request.user, slug=slug)
    return _service_form_page(
        request,
        "dashboard/tenant_form.html",
        make_form=TenantForm,
        initial=lambda: {"name": tenant.name, "slug": tenant.slug,
                         **{name: getattr(tenant, name) for name in QUOTA_NAMES}},
        save=lambda data: tenant_operations.tenant_save(actor=request.user, tenant=tenant, **data),
        on_saved=lambda updated: _redirect_with_success(
            request, f"Tenant {updated.slug} saved.", "ui:tenant-detail", slug=updated.slug
        ),
        creating=False,
        tenant=tenant,
    )


@login_required
@require_POST
def tenant_delete(request: AuthenticatedRequest, slug: str) -> HttpResponse:
    _require_superuser(request)
    tenant = tenancy_selectors.tenant_get(user=request.user, slug=slug)
    tenant_operations.tenant_delete(actor=request.user, tenant=tenant)
    return _redirect_with_success(
        request, f"Tenant {slug} deleted with its memberships, entitlements and keys.", "ui:tenant-list"
    )


@login_required
@require_POST
def membership_add(request: AuthenticatedRequest, slug: str) -> HttpResponse:
    _require_superuser(request)
    tenant = tenancy_selectors.tenant_get(user=request.user, slug=slug)
    form = MembershipForm(request.POST)
    if form.is_valid():
        user = tenancy_selectors.user_list(user=request.user).filter(username=form.cleaned_data["username"]).first()
        if user is None:
            messages.error(request, f"No login named {form.cleaned_data['username']!r}.")
        else:
            try:
                tenancy_services.membership_set(
                    actor=request.user, tenant=tenant, user=user, role=form.cleaned_data["role"]
                )
            except ValidationError as exc:
                for message in exc.messages:
                    messages.error(request, message)
            else:
                messages.success(request, f"{user.get_username()} is now {form.cleaned_data['role']} of {tenant.slug}.")
    else:
        messages.error(request, "Give a username and a role.")
    return redirect("ui:tenant-detail", slug=tenant.slug)


@login_required
@require_POST
def membership_remove(request: AuthenticatedRequest, slug: str, membership_id: int) -> HttpResponse:
    _require_superuser(request)
    tenant = tenancy_selectors.tenant_get(user=request.user, slug=slug)
    membership = tenancy_selectors.membership_get(user=request.user, membership_id=membership_id)
    if membership.tenant.pk != tenant.pk:
        raise Http404("no such membership in this tenant")
    tenancy_services.membership_remove(actor=request.user, membership=membership)
    return _redirect_with_success(
        request, f"{membership.user.get_username()} removed from {tenant.slug}.", "ui:tenant-detail", slug=tenant.slug
    )


# --- live dashboards -----------------------------------------------------------------------------------


def _live_page(request: AuthenticatedRequest, access: page_selectors.LiveAccess, ws_path: str,
               back_url: str) -> HttpResponse:
    # The four charts an operator reads first go above the fold, the rest under them (issue 28).
    primary = [fid for fid in access.figure_ids if fid in PRIMARY_FIGURES]
    return render(
        request,
        "dashboard/live.html",
        {"access": access, "ws_path": ws_path, "figure_ids": access.figure_ids, "back_url": back_url,
         "primary_ids": primary, "more_ids": [fid for fid in access.figure_ids if fid not in primary],
         "pool_totals": access.visibility.pool_totals},
    )


@login_required
@require_GET
def pool_live(request: AuthenticatedRequest, name: str) -> HttpResponse:
    access = page_selectors.live_pool_access(user=request.user, name=name)
    return _live_page(request, access, f"/ws/pools/{access.pool}/", reverse("ui:pool-detail", args=[access.pool]))


@login_required
@require_GET
def entitlement_live(request: AuthenticatedRequest, name: str) -> HttpResponse:
    access = page_selectors.live_entitlement_access(user=request.user, name=name)
    return _live_page(request, access, f"/ws/entitlements/{name}/", reverse("ui:entitlement-detail", args=[name]))


_PLOTLY_JS: tuple[bytes, str] | None = None


def _plotly_js() -> tuple[bytes, str]:
    """plotly.js as shipped inside the installed plotly package (no CDN), read once per process."""
    global _PLOTLY_JS
    if _PLOTLY_JS is None:
        import plotly

        body = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
        _PLOTLY_JS = (body, f'"plotly-{plotly.__version__}-{len(body)}"')
    return _PLOTLY_JS


@require_GET
def plotly_js(request: HttpRequest) -> HttpResponse:
    """No login (a script, like the CSS); cacheable for a day and revalidated by ETag (the package version)."""
    body, etag = _plotly_js()
    if etag in request.headers.get("If-None-Match", ""):
        response = HttpResponse(status=304)
    else:
        response = HttpResponse(body, content_type="text/javascript; charset=utf-8")
    response["ETag"] = etag
    response["Cache-Control"] = "public, max-age=86400"
    return response
