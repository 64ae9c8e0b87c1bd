"""Settings of the example payments project. Not for production: the secret key is public.

``EXAMPLE_DB`` picks the database: ``sqlite`` (default, ``example_project/db.sqlite3``) or
``postgres`` (database ``django_idempotency_example`` on 127.0.0.1, user ``postgres``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from corsheaders.defaults import default_headers

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = os.environ.get("EXAMPLE_SECRET_KEY", "django-insecure-example-project-only")
DEBUG = os.environ.get("EXAMPLE_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "corsheaders",
    # django-ninja's Swagger UI files (/ninja/docs) come from its static files, not a CDN.
    "ninja",
    "django_idempotency",
    "example_project.payments",
    "example_project.recipes",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # Before CommonMiddleware, so that its redirects carry the CORS headers too.
    "corsheaders.middleware.CorsMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# make demo's crash switch (example_project/payments/demo.py): a request with
# X-Demo-Crash ends mid-way, as a killed process would. With DEBUG only, never in production
# (the middleware refuses to load without DEBUG too).
if DEBUG:
    MIDDLEWARE.append("example_project.payments.demo.DemoCrashMiddleware")

ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

EXAMPLE_DB = os.environ.get("EXAMPLE_DB", "sqlite")

default_database: dict[str, Any]
if EXAMPLE_DB == "postgres":
    default_database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("EXAMPLE_PGDATABASE", "django_idempotency_example"),
        "USER": os.environ.get("PGUSER", "postgres"),
        "PASSWORD": os.environ.get("PGPASSWORD", ""),
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
    }
elif EXAMPLE_DB == "sqlite":
    default_database = {
        "ENGINE": "django.db.backends.sqlite3",
        # EXAMPLE_SQLITE_PATH: a database file of its own, e.g. for a throwaway test server.
        "NAME": os.environ.get("EXAMPLE_SQLITE_PATH", BASE_DIR / "db.sqlite3"),
        "OPTIONS": {
            # Concurrent requests queue for SQLite's single write lock instead of failing at
            # once, and WAL lets readers go on while a request writes.
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
        },
    }
else:
    raise RuntimeError(f"EXAMPLE_DB must be sqlite or postgres, not {EXAMPLE_DB!r}")

DATABASES = {
    "default": default_database,
    # The fake payment provider writes through a connection of its own, the way an external
    # system would: its ledger survives a rollback of the view's transaction. Same database
    # (for SQLite the same file); the view calls the provider before it writes locally, so
    # the two connections never wait on each other.
    "provider": {**default_database, "TEST": {"MIRROR": "default"}},
}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Basic authentication checks the password on every request, and Django's default hasher
# takes most of a second for that, on purpose. Throwaway test servers
# (EXAMPLE_FAST_PASSWORDS=1, with the demo user created under it) use a fast hash instead.
if os.environ.get("EXAMPLE_FAST_PASSWORDS") == "1":
    PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

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

# Every key optional: the defaults (24 h TTL, 60 s lease, key required on POST and PATCH).
# One is set. A duplicate that arrives while its original runs is told, in its 409's
# Retry-After, the seconds left of the original's lease (at most RETRY_AFTER_MAX where it is
# set). The lease is the longest a charge may take; the demo's take half a second, so a
# client told to come back in a minute would wait for nothing.
IDEMPOTENCY: dict[str, Any] = {"RETRY_AFTER_MAX": 2}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.BasicAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 20,
    # drf-spectacular's; django_idempotency.openapi adds the Idempotency-Key header, the
    # problem answers and Idempotent-Replayed to the protected operations by itself.
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

# The OpenAPI schema at /api/schema/, Swagger UI at /api/docs/.
SPECTACULAR_SETTINGS = {
    "TITLE": "Example payments API",
    "DESCRIPTION": (
        "Charges and refunds with safe retries: send an `Idempotency-Key` with every "
        "`POST`, the same key on every retry of one operation."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI's files come from the drf-spectacular-sidecar package, not from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
}

# CORS (django-cors-headers), for a browser app served from another origin. A browser hides
# response headers from scripts unless they are exposed: the app needs Idempotent-Replayed
# (was this a replay?), Retry-After (how long to back off after a 409 or 503) and Location.
# It must also be allowed to send the Idempotency-Key header.
CORS_ALLOWED_ORIGINS = [
    origin
    for origin in os.environ.get("EXAMPLE_CORS_ORIGINS", "http://localhost:3000").split(",")
    if origin
]
CORS_ALLOW_HEADERS = (*default_headers, "idempotency-key")
CORS_EXPOSE_HEADERS = ["Idempotent-Replayed", "Retry-After", "Location"]

# Celery: receipts are sent by a task, through the outbox: the view writes the message with
# the charge and `manage.py relay_outbox` sends it. By default the task runs eagerly, in the
# relay's process, so the demo needs no broker and no worker; EXAMPLE_CELERY_EAGER=0 sends it
# to the broker for `celery -A example_project worker`. The beat schedule is in celery.py.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_ALWAYS_EAGER = os.environ.get("EXAMPLE_CELERY_EAGER", "1") == "1"

# Django's Tasks framework (docs/tasks.md): with EXAMPLE_TASKS_RECEIPTS=1 the charges endpoint
# also enqueues its receipt with `task.enqueue()`. The default backend is the outbox; the relay
# hands the message to the database backend "worker", which `manage.py db_worker --backend
# worker` runs (on Django 5.2 through the django-tasks backport). Left out when not installed.
HAS_DJANGO_TASKS = importlib.util.find_spec("django_tasks_db") is not None and (
    importlib.util.find_spec("django.tasks") is not None
    or importlib.util.find_spec("django_tasks") is not None
)
if HAS_DJANGO_TASKS:
    if importlib.util.find_spec("django.tasks") is None:
        INSTALLED_APPS.append("django_tasks")
    INSTALLED_APPS.append("django_tasks_db")
    TASKS = {
        "default": {
            "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
            "OPTIONS": {"DELIVER_TO": "worker"},
        },
        "worker": {"BACKEND": "django_tasks_db.DatabaseBackend"},
    }
EXAMPLE_TASKS_RECEIPTS = HAS_DJANGO_TASKS and os.environ.get("EXAMPLE_TASKS_RECEIPTS") == "1"

# The webhook recipes' signing secrets (example_project/recipes/), one per sender. Real ones
# come from the sender's dashboard and never from the code.
STRIPE_WEBHOOK_SECRET = os.environ.get("STRIPE_WEBHOOK_SECRET", "whsec_example_stripe_secret")
GITHUB_WEBHOOK_SECRET = os.environ.get("GITHUB_WEBHOOK_SECRET", "example-github-secret")
STANDARD_WEBHOOK_SECRET = os.environ.get(
    "STANDARD_WEBHOOK_SECRET", "whsec_ZXhhbXBsZS1zdGFuZGFyZC13ZWJob29rcy1zZWNyZXQ="
)

# Receipts are printed on the server's console instead of being mailed.
EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
DEFAULT_FROM_EMAIL = "payments@example.com"

# How long the fake payment provider takes to answer, in seconds: long enough that a storm
# of retries arrives while the first request is still in flight.
FAKE_PROVIDER_LATENCY = float(os.environ.get("EXAMPLE_PROVIDER_LATENCY", "0.5"))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_idempotency": {"handlers": ["console"], "level": "INFO"}},
}

# The MCP server for agents (example_project/mcp_tools.py, at /mcp under example_project.asgi).
# Bearer tokens -> usernames: a demo's static tokens (EXAMPLE_MCP_TOKENS="token=user,..."); a
# real server verifies its authorization server's tokens instead.
MCP_TOKENS = dict(
    pair.split("=", 1)
    for pair in os.environ.get("EXAMPLE_MCP_TOKENS", "demo-agent-token=demo").split(",")
    if "=" in pair
)
MCP_ISSUER = os.environ.get("EXAMPLE_MCP_ISSUER", "http://127.0.0.1:8000")
MCP_RESOURCE_URL = os.environ.get("EXAMPLE_MCP_RESOURCE_URL", "http://127.0.0.1:8000/mcp")
# Seconds: how long a tool call's claim is held; a retry after a crash waits that long.
MCP_TOOL_LEASE = float(os.environ.get("EXAMPLE_MCP_LEASE", "5"))
