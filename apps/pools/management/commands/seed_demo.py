"""``python manage.py seed_demo``: idempotent demo data for ``make run``.

Creates (only what is missing): the operator superuser ``admin`` (password from the environment variable
``TOKENPOOLS_ADMIN_PASSWORD``, else generated and printed once), tenants ``acme`` and ``globex`` with one
owner each (``acme-owner``, ``globex-owner``; passwords from ``TOKENPOOLS_DEMO_PASSWORD`` or generated and
printed once), the pool and entitlements of ``examples/demo-*.yaml`` applied through the same apply
service as ``manage.py apply``, and one API key per demo entitlement, printed once. A second run creates
nothing and says so.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from apps.pools.manifests import ManifestError, manifests_apply, manifests_parse
from apps.pools.models import TokenEntitlement
from apps.tenancy.models import ApiKey, Membership, Role, Tenant
from apps.tenancy.services import SYSTEM, apikey_create

DEMO_TENANTS = (("acme", "Acme Corp"), ("globex", "Globex Corporation"))


class Command(BaseCommand):
    help = "Create the demo tenants, users, pool, entitlements and API keys (idempotent)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--examples", default=str(Path(settings.BASE_DIR) / "examples"),
                            help="folder with the demo-*.yaml manifests")

    def handle(self, *args: Any, **options: Any) -> None:
        files = sorted(Path(options["examples"]).glob("demo-*.yaml"))
        if not files:
            raise CommandError(f"no demo-*.yaml manifests in {options['examples']}")
        documents: list[Any] = []
        for path in files:
            try:
                documents.extend(manifests_parse(path.read_text(encoding="utf-8")))
            except ManifestError as exc:
                raise CommandError(f"{path}: {exc}") from exc
        with transaction.atomic():
            self._users_and_tenants()
            try:
                result = manifests_apply(actor=SYSTEM, documents=documents)
            except ManifestError as exc:
                raise CommandError("demo manifests rejected:\n" + str(exc)) from exc
            for doc in result.documents:
                self.stdout.write(f"{doc.kind}/{doc.name} {doc.action}")
            names = [d.name for d in result.documents if d.kind == "TokenEntitlement"]
            self._keys(names)

    def _password(self, env_name: str) -> tuple[str, bool]:
        given = os.environ.get(env_name)
        return (given, False) if given else (secrets.token_urlsafe(12), True)

    def _users_and_tenants(self) -> None:
        User = get_user_model()
        admin = User.objects.filter(username="admin").first()
        if admin is None:
            password, generated = self._password("TOKENPOOLS_ADMIN_PASSWORD")
            User.objects.create_superuser("admin", "admin@example.com", password)
            shown = password if generated else "(from TOKENPOOLS_ADMIN_PASSWORD)"
            self.stdout.write(f"created superuser admin, password: {shown}")
        else:
            self.stdout.write("superuser admin already exists")
        for slug, name in DEMO_TENANTS:
            tenant, created = Tenant.objects.get_or_create(slug=slug, defaults={"name": name})
            self.stdout.write(f"tenant {slug} {'created' if created else 'already exists'}")
            username = f"{slug}-owner"
            user = User.objects.filter(username=username).first()
            if user is None:
                password, generated = self._password("TOKENPOOLS_DEMO_PASSWORD")
                user = User.objects.create_user(username, f"{username}@example.com", password)
                shown = password if generated else "(from TOKENPOOLS_DEMO_PASSWORD)"
                self.stdout.write(f"created user {username} (owner of {slug}), password: {shown}")
            Membership.objects.get_or_create(tenant=tenant, user=user, defaults={"role": Role.OWNER})

    def _keys(self, entitlement_names: list[str]) -> None:
        for ent in TokenEntitlement.objects.filter(name__in=entitlement_names).order_by("name"):
            if ApiKey.objects.filter(entitlement=ent, revoked_at__isnull=True).exists():
                self.stdout.write(f"API key for {ent.name} already exists (not shown again)")
                continue
            _key, secret = apikey_create(actor=SYSTEM, entitlement=ent, name="demo")
            self.stdout.write(f"API key for {ent.name} ({ent.state}): {secret}")
