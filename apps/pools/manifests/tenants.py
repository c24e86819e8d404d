"""`kind: Tenant` documents: validated against the database and the rest of the manifest, applied before
pools and entitlements, exported first.

    kind: Tenant
    metadata: {name: acme}                      # the slug
    spec:
      displayName: Acme Corp
      members: [{user: alice, role: owner}]     # existing users; the list is declarative when given
      quota: {tokens: 5000000, window: month}   # or {amount: 50, currency: USD, window: month}
                                                # onExceeded: spot serves the tenant as spot once used up

Creating a tenant or changing its name or quota needs a platform operator (superuser); an owner may apply
their tenant's document when only its members change (as they may in the UI).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError

from apps.pools.manifests.limits import excerpt
from apps.pools.manifests.reader import (
    API_VERSION,
    TENANT_PATHS,
    Collector,
    Plan,
    changed_paths,
    model_errors,
)
from apps.tenancy import services as tenancy_services
from apps.tenancy.models import Membership, Tenant
from apps.tenancy.selectors import tenant_list, user_role

SETTINGS = ("name", "quota_tokens", "quota_amount", "quota_currency", "quota_window", "quota_timezone",
            "quota_on_exceeded")


def tenant_settings(tenant: Tenant) -> dict[str, Any]:
    return {name: getattr(tenant, name) for name in SETTINGS}


def tenant_members(tenant: Tenant) -> list[dict[str, str]]:
    return [{"user": m.user.get_username(), "role": m.role}
            for m in tenant.memberships.select_related("user").order_by("user__username")]


def validate_tenants(plans: list[Plan], actor: Any, errors: Collector) -> None:
    """Check each Tenant plan (rights, users, the model's rules); sets `plan.existing`."""
    is_superuser = bool(getattr(actor, "is_superuser", False))
    visible = {t.slug: t for t in tenant_list(user=actor)}
    users = get_user_model().objects
    for plan in plans:
        existing = Tenant.objects.filter(slug=plan.name).first()
        settings = {k: v for k, v in plan.values.items() if k in SETTINGS}
        if not is_superuser:
            if existing is None or existing.slug not in visible:
                errors.add(plan.index, plan.kind, plan.name, "", "only platform operators (superusers) may create "
                           "tenants", True)
                continue
            if user_role(user=actor, tenant=existing) != "owner":
                errors.add(plan.index, plan.kind, plan.name, "", f"only owners of tenant {excerpt(plan.name)} may apply "
                           "its document", True)
                continue
            if tenant_settings(existing) != settings:
                errors.add(plan.index, plan.kind, plan.name, "spec", "only platform operators (superusers) may "
                           "change a tenant's displayName or quota; owners may change its members", True)
                continue
        plan.existing = existing
        for index, member in enumerate(plan.values.get("members") or []):
            user = users.filter(**{users.model.USERNAME_FIELD: member["user"]}).first()
            if user is None:
                errors.add(plan.index, plan.kind, plan.name, f"spec.members[{index}].user",
                           f"unknown user {excerpt(member['user'])}")
            member["user_obj"] = user
        candidate = Tenant(pk=existing.pk if existing else None, slug=plan.name, **settings)
        try:
            candidate.full_clean(exclude=["created_at", "updated_at"], validate_unique=existing is None)
        except ValidationError as exc:
            for path, message in model_errors(exc, TENANT_PATHS):
                errors.add(plan.index, plan.kind, plan.name, path, message)


def apply_tenant(plan: Plan, actor: Any) -> tuple[str, tuple[str, ...]]:
    """Create or update the tenant and, when the document lists them, set its members exactly; returns the
    action and, when updated, the manifest paths that changed."""
    settings = {k: v for k, v in plan.values.items() if k in SETTINGS}
    members = plan.values.get("members")
    fields: tuple[str, ...] = ()
    if plan.existing is None:
        tenant = tenancy_services.tenant_create(actor=actor, slug=plan.name, **settings)
        action = "created"
    else:
        tenant = plan.existing
        fields = changed_paths(tenant_settings(tenant), settings, TENANT_PATHS)
        if fields:
            tenant = tenancy_services.tenant_update(actor=actor, tenant=tenant, **settings)
        action = "updated"
    if members is not None and _set_members(tenant, members, actor):
        fields += ("spec.members",)
    if action == "updated" and not fields:
        return "unchanged", ()
    return action, fields if action == "updated" else ()


def _set_members(tenant: Tenant, members: list[dict[str, Any]], actor: Any) -> bool:
    """Make the tenant's memberships exactly ``members``; whether anything changed."""
    changed = False
    wanted = {m["user_obj"].pk: m for m in members}
    # Promotions first, removals last: the tenant never passes through a state without an owner.
    for member in sorted(members, key=lambda m: m["role"] != "owner"):
        current = Membership.objects.filter(tenant=tenant, user=member["user_obj"]).first()
        if current is None or current.role != member["role"]:
            tenancy_services.membership_set(actor=actor, tenant=tenant, user=member["user_obj"],
                                            role=member["role"])
            changed = True
    for membership in Membership.objects.filter(tenant=tenant).exclude(user_id__in=wanted):
        tenancy_services.membership_remove(actor=actor, membership=membership)
        changed = True
    return changed


def tenant_to_manifest(tenant: Tenant) -> dict[str, Any]:
    spec: dict[str, Any] = {"displayName": tenant.name}
    members = tenant_members(tenant)
    if members:
        spec["members"] = members
    if tenant.has_quota:
        spec["quota"] = quota_to_manifest(tenant)
    return {"apiVersion": API_VERSION, "kind": "Tenant", "metadata": {"name": tenant.slug}, "spec": spec}


def quota_to_manifest(owner: Any) -> dict[str, Any]:
    quota: dict[str, Any] = {}
    if owner.quota_tokens is not None:
        quota["tokens"] = owner.quota_tokens
    else:
        amount = owner.quota_amount
        quota["amount"] = int(amount) if amount == amount.to_integral_value() else float(amount)
        quota["currency"] = owner.quota_currency
    quota["window"] = owner.quota_window
    if owner.quota_timezone and owner.quota_timezone != "UTC":
        quota["timezone"] = owner.quota_timezone
    if owner.quota_on_exceeded and owner.quota_on_exceeded != "reject":  # reject: the default, left out
        quota["onExceeded"] = owner.quota_on_exceeded
    return quota
