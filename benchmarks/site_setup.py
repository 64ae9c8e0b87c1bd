"""Create, migrate and reset a variant's benchmark database; runs in either venv.

Usage: ``python -m benchmarks.site_setup <variant>`` prints the API token of the bench user.
"""

from __future__ import annotations

import os
import sys

TOKEN = "b3nchb3nchb3nchb3nchb3nchb3nchb3nchb3nc"  # 40 characters, like DRF's tokens
USERNAME = "bench"


def database_name(variant: str) -> str:
    return f"django_idempotency_bench_{variant}"


def ensure_database(name: str) -> None:
    """Create the database ``name`` when missing (never a test database)."""
    assert name.startswith("django_idempotency_bench_"), name
    import psycopg

    params = {
        "host": os.environ.get("PGHOST", "127.0.0.1"),
        "port": os.environ.get("PGPORT", "5432"),
        "user": os.environ.get("PGUSER", "postgres"),
    }
    with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def postgres_database(name: str, conn_max_age: int = 600) -> dict[str, object]:
    """A ``DATABASES`` entry for the database ``name`` on the benchmarks' PostgreSQL."""
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": os.environ.get("PGUSER", "postgres"),
        "PASSWORD": os.environ.get("PGPASSWORD", ""),
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
        "CONN_MAX_AGE": conn_max_age,
    }


def configure_package_only(database: str, secret: str) -> None:
    """Django for a benchmark of the package alone (no site): its own PostgreSQL
    ``database``, the package's settings at their defaults. Once per process."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        DATABASES={"default": postgres_database(database)},
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_idempotency"],
        USE_TZ=True,
        SECRET_KEY=secret,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        IDEMPOTENCY={},
    )
    django.setup()


def configure(variant: str) -> None:
    """Point Django at the variant's settings and database; call before ``django.setup()``."""
    os.environ["BENCH_VARIANT"] = variant
    os.environ.setdefault("BENCH_DB", database_name(variant))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.benchsite.settings")


def prepare(variant: str, reset: bool = True) -> str:
    """Migrate, empty the tables the benchmarks fill, and make the bench user; its token."""
    configure(variant)
    ensure_database(os.environ["BENCH_DB"])
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    if reset:
        tables = ["benchsite_charge"]
        if variant in ("ours", "unprepared", "sealed", "patched"):
            # The steps' foreign key cascades: they are emptied with the records.
            tables += ["django_idempotency_record", "django_idempotency_step"]
        if variant == "floor":
            tables.append("benchsite_floorrecord")
        if variant == "dfi":
            tables.append("drf_idempotency_idempotencyrecord")
        # No ANALYZE of the empty tables: where autovacuum is off (as on the machines the
        # benchmarks run on), statistics of zero rows would stay all run long. run.py
        # analyzes every table once the warm-ups have written the first rows.
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {', '.join(tables)}")
    from django.contrib.auth.models import User
    from rest_framework.authtoken.models import Token

    user, _ = User.objects.get_or_create(username=USERNAME)
    Token.objects.filter(user=user).exclude(key=TOKEN).delete()
    Token.objects.get_or_create(user=user, defaults={"key": TOKEN})
    return TOKEN


if __name__ == "__main__":
    print(prepare(sys.argv[1], reset="--keep" not in sys.argv))
