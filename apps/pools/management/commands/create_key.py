"""``python manage.py create_key --entitlement NAME [--name LABEL] [--expires-in-days N]``.

Prints the new secret once and nothing else on stdout, so scripts can capture it
(``KEY=$(python manage.py create_key --entitlement acme-guaranteed)``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from apps.pools.models import TokenEntitlement
from apps.tenancy.services import SYSTEM, apikey_create


class Command(BaseCommand):
    help = "Create an API key for an entitlement and print its secret (shown only this once)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--entitlement", required=True, help="entitlement name")
        parser.add_argument("--name", default="", help="a label for the key")
        parser.add_argument("--expires-in-days", type=int, default=None)

    def handle(self, *args: Any, **options: Any) -> None:
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
