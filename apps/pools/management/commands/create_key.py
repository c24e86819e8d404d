"""``python manage.py create_key --entitlement NAME [--name LABEL] [--expires-in-days N]``, or
``python manage.py create_key --rotate ID [--grace-s SECONDS]`` for a new secret replacing key ID (which keeps
working for the grace period: a day unless told; 0 revokes it at once).

Prints the new secret once and nothing else on stdout, so scripts can capture it
(``KEY=$(python manage.py create_key --entitlement acme-guaranteed)``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from apps.audit.context import acting
from apps.pools.models import TokenEntitlement
from apps.tenancy.models import ApiKey
from apps.tenancy.services import DEFAULT_ROTATION_GRACE_S, SYSTEM, apikey_create, apikey_rotate


class Command(BaseCommand):
    help = ("Create an API key for an entitlement, or rotate one (--rotate ID), and print the new secret (shown "
            "only this once).")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--entitlement", help="entitlement name (for a new key)")
        parser.add_argument("--name", default="", help="a label for the key")
        parser.add_argument("--expires-in-days", type=int, default=None)
        parser.add_argument("--rotate", type=int, metavar="ID", help="replace key ID by a new secret")
        parser.add_argument("--grace-s", type=int, default=DEFAULT_ROTATION_GRACE_S, metavar="SECONDS",
                            help="with --rotate: how long the replaced secret keeps working (0: revoked at once)")

    def handle(self, *args: Any, **options: Any) -> None:
        with acting(channel="command", user=SYSTEM):  # the audit log's who and through what
            self._handle(options)

    def _handle(self, options: dict[str, Any]) -> None:
        if options["rotate"] is not None:
            if options["entitlement"] or options["expires_in_days"] is not None or options["name"]:
                raise CommandError("--rotate keeps the key's entitlement, name and expiry: give only --grace-s")
            self._rotate(options["rotate"], options["grace_s"])
            return
        if not options["entitlement"]:
            raise CommandError("give --entitlement NAME (a new key) or --rotate ID")
        try:
            entitlement = TokenEntitlement.objects.select_related("tenant").get(name=options["entitlement"])
        except TokenEntitlement.DoesNotExist as exc:
            raise CommandError(f"no entitlement named {options['entitlement']!r}") from exc
        expires_at = None
        days = options["expires_in_days"]
        if days is not None:
            if days <= 0:
                raise CommandError("--expires-in-days must be positive")
            expires_at = timezone.now() + timedelta(days=days)
        try:
            _key, secret = apikey_create(actor=SYSTEM, entitlement=entitlement, name=options["name"],
                                         expires_at=expires_at)
        except ValidationError as exc:
            raise CommandError("; ".join(f"{k}: {', '.join(v)}" for k, v in exc.message_dict.items())) from exc
        self.stdout.write(secret)

    def _rotate(self, key_id: int, grace_s: int) -> None:
        try:
            key = ApiKey.objects.select_related("tenant", "entitlement").get(pk=key_id)
        except ApiKey.DoesNotExist as exc:
            raise CommandError(f"no key with id {key_id}") from exc
        try:
            _new, secret = apikey_rotate(actor=SYSTEM, key=key, grace_s=grace_s)
        except ValidationError as exc:
            raise CommandError("; ".join(f"{k}: {', '.join(v)}" for k, v in exc.message_dict.items())) from exc
        self.stdout.write(secret)
