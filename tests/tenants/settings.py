"""Settings for schemas per tenant: django-tenants on PostgreSQL (tests/test_tenants.py).

The package is a tenant app: its tables are made in each tenant's schema, so each tenant's
records, outbox and audit trail are its own. The public schema holds the tenants, their
domains and the deliveries the test sender counts.
"""

from __future__ import annotations

import os
from typing import Any

from tests.settings import LOGGING, PASSWORD_HASHERS, TEMPLATES

__all__ = ["LOGGING", "PASSWORD_HASHERS", "TEMPLATES"]

SECRET_KEY = "django-idempotency-tenant-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.tenants.urls"
# What the suite's shared helpers ask of the settings (tests/helpers.py, tests/live.py).
TEST_DB = "postgres"
HAS_DRF = False
HAS_NINJA = False
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES: dict[str, dict[str, Any]] = {
    "default": {
        "ENGINE": "django_tenants.postgresql_backend",
        "NAME": os.environ.get("DB_NAME", "django_idempotency"),
        "USER": os.environ.get("PGUSER", "postgres"),
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
        "TEST": {"NAME": os.environ.get("TEST_DB_NAME", f"test_django_idempotency_{os.getpid()}")},
    }
}
# TEST_DB_PREPARE=N: psycopg prepares a statement after N runs on a connection (as in
# tests/settings.py); PostgreSQL parses a prepared statement again when search_path changed.
if os.environ.get("TEST_DB_PREPARE"):
    DATABASES["default"]["OPTIONS"] = {"prepare_threshold": int(os.environ["TEST_DB_PREPARE"])}
# The fake provider's ledger, written through a connection of its own (autocommit), as an
# external system's would survive a crash; and the same database for CLAIM_DATABASE.
DATABASES["provider"] = {**DATABASES["default"], "TEST": {"MIRROR": "default"}}
DATABASES["claims"] = {**DATABASES["provider"]}
DATABASE_ROUTERS = ["django_tenants.routers.TenantSyncRouter"]

# --8<-- [start:tenant-apps]
SHARED_APPS = [
    "django_tenants",
    "tests.tenants",
    "django.contrib.contenttypes",
    "django.contrib.auth",
]
TENANT_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_idempotency",
    "tests.testapp",
]
INSTALLED_APPS = SHARED_APPS + [app for app in TENANT_APPS if app not in SHARED_APPS]
# --8<-- [end:tenant-apps]
TENANT_MODEL = "tenants.Client"
TENANT_DOMAIN_MODEL = "tenants.Domain"

MIDDLEWARE = ["django_tenants.middleware.main.TenantMainMiddleware"]

IDEMPOTENCY: dict[str, Any] = {"OUTBOX_SENDER": "tests.tenants.views.record"}
