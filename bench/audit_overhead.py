"""What the audit log adds to `manage.py apply` (`python -m bench.audit_overhead N on|off`): N spot entitlements
on examples/demo.yaml's pool, applied created, then updated (each one's concurrency), then unchanged, on a fresh
SQLite file, with the audit receivers connected (on) or disconnected (off). Run on and off alternately a few
times: on a shared machine one run's noise exceeds the difference. Figures are printed, never asserted."""

from __future__ import annotations

import io
import os
import sys
import tempfile
import time
from pathlib import Path


def main(n: int, audit: bool) -> None:
    os.environ["DATABASE_URL"] = f"sqlite:///{tempfile.mkdtemp()}/db.sqlite3"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokenpools_site.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db.models.signals import post_delete, post_save, pre_save

    from apps.audit import recorder
    from apps.audit.models import AuditEntry

    call_command("migrate", verbosity=0)
    if not audit:
        for model in list(recorder._fields):
            uid = f"audit:{model._meta.label}"
            pre_save.disconnect(sender=model, dispatch_uid=uid)
            post_save.disconnect(sender=model, dispatch_uid=uid)
            post_delete.disconnect(sender=model, dispatch_uid=uid)
    head = Path("examples/demo.yaml").read_text().split("# Demo entitlements")[0]
    folder = Path(tempfile.mkdtemp())
    for label, concurrency in (("created", 1), ("updated", 2), ("unchanged", 2)):
        docs = [f"apiVersion: tokenpools.io/v1alpha1\nkind: TokenEntitlement\nmetadata: {{name: e{i:05d}}}\nspec:\n"
                f"  tenantId: acme\n  poolRef: {{name: demo-pool}}\n  qos: {{serviceClass: spot, sloTargetMs: 500}}\n"
                f"  resources: {{tokensPerSecond: 10, kvCacheGiB: 0.01, concurrency: {concurrency}}}\n"
                for i in range(n)]
        path = folder / f"{label}.yaml"
        path.write_text(head + "---\n" + "---\n".join(docs))
        start = time.perf_counter()
        call_command("apply", "-f", str(path), stdout=io.StringIO(), stderr=io.StringIO())
        print(f"N={n} audit={'on' if audit else 'off'} {label}: {time.perf_counter() - start:.2f} s "
              f"({AuditEntry.objects.count()} audit entries)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, (sys.argv[2] if len(sys.argv) > 2 else "on") == "on")
