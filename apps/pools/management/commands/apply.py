"""``python manage.py apply -f PATH [-f PATH ...] [-R] [--dry-run] [--as USER]``: apply Tenant, TokenPool and
TokenEntitlement manifests.

``-f`` names a file, a directory (its .yaml, .yml and .json files; ``-R`` descends into subdirectories) or
``-`` for standard input, and may be repeated. All files make one manifest (``apps.pools.manifests.sources``:
a document repeated identically counts once; two different documents for one object are refused, naming
both places). Everything is validated first and written in one transaction; on any error nothing is
written, the errors go to stderr and the exit code is non-zero. Each file is bounded like a REST body
(``MANIFEST_MAX_BYTES``; YAML aliases and deep nesting refused).

Output, one line per object on stdout: ``Kind/name created``, ``Kind/name updated (fields: spec.a, spec.b)``
or ``Kind/name unchanged`` (`` (dry run)`` appended with ``--dry-run``, which writes nothing); on stderr a
``warning:`` line for every entitlement left Pending or Degraded, with its binding's reason, and a summary.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from apps.pools.management.commands._actor import add_manifest_arguments, resolve_actor
from apps.pools.manifests import ApplyResult, ManifestError, manifests_apply
from apps.pools.manifests.sources import SourceError, describe_issues, read_sources


class Command(BaseCommand):
    help = ("Apply Tenant, TokenPool and TokenEntitlement manifests from files, directories or stdin "
            "(idempotent; reports created/updated/unchanged per object).")

    def add_arguments(self, parser: Any) -> None:
        add_manifest_arguments(parser)
        parser.add_argument("--dry-run", action="store_true",
                            help="validate and report what would change, writing nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        actor = resolve_actor(options["as_user"])
        try:
            merged = read_sources(options["filename"], recursive=options["recursive"])
        except SourceError as exc:
            raise CommandError("\n".join(exc.problems)) from exc
        try:
            result = manifests_apply(actor=actor, documents=merged.documents, dry_run=options["dry_run"])
        except ManifestError as exc:
            raise CommandError("nothing applied:\n" + "\n".join(describe_issues(exc.issues, merged.origins))) from exc
        self._report(result)

    def _report(self, result: ApplyResult) -> None:
        suffix = " (dry run)" if result.dry_run else ""
        for doc in result.documents:
            fields = f" (fields: {', '.join(doc.fields)})" if doc.fields else ""
            self.stdout.write(f"{doc.kind}/{doc.name} {doc.action}{fields}{suffix}")
        for warning in result.warnings:
            self.stderr.write(f"warning: TokenEntitlement/{warning.name} is {warning.state}: {warning.reason}")
        summary = ", ".join(f"{n} {a}" for a, n in result.summary().items())
        self.stderr.write(summary + (" (dry run: nothing written)" if result.dry_run else ""))
