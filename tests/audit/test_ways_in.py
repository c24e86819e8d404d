"""Every way in records who, through what, the object and the fields before and after: the UI's forms, the REST
API (token authentication), `apply`, `delete -f`, `apply --prune`, `create_key` (and `--rotate`) and the Django
admin. Bookkeeping by the control loops (binding state, a key's last use, logins) records nothing, and a key's
secret or its hash never appears in any entry."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from apps.audit.models import AuditEntry
from apps.pools.models import TokenEntitlement
from apps.tenancy.models import ApiKey
from apps.tenancy.selectors import apikey_hash
from apps.tenancy.services import apikey_create, apikeys_mark_used
from tests.pools.factories import make_entitlement
from tests.pools.test_api_isolation import client_as
from tests.pools.test_delete_command import DEMO, QWEN, entitlement_doc

pytestmark = pytest.mark.django_db


def entries(**filters: Any) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(**filters).order_by("id"))


def last(**filters: Any) -> AuditEntry:
    found = entries(**filters)
    assert found, f"no entry for {filters}"
    return found[-1]


def command(name: str, *args: str) -> str:
    out = io.StringIO()
    call_command(name, *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_ui_form_post_with_csrf_records_the_login_through_ui(admin: Any, acme: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin)
    page = client.get(f"/tenants/{acme.slug}/edit/").content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token is not None
    form = {"csrfmiddlewaretoken": token.group(1), "name": "Acme Corp", "slug": "acme", "quota_window": "month",
            "quota_tokens": "1000000", "quota_amount": "", "quota_currency": "", "quota_timezone": "",
            "quota_on_exceeded": "reject"}
    response = client.post(f"/tenants/{acme.slug}/edit/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    entry = last(kind="Tenant", action="update")
    assert (entry.actor_id, entry.actor_username, entry.through) == (admin.pk, "root", "ui")
    assert (entry.object_id, entry.object_name, entry.tenant_slug) == (str(acme.pk), "acme", "acme")
    assert entry.before["name"] == "Acme" and entry.after["name"] == "Acme Corp"
    assert entry.before["quota_tokens"] is None and entry.after["quota_tokens"] == 1000000
    assert "slug" not in entry.after and "updated_at" not in entry.after  # only what changed


def test_rest_create_update_delete_are_attributed_to_the_token_user(admin: Any, acme: Any, owner: Any,
                                                                     pool: Any) -> None:
    api = client_as(owner)
    body = {"name": "acme-new", "tenant": "acme", "pool": pool.name, "service_class": "spot", "slo_target_ms": 500,
            "tokens_per_second": 10, "kv_cache_gib": "1", "concurrency": 1}
    assert api.post("/api/v1/entitlements/", body, format="json").status_code == 201
    created = last(kind="TokenEntitlement", object_name="acme-new")
    assert (created.action, created.actor_username, created.actor_id, created.through) == (
        "create", "olivia", owner.pk, "api")
    assert created.before is None and created.after["concurrency"] == 1 and created.tenant_slug == "acme"
    assert "state" not in created.after  # binding's bookkeeping, kept by EntitlementStateChange
    assert api.patch("/api/v1/entitlements/acme-new/", {"concurrency": 2}, format="json").status_code == 200
    updated = last(kind="TokenEntitlement", action="update")
    assert (updated.before, updated.after, updated.through) == ({"concurrency": 1}, {"concurrency": 2}, "api")
    assert api.delete("/api/v1/entitlements/acme-new/").status_code == 204
    deleted = last(kind="TokenEntitlement", action="delete")
    assert deleted.after is None and deleted.before["name"] == "acme-new" and deleted.actor_username == "olivia"


def test_apply_records_created_and_updated_as_the_as_user_or_system(admin: Any, tmp_path: Path) -> None:
    command("apply", "-f", DEMO, "-f", QWEN)
    pool = last(kind="TokenPool", object_name="demo-pool")
    assert (pool.action, pool.actor_username, pool.actor_id, pool.through) == ("create", "system", None, "apply")
    assert {e.object_name for e in entries(kind="Replica", action="create")}  # the pool's replicas too
    assert last(kind="Tenant", object_name="acme").through == "apply"
    changed = tmp_path / "changed.yaml"
    changed.write_text(entitlement_doc("acme-guaranteed", "acme", concurrency=3))
    before = AuditEntry.objects.count()
    command("apply", "-f", str(changed), "--as", "root")
    entry = last(kind="TokenEntitlement", object_name="acme-guaranteed", action="update")
    assert (entry.actor_username, entry.actor_id, entry.through) == ("root", admin.pk, "apply")
    assert entry.after["concurrency"] == 3 and entry.before["concurrency"] != 3
    command("apply", "-f", str(changed))  # unchanged: nothing to record
    assert AuditEntry.objects.count() == before + 1


def test_dry_runs_and_diff_record_nothing(admin: Any, tmp_path: Path) -> None:
    assert entries(kind="User", object_name="root", action="create")  # the fixture's login
    start = AuditEntry.objects.count()
    command("apply", "-f", DEMO, "-f", QWEN, "--dry-run")
    command("delete", "-f", QWEN, "--dry-run", "--ignore-not-found")
    assert AuditEntry.objects.count() == start
    command("apply", "-f", DEMO, "-f", QWEN)
    count = AuditEntry.objects.count()
    changed = tmp_path / "changed.yaml"
    changed.write_text(entitlement_doc("acme-guaranteed", "acme", concurrency=3))
    command("apply", "-f", str(changed), "--dry-run", "--prune", "--tenant", "acme")
    with pytest.raises(SystemExit):
        command("diff", "-f", str(changed))
    api = client_as(admin)
    assert api.post("/api/v1/apply?dryRun=true", {"documents": []}, format="json").status_code == 400
    command("delete", "-f", DEMO, "-f", QWEN, "--dry-run")
    assert AuditEntry.objects.count() == count


def test_delete_and_prune_record_their_way_in(admin: Any, tmp_path: Path) -> None:
    command("apply", "-f", DEMO, "-f", QWEN)
    command("apply", "-f", DEMO, "--prune", "--tenant", "acme", "--as", "root")
    pruned = last(kind="TokenEntitlement", object_name="sample-entitlement", action="delete")
    assert (pruned.through, pruned.actor_username) == ("prune", "root")
    command("delete", "-f", DEMO)
    deleted = last(kind="TokenPool", object_name="demo-pool", action="delete")
    assert (deleted.through, deleted.actor_username) == ("delete", "system")
    assert last(kind="Tenant", object_name="globex", action="delete").through == "delete"
    # The tenant's memberships and entitlements went with it, each recorded.
    assert last(kind="TokenEntitlement", object_name="globex-spot", action="delete").through == "delete"


def test_create_key_and_rotate_record_the_command_and_never_the_secret(admin: Any, acme: Any, pool: Any) -> None:
    make_entitlement(admin, acme, pool, "acme-g")
    secret = command("create_key", "--entitlement", "acme-g", "--name", "ci").strip()
    key = ApiKey.objects.get(secret_hash=apikey_hash(secret))
    created = last(kind="ApiKey", object_id=str(key.pk), action="create")
    assert (created.through, created.actor_username, created.tenant_slug) == ("command", "system", "acme")
    assert created.object_name == key.prefix and created.after["name"] == "ci"
    new_secret = command("create_key", "--rotate", str(key.pk), "--grace-s", "0").strip()
    old = last(kind="ApiKey", object_id=str(key.pk), action="update")
    assert old.before == {"revoked_at": None} and old.after["revoked_at"] and old.through == "command"
    new_key = ApiKey.objects.get(secret_hash=apikey_hash(new_secret))
    assert last(kind="ApiKey", object_id=str(new_key.pk)).action == "create"
    # REST create too: the response carries the secret, the log does not.
    rest_secret = client_as(admin).post("/api/v1/keys/", {"entitlement": "acme-g"}, format="json").json()["secret"]
    everything = json.dumps([[e.object_name, e.before, e.after] for e in AuditEntry.objects.all()])
    for s in (secret, new_secret, rest_secret):
        assert s not in everything and apikey_hash(s) not in everything
    assert "secret_hash" not in everything


def test_django_admin_change_and_revoke_action_record_admin(admin: Any, acme: Any, pool: Any) -> None:
    ent = make_entitlement(admin, acme, pool, "b", concurrency=4)
    key, _secret = apikey_create(actor=admin, entitlement=ent)
    client = Client()
    client.force_login(admin)
    form = {
        "name": "b", "tenant": acme.pk, "pool": pool.pk, "service_class": "spot", "slo_target_ms": 200,
        "tokens_per_second": 100, "kv_cache_gib": "2", "concurrency": 4, "created_at": "",
        "state_changes-TOTAL_FORMS": 0, "state_changes-INITIAL_FORMS": 0,
        "api_keys-TOTAL_FORMS": 0, "api_keys-INITIAL_FORMS": 0,
    }
    response = client.post(f"/django-admin/pools/tokenentitlement/{ent.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    entry = last(kind="TokenEntitlement", action="update")
    assert (entry.through, entry.actor_username, entry.before, entry.after) == (
        "admin", "root", {"service_class": "guaranteed"}, {"service_class": "spot"})
    response = client.post("/django-admin/tenancy/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    assert response.status_code == 302
    revoked = last(kind="ApiKey", action="update")
    assert (revoked.through, revoked.object_id, list(revoked.after)) == ("admin", str(key.pk), ["revoked_at"])


def test_user_roles_are_audited_and_logins_and_bookkeeping_are_not(admin: Any, acme: Any, owner: Any,
                                                                    member: Any, pool: Any) -> None:
    api = client_as(owner)
    start = AuditEntry.objects.count()
    response = api.post("/api/v1/memberships/", {"tenant": "acme", "user": member.username, "role": "owner"},
                        format="json")
    assert response.status_code in (200, 201), response.content
    role = last(kind="Membership", action="update")
    assert (role.object_name, role.before, role.after, role.actor_username, role.tenant_slug) == (
        "mark@acme", {"role": "member"}, {"role": "owner"}, "olivia", "acme")
    owner.is_staff = True
    owner.save()
    user_entry = last(kind="User", action="update")
    assert (user_entry.before, user_entry.after, user_entry.object_name) == (
        {"is_staff": False}, {"is_staff": True}, "olivia")
    assert user_entry.tenant_id is None  # a platform object: superusers alone see it
    count = AuditEntry.objects.count()
    assert count > start
    Client().login(username="olivia", password="olivia-pass-123")  # last_login moves
    big = make_entitlement(admin, acme, pool, "big", concurrency=64)  # Degraded: binding state only
    assert big.state == "Degraded"
    key, _ = apikey_create(actor=admin, entitlement=TokenEntitlement.objects.get(name="big"))
    count = AuditEntry.objects.count()
    apikeys_mark_used(used_at={key.pk: timezone.now()})
    big.state_reason = "checked again"
    big.save(update_fields=["state_reason"])
    assert AuditEntry.objects.count() == count


@pytest.mark.django_db(transaction=True)
def test_under_asgi_a_token_call_is_attributed_to_its_user(admin: Any, acme: Any, owner: Any, pool: Any) -> None:
    """As uvicorn serves the site: the middleware and the view run in threads of the ASGI handler, and the
    token is authenticated only inside the view."""
    import asyncio

    from django.test import AsyncClient
    from rest_framework.authtoken.models import Token

    token = Token.objects.create(user=owner).key
    body = {"name": "acme-asgi", "tenant": "acme", "pool": pool.name, "service_class": "spot",
            "slo_target_ms": 500, "tokens_per_second": 10, "kv_cache_gib": "1", "concurrency": 1}
    response = asyncio.run(AsyncClient().post("/api/v1/entitlements/", body, content_type="application/json",
                                              headers={"authorization": f"Token {token}"}))
    assert response.status_code == 201, response.content
    entry = last(kind="TokenEntitlement", object_name="acme-asgi")
    assert (entry.actor_username, entry.actor_id, entry.through) == ("olivia", owner.pk, "api")
