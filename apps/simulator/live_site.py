"""The real site in a subprocess: a fresh SQLite database, migrated, given tenants, manifests and keys, and
served by ``manage.py serve`` on a free port. Used by the live experiments, end-to-end tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from apps.simulator.processes import free_port, stop_process_group, wait_for_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class PreparedSite:
    env: dict[str, str]
    keys: dict[str, str]
    workdir: Path
    # The source tree the site runs from (another commit's checkout, for a side-by-side benchmark).
    repo: Path = REPO


def manage(env: dict[str, str], *args: str, repo: Path = REPO) -> str:
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=repo, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def prepare_site(
    workdir: Path, *, tenants: Sequence[str], manifest: str | Sequence[str], key_for: Sequence[str],
    env: dict[str, str] | None = None, repo: Path = REPO, database: str = "site.sqlite3",
) -> PreparedSite:
    """Migrate a new SQLite database in `workdir`, create `tenants` (slugs), apply `manifest` (YAML; several
    texts: one file each, applied as one directory, for a set larger than one file may be) and create one API
    key per entitlement named in `key_for`."""
    site_env = {**os.environ, "DATABASE_URL": f"sqlite:///{workdir / database}", "LOG_LEVEL": "WARNING",
                **(env or {})}
    site_env.pop("DJANGO_SETTINGS_MODULE", None)
    # The experiments read the per-entitlement gauges, which /metrics only shows to the token's holder.
    if not site_env.get("METRICS_TOKEN"):
        site_env["METRICS_TOKEN"] = secrets.token_urlsafe(24)
    manage(site_env, "migrate", "--noinput", repo=repo)
    script = "; ".join(
        f"tenant_create(actor=SYSTEM, name={slug.title()!r}, slug={slug!r})" for slug in tenants
    )
    manage(site_env, "shell", "-c", f"from apps.tenancy.services import tenant_create, SYSTEM; {script}", repo=repo)
    manifest_path = workdir / f"{Path(database).stem}-manifests"
    shutil.rmtree(manifest_path, ignore_errors=True)
    manifest_path.mkdir(parents=True)
    for index, text in enumerate([manifest] if isinstance(manifest, str) else manifest):
        (manifest_path / f"{index:05d}.yaml").write_text(text)
    manage(site_env, "apply", "-f", str(manifest_path), repo=repo)
    keys = {name: manage(site_env, "create_key", "--entitlement", name, repo=repo).strip() for name in key_for}
    return PreparedSite(site_env, keys, workdir, repo)


@contextlib.contextmanager
def serving(site: PreparedSite, *, env: dict[str, str] | None = None, log_name: str = "serve.log",
            cpu_core: str | None = None, workers: int = 1) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `manage.py serve` for the prepared site (`workers` uvicorn processes); yield (base URL, process)."""
    port = free_port()
    cmd = [sys.executable, "manage.py", "serve", "--port", str(port), "--log-level", "warning",
           "--workers", str(workers)]
    with _site_process(site, cmd, env=env, log_name=log_name, cpu_core=cpu_core) as proc:
        wait_for_port(port, timeout_s=60, proc=proc)
        yield f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def running_ticks(site: PreparedSite, *, env: dict[str, str] | None = None, log_name: str = "ticks.log",
                  cpu_core: str | None = None, nice: int = 0) -> Iterator[subprocess.Popen]:
    """Run `manage.py run_ticks` for the prepared site: the periodic ticks (EWMA, AIMD, ...) that Celery beat
    runs in a deployment with a broker, where `serve` leaves them to it (a Redis URL is such a broker); on
    `cpu_core` when given, at the scheduling priority `nice` (19: it yields to whatever else wants the core)."""
    with _site_process(site, [sys.executable, "manage.py", "run_ticks"], env=env, log_name=log_name,
                       cpu_core=cpu_core, nice=nice) as proc:
        yield proc


@contextlib.contextmanager
def _site_process(site: PreparedSite, cmd: list[str], *, env: dict[str, str] | None, log_name: str,
                  cpu_core: str | None = None, nice: int = 0) -> Iterator[subprocess.Popen]:
    """`cmd` in the site's environment (plus `env`), logged to `log_name`, stopped with its group at exit; pinned
    to `cpu_core` (a taskset list) when given, at the scheduling priority `nice`."""
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    if cpu_core is not None:
        cmd = ["taskset", "-c", cpu_core, *cmd]
    log = open(site.workdir / log_name, "w")  # noqa: SIM115  (closed in finally)
    proc = subprocess.Popen(cmd, cwd=site.repo, env={**site.env, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_process_group(proc)
        log.close()


def server_log(site: PreparedSite, log_name: str = "serve.log") -> str:
    path = site.workdir / log_name
    return path.read_text(errors="replace") if path.exists() else ""
