"""Settings of the benchmark site. ``BENCH_VARIANT`` and ``BENCH_DB`` choose what runs where.

Each variant has its own PostgreSQL database (``django_idempotency_bench_<variant>``), so the
side effects of one never mix with another's and the test databases are never touched.
"""

from __future__ import annotations

import os
from typing import Any

VARIANT = os.environ.get("BENCH_VARIANT", "plain")
VARIANTS = ("plain", "floor", "ours", "unprepared", "sealed", "patched", "dik", "dfi")
if VARIANT not in VARIANTS:
    raise RuntimeError(f"BENCH_VARIANT must be one of {', '.join(VARIANTS)}, not {VARIANT!r}")
# "patched" is "ours" with django_idempotency imported from a scratch copy (run.py --patched);
# "sealed" is "ours" with stored responses encrypted (ENCRYPTION_KEYS). "floor" is the claim
# and the completion written by hand in the view (benchsite/floor.py), no package at all.
# "unprepared" is "ours" on a connection without prepared statements (Django's default).
PROTECTION = "ours" if VARIANT in ("patched", "sealed", "unprepared") else VARIANT
# A Fernet key for the benchmark's own throwaway database only.
BENCH_ENCRYPTION_KEY = "YmVuY2gtYmVuY2gtYmVuY2gtYmVuY2gtYmVuY2gtMzI="

SECRET_KEY = "django-idempotency-benchmarks"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "benchmarks.benchsite.urls"
WSGI_APPLICATION = "benchmarks.benchsite.wsgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "rest_framework",
    "rest_framework.authtoken",
    "benchmarks.benchsite",
]
# A typical token-authenticated JSON API: no sessions, no CSRF, no templates.
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("BENCH_DB", f"django_idempotency_bench_{VARIANT}"),
        "USER": os.environ.get("PGUSER", "postgres"),
        "PASSWORD": os.environ.get("PGPASSWORD", ""),
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
        # Persistent connections, as a production deployment would have them.
        "CONN_MAX_AGE": 600,
        # Prepared statements allowed, as on a direct connection (docs/deployment.md): the
        # package prepares its own statements; Django's cursors bind client-side and prepare
        # nothing, so every other variant runs as without it.
        # BENCH_UNPREPARED=1: every variant on Django's defaults (a patched copy measured
        # against this checkout's "unprepared").
        "OPTIONS": {}
        if VARIANT == "unprepared" or os.environ.get("BENCH_UNPREPARED") == "1"
        else {"prepare_threshold": 5},
    }
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.TokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
}

LOGGING: dict[str, Any] = {"version": 1, "disable_existing_loggers": False}

if PROTECTION == "ours":
    INSTALLED_APPS.append("django_idempotency")
    # Every key at its default: 24 h TTL, 60 s lease, key required on POST and PATCH.
    IDEMPOTENCY: dict[str, Any] = {}
    if VARIANT == "sealed":
        IDEMPOTENCY["ENCRYPTION_KEYS"] = [BENCH_ENCRYPTION_KEY]
elif PROTECTION == "dik":
    # django-idempotency-key: its multi-process configuration from its README. Responses in
    # a Redis cache (django-redis, its own dependency) rather than the per-process memory
    # default, the cross-process Redis lock rather than the per-process thread lock, and
    # replays with the original status instead of 409. Opt-in per view
    # (ExemptIdempotencyKeyMiddleware + @idempotency_key), like our mixin.
    REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    MIDDLEWARE.append("idempotency_key.middleware.ExemptIdempotencyKeyMiddleware")
    CACHES = {
        "default": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": REDIS_URL,
            "OPTIONS": {"CLIENT_CLASS": "django_redis.client.DefaultClient"},
        }
    }
    IDEMPOTENCY_KEY = {
        "CONFLICT_STATUS_CODE": None,
        "STORAGE": {"CLASS": "idempotency_key.storage.CacheKeyStorage", "CACHE_NAME": "default"},
        "LOCK": {
            "CLASS": "idempotency_key.locks.redis.MultiProcessRedisLock",
            "LOCATION": REDIS_URL,
            "NAME": "django-idempotency-bench-lock",
            "TTL": 60,
            "ENABLE": True,
            "TIMEOUT": 0.1,
        },
    }
elif PROTECTION == "dfi":
    # drf-idempotency: its Quick Start, the middleware with its default backend, the database
    # (a unique key plus get_or_create), on the same PostgreSQL. Its per-view decorator
    # cannot wrap a DRF viewset method (see views.protected). The middleware runs before
    # DRF's authentication, so its keys are global, not scoped by the caller.
    INSTALLED_APPS.append("drf_idempotency")
    MIDDLEWARE.append("drf_idempotency.middleware.IdempotencyMiddleware")
    IDEMPOTENCY = {
        "BACKEND": "drf_idempotency.backends.database.DatabaseBackend",
        "REQUIRE_KEY": True,
        "METHODS": ["POST", "PATCH"],
    }
