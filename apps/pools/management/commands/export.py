"""``python manage.py export [-o FILE] [--tenant SLUG] [--as USER]``: write tenants, pools and entitlements as manifests."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.http import Http404

from apps.pools.management.commands._actor import resolve_actor
from apps.pools.manifests import manifests_export
from apps.tenancy.selectors import tenant_get


class Command(BaseCommand):
    help = "Export Tenant, TokenPool and TokenEntitlement manifests (multi-document YAML) that `apply` accepts."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("-o", "--output", help="file to write (default: standard output)")
        parser.add_argument("--tenant", help="only this tenant's entitlements and the pools they use")
        parser.add_argument("--as", dest="as_user", help="export what this user may see (default: everything)")

    def handle(self, *args: Any, **options: Any) -> None:
        actor = resolve_actor(options["as_user"])
        tenant = None
        if options["tenant"]:
            try:
                tenant = tenant_get(user=actor, slug=options["tenant"])
            except Http404 as exc:
                raise CommandError(f"unknown tenant {options['tenant']!r}") from exc
        text = manifests_export(user=actor, tenant=tenant)
        if options["output"]:
            try:
                with open(options["output"], "w", encoding="utf-8") as fh:
                    fh.write(text)
            except OSError as exc:
                raise CommandError(f"cannot write {options['output']}: {exc.strerror}") from exc
        else:
            self.stdout.write(text, ending="")
