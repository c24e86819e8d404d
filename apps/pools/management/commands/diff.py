"""``python manage.py diff -f PATH [-f PATH ...] [-R] [--as USER]``: what applying the manifests would change,
as ``kubectl diff`` shows it.

For every object the files name, a unified diff of the object as stored against the object as the apply would
store it, both written as manifests (the export's field names), on stdout; nothing is written. The exit code is
kubectl's: 0 when nothing would change, 1 when something would, 2 on an error (bad input, or a manifest the
apply would refuse, with the same messages as ``apply``).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from apps.pools.management.commands._actor import add_manifest_arguments, resolve_actor
from apps.pools.manifests import ManifestError, manifests_apply
from apps.pools.manifests.sources import SourceError, describe_issues, read_sources

EXIT_DIFFERENT = 1
EXIT_ERROR = 2


class Command(BaseCommand):
    help = ("Show what applying Tenant, TokenPool and TokenEntitlement manifests would change, as a unified diff "
            "per object (exit 0: no change, 1: changes, 2: error); writes nothing.")

    def add_arguments(self, parser: Any) -> None:
        add_manifest_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            actor = resolve_actor(options["as_user"])
            merged = read_sources(options["filename"], recursive=options["recursive"])
        except SourceError as exc:
            raise CommandError("\n".join(exc.problems), returncode=EXIT_ERROR) from exc
        except CommandError as exc:
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
        try:
            result = manifests_apply(actor=actor, documents=merged.documents, compare=True)
        except ManifestError as exc:
            problems = "\n".join(describe_issues(exc.issues, merged.origins))
            raise CommandError("cannot diff:\n" + problems, returncode=EXIT_ERROR) from exc
        changed = [diff for diff in result.diffs if diff.changed]
        for diff in changed:
            self.stdout.write(diff.unified(), ending="")
        if changed:
            self.stdout.flush()
            raise SystemExit(EXIT_DIFFERENT)
