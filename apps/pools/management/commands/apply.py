"""``python manage.py apply -f PATH [-f PATH ...] [-R] [--dry-run] [--prune --tenant SLUG] [--as USER]``: apply
Tenant, TokenPool and TokenEntitlement manifests.

``-f`` names a file, a directory (its .yaml, .yml and .json files; ``-R`` descends into subdirectories) or
``-`` for standard input, and may be repeated. All files make one manifest (``apps.pools.manifests.sources``:
a document repeated identically counts once; two different documents for one object are refused, naming
both places). Everything is validated first and written in one transaction; on any error nothing is
written, the errors go to stderr and the exit code is non-zero. Each file is bounded like a REST body
(``MANIFEST_MAX_BYTES``; YAML aliases and deep nesting refused).

Output, one line per object on stdout: ``Kind/name created``, ``Kind/name updated (fields: spec.a, spec.b)``
or ``Kind/name unchanged`` (`` (dry run)`` appended with ``--dry-run``, which writes nothing); on stderr a
``warning:`` line for every entitlement left Pending or Degraded, with its binding's reason, and a summary.

``--prune --tenant SLUG`` (kubectl's ``apply --prune`` with its required selector) then deletes, in the same
transaction, the tenant's entitlements the files do not name, through the REST API's delete service, printing
``TokenEntitlement/name pruned``; ``--prune`` without ``--tenant`` is refused.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from apps.audit.context import acting
from apps.pools.management.commands._actor import add_manifest_arguments, resolve_actor
from apps.pools.manifests import ApplyResult, ManifestError, manifests_apply
from apps.pools.manifests.delete import Deleted, manifests_apply_prune
from apps.pools.manifests.sources import SourceError, describe_issues, read_sources


class Command(BaseCommand):
    help = ("Apply Tenant, TokenPool and TokenEntitlement manifests from files, directories or stdin "
            "(idempotent; reports created/updated/unchanged per object; --prune --tenant SLUG also deletes that "
            "tenant's entitlements the files no longer name).")

    def add_arguments(self, parser: Any) -> None:
        add_manifest_arguments(parser)
        parser.add_argument("--dry-run", action="store_true",
                            help="validate and report what would change, writing nothing")
        parser.add_argument("--prune", action="store_true",
                            help="also delete the entitlements of the --tenant tenant that the files do not name")
        parser.add_argument("--tenant", metavar="SLUG", help="the tenant whose entitlements --prune deletes")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["prune"] and not options["tenant"]:
            raise CommandError("--prune needs --tenant SLUG: the tenant whose entitlements the files list in full")
        if options["tenant"] and not options["prune"]:
            raise CommandError("--tenant selects what --prune deletes; give --prune too")
        actor = resolve_actor(options["as_user"])
        try:
            merged = read_sources(options["filename"], recursive=options["recursive"])
        except SourceError as exc:
            raise CommandError("\n".join(exc.problems)) from exc
        pruned: list[Deleted] = []
        try:
            with acting(channel="apply", user=actor):  # the audit log's who and through what
                if options["prune"]:
                    result, pruned = manifests_apply_prune(actor=actor, documents=merged.documents,
                                                           tenant_slug=options["tenant"], dry_run=options["dry_run"])
                else:
                    result = manifests_apply(actor=actor, documents=merged.documents, dry_run=options["dry_run"])
        except ManifestError as exc:
            raise CommandError("nothing applied:\n" + "\n".join(describe_issues(exc.issues, merged.origins))) from exc
        self._report(result, pruned)

    def _report(self, result: ApplyResult, pruned: list[Deleted]) -> None:
        suffix = " (dry run)" if result.dry_run else ""
        for doc in result.documents:
            fields = f" (fields: {', '.join(doc.fields)})" if doc.fields else ""
            self.stdout.write(f"{doc.kind}/{doc.name} {doc.action}{fields}{suffix}")
        for item in pruned:
            self.stdout.write(f"{item.kind}/{item.name} pruned{suffix}")
        for warning in result.warnings:
            self.stderr.write(f"warning: TokenEntitlement/{warning.name} is {warning.state}: {warning.reason}")
        summary = ", ".join(f"{n} {a}" for a, n in result.summary().items())
        summary += f", {len(pruned)} pruned" if pruned else ""
        self.stderr.write(summary + (" (dry run: nothing written)" if result.dry_run else ""))
