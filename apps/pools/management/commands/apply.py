"""``python manage.py apply -f FILE.yaml [-f MORE.yaml] [--as USER]``: apply TokenPool/TokenEntitlement manifests.

All documents of all files are validated first and written in one transaction; on any error nothing is
written, the errors go to stderr and the exit code is non-zero. ``-f -`` reads standard input. Each file is
bounded like a REST body (``MANIFEST_MAX_BYTES``; YAML aliases and deep nesting refused).
"""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from apps.pools.management.commands._actor import resolve_actor
from apps.pools.manifests import ManifestError, manifests_apply, manifests_parse
from apps.pools.manifests.limits import max_bytes


class Command(BaseCommand):
    help = "Apply TokenPool and TokenEntitlement manifests (idempotent; reports created/updated/unchanged)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("-f", "--filename", action="append", required=True, help="YAML file, or - for stdin")
        parser.add_argument("--as", dest="as_user", help="act as this user (default: the platform operator)")

    def handle(self, *args: Any, **options: Any) -> None:
        actor = resolve_actor(options["as_user"])
        documents: list[Any] = []
        origins: list[str] = []  # per document: "FILE, document N" so errors point into the right file
        for filename in options["filename"]:
            text = _read(filename)
            try:
                parsed = manifests_parse(text)
            except ManifestError as exc:
                raise CommandError(f"{filename}: {exc}") from exc
            documents.extend(parsed)
            origins.extend(f"{filename}, document {i}" for i in range(len(parsed)))
        try:
            result = manifests_apply(actor=actor, documents=documents)
        except ManifestError as exc:
            lines = []
            for issue in exc.issues:
                where = origins[issue.index] if issue.index is not None else "manifest"
                what = f" ({issue.kind} {issue.name!r})" if issue.kind else ""
                lines.append(f"{where}{what}: {issue.field + ': ' if issue.field else ''}{issue.message}")
            raise CommandError("nothing applied:\n" + "\n".join(lines)) from exc
        for doc in result.documents:
            self.stdout.write(f"{doc.kind}/{doc.name} {doc.action}")
        summary = result.summary()
        self.stderr.write(", ".join(f"{n} {a}" for a, n in summary.items()))


def _read(filename: str) -> str:
    """The file's text, read no further than one byte past the limit (a huge file is refused, not loaded)."""
    limit = max_bytes()
    try:
        if filename == "-":  # a text stream without a buffer (a test's StringIO) is read as text
            stdin = getattr(sys.stdin, "buffer", None)
            raw = stdin.read(limit + 1) if stdin is not None else sys.stdin.read(limit + 1).encode()
        else:
            with open(filename, "rb") as handle:
                raw = handle.read(limit + 1)
    except OSError as exc:
        raise CommandError(f"cannot read {filename}: {exc.strerror}") from exc
    if len(raw) > limit:
        raise CommandError(f"{filename}: larger than the limit of {limit} bytes (MANIFEST_MAX_BYTES)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CommandError(f"{filename}: not UTF-8 text") from exc
