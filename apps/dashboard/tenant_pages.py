"""The tenant pages (superusers only): list, create, edit, delete, and who belongs to a tenant in which role."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from apps.dashboard import selectors as page_selectors
from apps.dashboard.forms import QUOTA_NAMES, MembershipForm, TenantForm
from apps.dashboard.page_flow import (
    GET_OR_POST,
    AuthenticatedRequest,
    redirect_with_success,
    require_superuser,
    service_form_page,
)
from apps.gateway.quotas import tenant_quota_status
from apps.operations import tenants as tenant_operations
from apps.pools import selectors as pool_selectors
from apps.tenancy import selectors as tenancy_selectors
from apps.tenancy import services as tenancy_services


@login_required
@require_GET
def tenant_list(request: AuthenticatedRequest) -> HttpResponse:
    require_superuser(request)
    tenants = page_selectors.tenants_with_counts(user=request.user)
    return render(request, "dashboard/tenant_list.html", {"tenants": tenants})


@login_required
@require_http_methods(GET_OR_POST)
def tenant_create(request: AuthenticatedRequest) -> HttpResponse:
    require_superuser(request)
    return service_form_page(
        request,
        "dashboard/tenant_form.html",
        make_form=TenantForm,
        save=lambda data: tenant_operations.tenant_save(actor=request.user, **data),
        on_saved=lambda tenant: redirect_with_success(
            request, f"Tenant {tenant.slug} created.", "ui:tenant-detail", slug=tenant.slug
        ),
        creating=True,
    )


@login_required
@require_GET
def tenant_detail(request: AuthenticatedRequest, slug: str) -> HttpResponse:
    require_superuser(request)
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
    require_superuser(request)
    tenant = tenancy_selectors.tenant_get(user=request.user, slug=slug)
    return service_form_page(
        request,
        "dashboard/tenant_form.html",
        make_form=TenantForm,
        initial=lambda: {"name": tenant.name, "slug": tenant.slug,
                         **{name: getattr(tenant, name) for name in QUOTA_NAMES}},
        save=lambda data: tenant_operations.tenant_save(actor=request.user, tenant=tenant, **data),
        on_saved=lambda updated: redirect_with_success(
            request, f"Tenant {updated.slug} saved.", "ui:tenant-detail", slug=updated.slug
        ),
        creating=False,
        tenant=tenant,
    )


@login_required
@require_POST
def tenant_delete(request: AuthenticatedRequest, slug: str) -> HttpResponse:
    require_superuser(request)
    tenant = tenancy_selectors.tenant_get(user=request.user, slug=slug)
    tenant_operations.tenant_delete(actor=request.user, tenant=tenant)
    return redirect_with_success(
        request, f"Tenant {slug} deleted with its memberships, entitlements and keys.", "ui:tenant-list"
    )


@login_required
@require_POST
def membership_add(request: AuthenticatedRequest, slug: str) -> HttpResponse:
    require_superuser(request)
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
    require_superuser(request)
    tenant = tenancy_selectors.tenant_get(user=request.user, slug=slug)
    membership = tenancy_selectors.membership_get(user=request.user, membership_id=membership_id)
    if membership.tenant.pk != tenant.pk:
        raise Http404("no such membership in this tenant")
    tenancy_services.membership_remove(actor=request.user, membership=membership)
    return redirect_with_success(
        request, f"{membership.user.get_username()} removed from {tenant.slug}.", "ui:tenant-detail", slug=tenant.slug
    )
