"""Settings for tokenpools: every environment variable the project reads is read here, and only here.

Each variable has an embedded default and is parsed strictly by `tokenpools_site.env`: a bad boolean or
number stops start-up with `ImproperlyConfigured` naming the variable and the value. The README's
Configuration section lists them all. The rest of the code reads `django.conf.settings`.

Embedded default (``make run``): SQLite file, in-process gateway state, in-memory channel layer,
periodic ticks inside the server. ``DATABASE_URL`` and ``REDIS_URL`` are honoured whenever they are
set. With ``DEPLOYMENT=production`` the site refuses to start unless ``DATABASE_URL``, ``REDIS_URL``
and ``SECRET_KEY`` are all given.
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from tokenpools_site.env import env_bool, env_choice, env_float, env_int, env_list, env_names, env_str
from workers.ticks import DEFAULT_TICKS

BASE_DIR = Path(__file__).resolve().parent.parent

DEPLOYMENT = env_choice("DEPLOYMENT", "embedded", ("embedded", "production"))
PRODUCTION = DEPLOYMENT == "production"

if PRODUCTION:
    _missing = [name for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY") if not env_str(name, "")]
    if _missing:
        raise ImproperlyConfigured(
            "DEPLOYMENT=production refuses to start without " + ", ".join(_missing) + " in the environment"
        )

# The embedded key only exists so a fresh clone runs; production demands its own (checked above).
SECRET_KEY = env_str("SECRET_KEY", "embedded-insecure-key-do-not-use-in-production")
# Off unless asked for (DEBUG=1), embedded mode included: Django's debug pages show the settings to anyone.
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "testserver", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "apps.tenancy",
    "apps.pools",
    "apps.gateway",
    "apps.dashboard",
    "apps.simulator",
    "apps.audit",
    "workers",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # Before CommonMiddleware: /api/ paths are served with or without their trailing slash, for every method.
    "tokenpools_site.middleware.ApiTrailingSlashMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Who changes what, through which way in (apps.audit): after the session user is known.
    "apps.audit.middleware.AuditMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "tokenpools_site.urls"
ASGI_APPLICATION = "tokenpools_site.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"),
        conn_max_age=env_int("DB_CONN_MAX_AGE", 0, at_least=0),
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Binding locks the pool row; on SQLite a write transaction takes the whole file, wait for it. IMMEDIATE:
    # a transaction takes the write lock when it begins, so two processes (serve --workers 2) wait for each
    # other instead of one failing at once with "database is locked" when its read turns into a write.
    DATABASES["default"].setdefault("OPTIONS", {}).update({"timeout": 20, "transaction_mode": "IMMEDIATE"})

REDIS_URL = env_str("REDIS_URL", "")

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# The largest manifest `apply` takes (REST body, or each file of the CLI), in bytes (apps.pools.manifests.limits).
MANIFEST_MAX_BYTES = env_int("MANIFEST_MAX_BYTES", 1_048_576, at_least=1)
# The most recorded requests a What if (REST or page) replays inside one web request; `manage.py replay` has no bound.
WHATIF_MAX_RECORDS = env_int("WHATIF_MAX_RECORDS", 200_000, at_least=1)

CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL or "memory://")
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True

# --- gateway (apps.gateway.config.GatewayConfig.from_settings reads these) ---------------------------
# The defaults are GatewayConfig's own field defaults (tests/tokenpools_site/test_settings.py holds them equal).

# State store: in-process unless Redis is configured (one interface, two implementations).
# The gateway's state may live on a Redis of its own (a Redis Cluster with GATEWAY_REDIS_CLUSTER); empty: REDIS_URL.
# Celery, the channel layer, the cache and the control loops' state stay on REDIS_URL.
GATEWAY_REDIS_URL = env_str("GATEWAY_REDIS_URL", "")
GATEWAY_REDIS_CLUSTER = env_bool("GATEWAY_REDIS_CLUSTER", False)
GATEWAY_STATE_BACKEND = env_choice("GATEWAY_STATE_BACKEND", "redis" if GATEWAY_REDIS_URL or REDIS_URL else "memory",
                                   ("memory", "redis"))
GATEWAY_FAIL_OPEN = env_bool("GATEWAY_FAIL_OPEN", False)
GATEWAY_MAX_BODY_BYTES = env_int("GATEWAY_MAX_BODY_BYTES", 1_048_576, at_least=1)
GATEWAY_MAX_TOKENS_LIMIT = env_int("GATEWAY_MAX_TOKENS_LIMIT", 1_000_000, at_least=1)
GATEWAY_MAX_JSON_DEPTH = env_int("GATEWAY_MAX_JSON_DEPTH", 32, at_least=2)
GATEWAY_DEFAULT_MAX_TOKENS = env_int("GATEWAY_DEFAULT_MAX_TOKENS", 256, at_least=1)
GATEWAY_CONTEXT_WINDOW = env_int("GATEWAY_CONTEXT_WINDOW", 4096, at_least=1)
GATEWAY_TOKENIZE = env_bool("GATEWAY_TOKENIZE", True)
GATEWAY_SNAPSHOT_POLL_S = env_float("GATEWAY_SNAPSHOT_POLL_S", 0.5, above=0)
GATEWAY_AIMD_TICK_S = env_float("GATEWAY_AIMD_TICK_S", 5.0, above=0)
GATEWAY_AIMD_WINDOW_S = env_float("GATEWAY_AIMD_WINDOW_S", 30.0, above=0)
GATEWAY_TTFT_TARGET_S = env_float("GATEWAY_TTFT_TARGET_S", 2.0, above=0)
GATEWAY_BUDGET_MIN_FRACTION = env_float("GATEWAY_BUDGET_MIN_FRACTION", 0.25, at_least=0, at_most=1)
GATEWAY_ACQUIRE_TIMEOUT_S = env_float("GATEWAY_ACQUIRE_TIMEOUT_S", 1.0, at_least=0)
GATEWAY_HEALTH_INTERVAL_S = env_float("GATEWAY_HEALTH_INTERVAL_S", 2.0, above=0)
GATEWAY_USAGE_FLUSH_S = env_float("GATEWAY_USAGE_FLUSH_S", 2.0, above=0)
# The request log (apps/gateway/request_log.py): every request the gateway decides, kept this many days
# (deleted by the request_log_retention tick); 0 records nothing.
GATEWAY_REQUEST_LOG_DAYS = env_int("GATEWAY_REQUEST_LOG_DAYS", 7, at_least=0)
GATEWAY_SATURATION_ADMISSION = env_bool("GATEWAY_SATURATION_ADMISSION", True)
GATEWAY_DRAIN_TIMEOUT_S = env_float("GATEWAY_DRAIN_TIMEOUT_S", 30.0, at_least=0)
GATEWAY_LEASE_S = env_float("GATEWAY_LEASE_S", 10.0, above=0)
GATEWAY_LEASE_RENEW_S = env_float("GATEWAY_LEASE_RENEW_S", 3.0, above=0)
GATEWAY_REDIS_MAX_CONNECTIONS = env_int("GATEWAY_REDIS_MAX_CONNECTIONS", 128, at_least=1)
GATEWAY_REDIS_POOL_TIMEOUT_S = env_float("GATEWAY_REDIS_POOL_TIMEOUT_S", 10.0, above=0)
GATEWAY_DEBT_DIMENSION = env_choice("GATEWAY_DEBT_DIMENSION", "tokens_per_second",
                                    ("tokens_per_second", "concurrency", "kv_bytes"))
if GATEWAY_LEASE_RENEW_S >= GATEWAY_LEASE_S:
    # A lease renewed no sooner than it runs out lapses between renewals.
    raise ImproperlyConfigured(
        f"GATEWAY_LEASE_RENEW_S ({GATEWAY_LEASE_RENEW_S:g}) must be below GATEWAY_LEASE_S ({GATEWAY_LEASE_S:g})"
    )

# --- who may read what (apps/gateway/metrics_access.py, apps/tenancy/lockout.py, serve) ------------------

# /metrics: with a token, `Authorization: Bearer <METRICS_TOKEN>` is required; without one production refuses
# to serve it and the embedded mode serves it without tenant-identifying labels unless METRICS_ANONYMOUS_LABELS.
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
METRICS_ANONYMOUS_LABELS = env_bool("METRICS_ANONYMOUS_LABELS", False)

# Sign-in by password (login pages, /api/v1/auth/token): LOGIN_FAILURE_LIMIT failures within LOGIN_FAILURE_WINDOW_S
# for one username or from one address lock it for LOGIN_LOCKOUT_S (the right password refused too).
LOGIN_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 10, at_least=1)
LOGIN_FAILURE_WINDOW_S = env_float("LOGIN_FAILURE_WINDOW_S", 300.0, above=0)
LOGIN_LOCKOUT_S = env_float("LOGIN_LOCKOUT_S", 300.0, above=0)

# The lockout's counts: shared by every server process through Redis when there is one (`serve --workers N`
# needs REDIS_URL), else in the one process's memory.
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
                "KEY_PREFIX": "tokenpools"}
    if REDIS_URL else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
}

# The ASGI server (`serve`): a connection must complete its request's headers within SERVER_HEADER_TIMEOUT_S of
# connecting or of its request's first byte (idle and slowloris connections are closed), its body within
# SERVER_BODY_TIMEOUT_S of its headers, and a response that the client does not read for SERVER_WRITE_TIMEOUT_S
# closes the connection (apps/gateway/http_guard.py); an idle keep-alive connection is closed after
# SERVER_KEEPALIVE_TIMEOUT_S. That one is longer than the idle timeouts of what stands in front (75 s, nginx's
# default, over a cloud load balancer's 60 s and httpx's and the OpenAI SDK's 5 s): the side that closes an idle
# connection should be the client's, or a request sent on it as the server closes it is lost (uvicorn's own 5 s
# raced httpx's 5 s: a ReadError in a test; wrk counted 74 socket errors in 60 s at 8 requests/s on 32
# connections, 0 with 60 s; bench/RESULTS.md).
SERVER_HEADER_TIMEOUT_S = env_float("SERVER_HEADER_TIMEOUT_S", 10.0, above=0)
SERVER_BODY_TIMEOUT_S = env_float("SERVER_BODY_TIMEOUT_S", 30.0, above=0)
SERVER_WRITE_TIMEOUT_S = env_float("SERVER_WRITE_TIMEOUT_S", 30.0, above=0)
SERVER_KEEPALIVE_TIMEOUT_S = env_int("SERVER_KEEPALIVE_TIMEOUT_S", 75, at_least=1)

# --- periodic ticks (workers.ticks) ---------------------------------------------------------------------

# 'auto': Celery when a real broker is configured, else inside the server; or forced: celery, in-process, off.
TOKENPOOLS_TICKS = env_choice("TOKENPOOLS_TICKS", "auto", ("auto", "celery", "in-process", "off"))
# Every tick's period, TOKENPOOLS_TICK_<NAME>_S overriding the registry's default.
TOKENPOOLS_TICK_PERIODS = {
    spec.name: env_float(f"TOKENPOOLS_TICK_{spec.name.upper()}_S", spec.period_s, above=0)
    for spec in DEFAULT_TICKS
}
# A mistyped tick name would otherwise be ignored silently.
_unknown_ticks = [
    name
    for name in env_names(r"TOKENPOOLS_TICK_\w+_S")
    if name.removeprefix("TOKENPOOLS_TICK_").removesuffix("_S").lower() not in TOKENPOOLS_TICK_PERIODS
]
if _unknown_ticks:
    raise ImproperlyConfigured(
        f"{', '.join(_unknown_ticks)}: no such tick; the ticks are {', '.join(TOKENPOOLS_TICK_PERIODS)}"
    )
TOKENPOOLS_SCRAPE_TIMEOUT_S = env_float("TOKENPOOLS_SCRAPE_TIMEOUT_S", 1.0, above=0)
# The live dashboard's own sampler in each server process; off when Celery publishes the samples.
DASHBOARD_LOCAL_SAMPLER = env_bool("DASHBOARD_LOCAL_SAMPLER", True)
# How often a live-dashboard websocket re-checks that its user may still see what it streams (closed 4403).
DASHBOARD_ACCESS_RECHECK_S = env_float("DASHBOARD_ACCESS_RECHECK_S", 2.0, above=0)

# --- demo commands (seed_demo, demo_up, loadgen, demo_screenshot) ----------------------------------------

# Passwords of the demo's operator and tenant owners; generated and printed once when unset.
TOKENPOOLS_ADMIN_PASSWORD = env_str("TOKENPOOLS_ADMIN_PASSWORD", "")
TOKENPOOLS_DEMO_PASSWORD = env_str("TOKENPOOLS_DEMO_PASSWORD", "")
# The demo's API keys as JSON (`seed_demo --write-keys`), read by `loadgen` for `entitlement:NAME` keys.
TOKENPOOLS_DEMO_KEYS = env_str("TOKENPOOLS_DEMO_KEYS", "var/demo-keys.json")
TOKENPOOLS_CHROMIUM = env_str("TOKENPOOLS_CHROMIUM", "/usr/bin/chromium")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "var" / "staticfiles"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "ui:home"
LOGOUT_REDIRECT_URL = "login"

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = PRODUCTION
CSRF_COOKIE_SECURE = PRODUCTION

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # DRF's three parsers, refusing NUL characters in text (a 500 on PostgreSQL otherwise).
    "DEFAULT_PARSER_CLASSES": [
        "apps.tenancy.apiutils.JSONParser",
        "apps.tenancy.apiutils.FormParser",
        "apps.tenancy.apiutils.MultiPartParser",
    ],
    # Every list: ?limit= (1 to 500, default PAGE_SIZE) and ?offset=; a bad value is a 400 field error.
    "DEFAULT_PAGINATION_CLASS": "apps.tenancy.apiutils.ApiPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "apps.tenancy.apischema.ApiSchema",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "tokenpools API",
    "DESCRIPTION": "Tenants, token pools, entitlements and API keys for multi-tenant LLM inference.",
    "VERSION": "v1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI's files come from the sidecar package on disk: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {
        "handlers": ["console"],
        "level": env_choice("LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
    },
}
