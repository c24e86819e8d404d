"""Settings come from the environment; production refuses to start without its secrets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_settings(env_overrides: dict[str, str], drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("DJANGO_")}
    env.update(env_overrides)
    code = (
        "import django, json; from django.conf import settings; django.setup();"
        "db = settings.DATABASES['default'];"
        "print(json.dumps({'engine': db['ENGINE'], 'name': str(db['NAME']), 'debug': settings.DEBUG,"
        " 'state': settings.GATEWAY_STATE_BACKEND, 'layer': settings.CHANNEL_LAYERS['default']['BACKEND']}))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**env, "DJANGO_SETTINGS_MODULE": "tokenpools_site.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )


SECRETS = ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEPLOYMENT")


def test_embedded_default_uses_sqlite_memory_state_and_memory_layer() -> None:
    result = _load_settings({}, drop=SECRETS)
    assert result.returncode == 0, result.stderr
    assert '"engine": "django.db.backends.sqlite3"' in result.stdout
    assert '"state": "memory"' in result.stdout
    assert "InMemoryChannelLayer" in result.stdout


def test_database_and_redis_urls_are_honoured_in_embedded_mode() -> None:
    result = _load_settings(
        {"DATABASE_URL": "postgres://u:p@127.0.0.1:5999/tp", "REDIS_URL": "redis://127.0.0.1:6999/0"},
        drop=("DEPLOYMENT", "SECRET_KEY"),
    )
    assert result.returncode == 0, result.stderr
    assert "postgresql" in result.stdout
    assert '"state": "redis"' in result.stdout
    assert "RedisChannelLayer" in result.stdout


@pytest.mark.parametrize(
    "given, missing",
    [
        ({}, ["DATABASE_URL", "REDIS_URL", "SECRET_KEY"]),
        ({"DATABASE_URL": "sqlite:////tmp/x.db"}, ["REDIS_URL", "SECRET_KEY"]),
        ({"DATABASE_URL": "sqlite:////tmp/x.db", "REDIS_URL": "redis://127.0.0.1:1/0"}, ["SECRET_KEY"]),
    ],
)
def test_production_refuses_to_start_and_names_what_is_missing(given: dict[str, str], missing: list[str]) -> None:
    result = _load_settings({"DEPLOYMENT": "production", **given}, drop=SECRETS)
    assert result.returncode != 0
    assert "refuses to start" in result.stderr
    for name in missing:
        assert name in result.stderr
    for name in set(given) - set(missing):
        assert f" {name}" not in result.stderr.split("refuses to start")[-1]


def test_production_starts_with_everything_given_and_turns_debug_off() -> None:
    result = _load_settings(
        {
            "DEPLOYMENT": "production",
            "DATABASE_URL": "sqlite:////tmp/tokenpools-prod-check.db",
            "REDIS_URL": "redis://127.0.0.1:6999/0",
            "SECRET_KEY": "x" * 50,
        },
        drop=SECRETS,
    )
    assert result.returncode == 0, result.stderr
    assert '"debug": false' in result.stdout


def test_unknown_deployment_is_a_clear_error() -> None:
    result = _load_settings({"DEPLOYMENT": "staging"}, drop=SECRETS)
    assert result.returncode != 0
    assert "DEPLOYMENT must be" in result.stderr
