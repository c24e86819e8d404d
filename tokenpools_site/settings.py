"""Settings for tokenpools, read from the environment.

Embedded default (``make run``): SQLite file, in-process gateway state, in-memory channel layer,
periodic ticks inside the server. ``DATABASE_URL`` and ``REDIS_URL`` are honoured whenever they are
set. With ``DEPLOYMENT=production`` the site refuses to start unless ``DATABASE_URL``, ``REDIS_URL``
and ``SECRET_KEY`` are all given.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

DEPLOYMENT = os.environ.get("DEPLOYMENT", "embedded").strip().lower()
if DEPLOYMENT not in {"embedded", "production"}:
    raise ImproperlyConfigured(f"DEPLOYMENT must be 'embedded' or 'production', got {DEPLOYMENT!r}")
PRODUCTION = DEPLOYMENT == "production"

if PRODUCTION:
    _missing = [name for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY") if not os.environ.get(name)]
    if _missing:
        raise ImproperlyConfigured(
            "DEPLOYMENT=production refuses to start without " + ", ".join(_missing) + " in the environment"
        )


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


# The embedded key only exists so a fresh clone runs; production demands its own (checked above).
SECRET_KEY = os.environ.get("SECRET_KEY", "embedded-insecure-key-do-not-use-in-production")
DEBUG = _env_bool("DEBUG", not PRODUCTION)
ALLOWED_HOSTS = [h for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver,[::1]").split(",") if h]
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o]

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
    "workers",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
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
        os.environ.get("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"),
        conn_max_age=int(os.environ.get("DB_CONN_MAX_AGE", "0")),
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Binding locks the pool row; on SQLite a write transaction takes the whole file, wait for it.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20

REDIS_URL = os.environ.get("REDIS_URL", "")

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Gateway state store: in-process unless Redis is configured (one interface, two implementations).
GATEWAY_STATE_BACKEND = os.environ.get("GATEWAY_STATE_BACKEND", "redis" if REDIS_URL else "memory")

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL or "memory://")
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True

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
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
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
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
}

# Who runs the periodic ticks: '' (Celery when a broker is configured, else in-process), 'celery',
# 'in-process' or 'off' (apps.gateway.loops.ticks_mode).
TOKENPOOLS_TICKS = os.environ.get("TOKENPOOLS_TICKS", "")
