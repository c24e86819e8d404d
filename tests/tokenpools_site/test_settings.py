"""Settings come from the environment, parsed strictly; production refuses to start without its secrets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

REPO = Path(__file__).resolve().parents[2]


SUMMARY = (
    "import django, json; from django.conf import settings; django.setup();"
    "db = settings.DATABASES['default'];"
    "print(json.dumps({'engine': db['ENGINE'], 'name': str(db['NAME']), 'debug': settings.DEBUG,"
    " 'state': settings.GATEWAY_STATE_BACKEND, 'layer': settings.CHANNEL_LAYERS['default']['BACKEND']}))"
)
# The gateway's configuration as built from the settings, next to GatewayConfig's own field defaults.
GATEWAY = (
    "import dataclasses, django, json; django.setup();"
    "from django.conf import settings; from apps.gateway.config import GatewayConfig;"
    "print(json.dumps({'settings': dataclasses.asdict(GatewayConfig.from_settings()),"
    " 'fields': dataclasses.asdict(GatewayConfig()), 'ticks': settings.TOKENPOOLS_TICK_PERIODS,"
    " 'hosts': settings.ALLOWED_HOSTS, 'log_level': settings.LOGGING['root']['level'],"
    " 'mode': settings.TOKENPOOLS_TICKS}))"
)


def _load_settings(
    env_overrides: dict[str, str], drop: tuple[str, ...] = (), code: str = SUMMARY
) -> subprocess.CompletedProcess[str]:
    # The project's own variables are dropped too, so that the caller's shell cannot change the outcome.
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("DJANGO_", "GATEWAY_", "TOKENPOOLS_"))}
    env.update(env_overrides)
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
    result = _load_settings({}, drop=(*SECRETS, "DEBUG"))
    assert result.returncode == 0, result.stderr
    assert '"debug": false' in result.stdout  # debug pages show the settings: only on when DEBUG=1 asks
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


@pytest.mark.parametrize(
    "given, named",
    [
        ({"GATEWAY_FAIL_OPEN": "maybe"}, "GATEWAY_FAIL_OPEN must be a boolean (1/0, true/false, yes/no, on/off), got 'maybe'"),
        ({"GATEWAY_TOKENIZE": "ture"}, "GATEWAY_TOKENIZE must be a boolean"),
        ({"GATEWAY_ACQUIRE_TIMEOUT_S": "abc"}, "GATEWAY_ACQUIRE_TIMEOUT_S must be a number, got 'abc'"),
        ({"GATEWAY_MAX_BODY_BYTES": "2.5"}, "GATEWAY_MAX_BODY_BYTES must be a whole number, got '2.5'"),
        ({"GATEWAY_SNAPSHOT_POLL_S": "nan"}, "GATEWAY_SNAPSHOT_POLL_S must be a finite number, got 'nan'"),
        ({"TOKENPOOLS_TICK_EWMA_S": "-1"}, "TOKENPOOLS_TICK_EWMA_S must be above 0, got '-1'"),
        ({"TOKENPOOLS_TICK_EWAM_S": "1"}, "TOKENPOOLS_TICK_EWAM_S: no such tick"),
        ({"TOKENPOOLS_TICKS": "sometimes"}, "TOKENPOOLS_TICKS must be one of auto, celery, in-process, off"),
        ({"GATEWAY_STATE_BACKEND": "postgres"}, "GATEWAY_STATE_BACKEND must be one of memory, redis, got 'postgres'"),
        ({"GATEWAY_BUDGET_MIN_FRACTION": "1.5"}, "GATEWAY_BUDGET_MIN_FRACTION must be at most 1, got '1.5'"),
        ({"GATEWAY_LEASE_S": "5", "GATEWAY_LEASE_RENEW_S": "5"}, "GATEWAY_LEASE_RENEW_S (5) must be below GATEWAY_LEASE_S (5)"),
        ({"DB_CONN_MAX_AGE": "forever"}, "DB_CONN_MAX_AGE must be a whole number, got 'forever'"),
        ({"DEBUG": "enabled"}, "DEBUG must be a boolean"),
    ],
)
def test_a_bad_value_stops_start_up_naming_the_variable(given: dict[str, str], named: str) -> None:
    result = _load_settings(given, drop=SECRETS)
    assert result.returncode != 0
    assert "django.core.exceptions.ImproperlyConfigured: " + named in result.stderr, result.stderr[-2000:]


def test_good_values_parse_in_any_case_with_blanks() -> None:
    result = _load_settings(
        {
            "GATEWAY_FAIL_OPEN": " YES ", "GATEWAY_TOKENIZE": "off", "GATEWAY_SATURATION_ADMISSION": "0",
            "GATEWAY_ACQUIRE_TIMEOUT_S": "2.5", "GATEWAY_MAX_BODY_BYTES": "2_000_000",
            "GATEWAY_DRAIN_TIMEOUT_S": "5", "GATEWAY_LEASE_S": "20", "GATEWAY_LEASE_RENEW_S": "7.5",
            "GATEWAY_STATE_BACKEND": "Memory", "TOKENPOOLS_TICK_EWMA_S": "0.25", "TOKENPOOLS_TICK_USAGE_ROLLUP_S": "60",
            "TOKENPOOLS_TICKS": "OFF", "ALLOWED_HOSTS": " a.example, ,b.example ", "LOG_LEVEL": "warning",
            # Empty counts as unset: the default.
            "GATEWAY_CONTEXT_WINDOW": "",
        },
        drop=SECRETS,
        code=GATEWAY,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    config = out["settings"]
    assert (config["fail_open"], config["tokenize"], config["saturation_admission"]) == (True, False, False)
    assert (config["acquire_timeout_s"], config["max_body_bytes"]) == (2.5, 2_000_000)
    assert (config["drain_timeout_s"], config["lease_s"], config["lease_renew_s"]) == (5.0, 20.0, 7.5)
    assert (config["state_backend"], config["context_window"]) == ("memory", 4096)
    assert out["ticks"]["ewma"] == 0.25 and out["ticks"]["usage_rollup"] == 60.0 and out["ticks"]["aimd"] == 5.0
    assert out["mode"] == "off"
    assert out["hosts"] == ["a.example", "b.example"]
    assert out["log_level"] == "WARNING"


def test_gateway_settings_default_to_the_gateway_config_fields() -> None:
    result = _load_settings({}, drop=SECRETS, code=GATEWAY)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["settings"] == out["fields"]
    assert (out["settings"]["drain_timeout_s"], out["settings"]["lease_s"], out["settings"]["lease_renew_s"]) == (
        30.0, 10.0, 3.0)
    assert out["mode"] == "auto"
    assert out["ticks"] == {"ewma": 1.0, "aimd": 5.0, "scrape": 5.0, "autoscale": 15.0, "expiry": 30.0,
                            "usage_rollup": 300.0, "request_log": 600.0,
                            "request_log_drain": 2.0, "dashboard": 1.0}


def test_the_gateway_reads_only_django_settings(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.gateway.config import GatewayConfig

    monkeypatch.setenv("GATEWAY_ACQUIRE_TIMEOUT_S", "99")  # the environment is read once, by the settings module
    settings.GATEWAY_ACQUIRE_TIMEOUT_S = 4.5
    config = GatewayConfig.from_settings(fail_open=True)
    assert (config.acquire_timeout_s, config.fail_open) == (4.5, True)
    settings.GATEWAY_LEASE_RENEW_S = settings.GATEWAY_LEASE_S
    with pytest.raises(ImproperlyConfigured, match="GATEWAY_LEASE_RENEW_S"):
        GatewayConfig.from_settings()
