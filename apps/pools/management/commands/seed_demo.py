"""``python manage.py seed_demo``: idempotent demo data for ``make run``.

Creates (only what is missing): the operator superuser ``admin`` (password from the environment variable
``TOKENPOOLS_ADMIN_PASSWORD``, else generated and printed once), tenants ``acme`` and ``globex`` with one
owner each (``acme-owner``, ``globex-owner``; passwords from ``TOKENPOOLS_DEMO_PASSWORD`` or generated and
printed once), the tenants, pool and entitlements of ``examples/demo*.yaml`` applied through the same apply
service as ``manage.py apply``, and one API key per demo entitlement, printed once. A second run creates
nothing and says so.

``--write-keys FILE`` is a local-demo convenience for ``make run``: the load generator needs the secrets,
which the database only holds hashed. The command then also writes the keys it creates to FILE as JSON
(``{"entitlement name": "secret"}``, mode 0600, merged into what FILE already holds), and an entitlement
whose key is missing from FILE (or no longer valid) gets a new one, since an existing key cannot be read back.
Keep FILE under ``var/`` (gitignored) and never use this outside a local demo.
"""

from __future__ import annotations

import json
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
from apps.tenancy.selectors import apikey_resolve
from apps.tenancy.services import SYSTEM, apikey_create

DEMO_TENANTS = (("acme", "Acme Corp"), ("globex", "Globex Corporation"))


class Command(BaseCommand):
    help = "Create the demo tenants, users, pool, entitlements and API keys (idempotent)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--examples", default=str(Path(settings.BASE_DIR) / "examples"),
                            help="folder with the demo*.yaml manifests")
        parser.add_argument("--write-keys", metavar="FILE", default=None,
                            help="local demo only: also write the demo keys as JSON to FILE (mode 0600)")

    def handle(self, *args: Any, **options: Any) -> None:
        files = sorted(Path(options["examples"]).glob("demo*.yaml"))
        if not files:
            raise CommandError(f"no demo*.yaml manifests in {options['examples']}")
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
            keys_file = Path(options["write_keys"]) if options["write_keys"] else None
            self._keys(names, keys_file)

    def _password(self, setting: str) -> tuple[str, bool]:
        given = getattr(settings, setting)
        return (given, False) if given else (generated_password(), True)

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

    def _keys(self, entitlement_names: list[str], keys_file: Path | None) -> None:
        known = _read_keys(keys_file) if keys_file is not None else {}
        written: dict[str, str] = {}
        for ent in TokenEntitlement.objects.filter(name__in=entitlement_names).order_by("name"):
            if keys_file is not None:
                resolved = apikey_resolve(secret=known[ent.name]) if ent.name in known else None
                if resolved is not None and resolved.entitlement_id == ent.pk:
                    self.stdout.write(f"API key for {ent.name} already in {keys_file}")
                    continue
            elif ApiKey.objects.filter(entitlement=ent, revoked_at__isnull=True).exists():
                self.stdout.write(f"API key for {ent.name} already exists (not shown again)")
                continue
            _key, secret = apikey_create(actor=SYSTEM, entitlement=ent, name="demo")
            self.stdout.write(f"API key for {ent.name} ({ent.state}): {secret}")
            written[ent.name] = secret
        if keys_file is not None and written:
            _write_keys(keys_file, {**known, **written})
            self.stdout.write(f"wrote {len(written)} demo key(s) to {keys_file} (local demo only)")


def _read_keys(path: Path) -> dict[str, str]:
    """The keys FILE already holds; an unreadable or foreign file counts as empty (it is rewritten)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, str)}


def _write_keys(path: Path, keys: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # Created 0600 from the start (not chmod-ed afterwards) so the secrets are never readable by others,
    # then renamed over the old file so a reader never sees half a file.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(keys, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.chmod(tmp, 0o600)  # an older tmp file keeps its mode through O_CREAT
    os.replace(tmp, path)


def generated_password() -> str:
    """A random password that never starts with `-`: one printed for a person to paste after an option
    (`demo_screenshot --password ...`) would otherwise be read as an option (1 in 64 of them)."""
    while (password := secrets.token_urlsafe(12)).startswith("-"):
        pass
    return password
