"""``python manage.py delete -f PATH [-f PATH ...] [-R] [--cascade] [--ignore-not-found] [--dry-run] [--as USER]``:
delete the Tenant, TokenPool and TokenEntitlement objects the manifests name, as ``kubectl delete -f`` does.

The files are read as ``apply`` reads them (``apps.pools.manifests.sources``: the same bounds and messages);
only each document's ``apiVersion``, ``kind`` and ``metadata.name`` matter. Entitlements go first, then pools,
then tenants, through the REST API's delete services, in one transaction: any refusal deletes nothing. A pool
or tenant still used by entitlements the files do not name is refused, naming them, unless ``--cascade``.

Output: ``Kind/name deleted`` per object on stdout (`` (cascade)`` for an entitlement deleted because of
``--cascade``; `` (dry run)`` with ``--dry-run``, which deletes nothing). An object that does not exist (or that
``--as`` may not see) is reported on stderr as ``Kind/name not found``; as with kubectl that is an error (exit
1) only when nothing at all was found, and ``--ignore-not-found`` makes it silent and never an error.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from apps.audit.context import acting
from apps.pools.management.commands._actor import add_manifest_arguments, resolve_actor
from apps.pools.manifests import ManifestError
from apps.pools.manifests.delete import DeleteResult, manifests_delete
from apps.pools.manifests.sources import SourceError, describe_issues, read_sources


class Command(BaseCommand):
    help = ("Delete the Tenant, TokenPool and TokenEntitlement objects named in manifest files, directories or "
            "stdin (entitlements, then pools, then tenants; all or nothing).")

    def add_arguments(self, parser: Any) -> None:
        add_manifest_arguments(parser)
        parser.add_argument("--cascade", action="store_true",
                            help="also delete the entitlements outside the files that use a pool or tenant deleted")
        parser.add_argument("--ignore-not-found", action="store_true",
                            help="say nothing of objects that do not exist, and succeed when none does")
        parser.add_argument("--dry-run", action="store_true", help="report what would be deleted, deleting nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        actor = resolve_actor(options["as_user"])
        try:
            merged = read_sources(options["filename"], recursive=options["recursive"])
        except SourceError as exc:
            raise CommandError("\n".join(exc.problems)) from exc
        try:
            with acting(channel="delete", user=actor):  # the audit log's who and through what
                result = manifests_delete(actor=actor, documents=merged.documents, cascade=options["cascade"],
                                          dry_run=options["dry_run"])
        except ManifestError as exc:
            problems = "\n".join(describe_issues(exc.issues, merged.origins))
            raise CommandError("nothing deleted:\n" + problems) from exc
        self._report(result, ignore_not_found=options["ignore_not_found"])

    def _report(self, result: DeleteResult, *, ignore_not_found: bool) -> None:
        suffix = " (dry run)" if result.dry_run else ""
        for item in result.deleted:
            because = f" ({item.reason})" if item.reason else ""
            self.stdout.write(f"{item.kind}/{item.name} deleted{because}{suffix}")
        if ignore_not_found:
            return
        for kind, name in result.not_found:
            self.stderr.write(f"{kind}/{name} not found")
        if not result.deleted:
            raise CommandError("none of the objects the files name exists (--ignore-not-found accepts that)")
