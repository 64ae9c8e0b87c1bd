"""Time the admin changelist and ``idempotency_stats`` on a PostgreSQL table of a million records.

Usage (from the repository root, PostgreSQL on 127.0.0.1 as user ``postgres``)::

    .venv/bin/python benchmarks/admin_bench.py [--rows 1000000] [--refill] [--repeat 5]

It runs with the test settings (``tests.settings``), every alias pointed at the database
``django_idempotency_bench`` (``BENCH_PGDATABASE`` overrides the name), which it creates
when missing and migrates. It fills the table once with ``INSERT ... SELECT
generate_series`` (``--refill`` starts again), then times each page through Django's test
client, logged in as a superuser. Every figure must stay under ``--budget`` seconds
(default 1): the script exits 1 when one does not.

The data looks like a busy day: records created over the last 30 hours with a 24 hour TTL
(so about a fifth are expired and not yet purged), 20 operations, 10,000 accounts, 98%
completed, 1% failed, 1% in progress of which half have a stale lease, and JSON bodies of
a few hundred bytes with one binary body in a hundred.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["TEST_DB"] = "postgres"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
DATABASE = os.environ.get("BENCH_PGDATABASE", "django_idempotency_bench")

import django  # noqa: E402

FILL_SQL = """
INSERT INTO django_idempotency_record (
    account, operation, key, request_hash, fingerprint_version, status,
    lease_token, lease_expires_at, recovery_policy, recovery_attempts,
    response_status, response_headers, response_body,
    created_at, completed_at, expires_at
)
SELECT
    'user:' || (i %% 10000),
    'op-' || lpad((i %% 20)::text, 2, '0') || '.create',
    md5(i::text || 'key'),
    md5(i::text),
    'v1',
    CASE WHEN i %% 100 = 0 THEN 'in_progress' WHEN i %% 100 = 1 THEN 'failed'
         ELSE 'completed' END,
    CASE WHEN i %% 100 = 0 THEN md5(i::text)::uuid END,
    CASE WHEN i %% 200 = 0 THEN now() - interval '5 minutes'
         WHEN i %% 100 = 0 THEN now() + interval '1 minute' END,
    'retry',
    0,
    CASE WHEN i %% 100 = 0 THEN NULL WHEN i %% 100 = 1 THEN 500 ELSE 201 END,
    CASE WHEN i %% 100 = 0 THEN '[]'::jsonb
         ELSE '[["Content-Type", "application/json"]]'::jsonb END,
    CASE WHEN i %% 100 = 0 THEN NULL
         WHEN i %% 100 = 2 THEN decode(repeat(md5(i::text), 8), 'hex')
         ELSE convert_to('{"id": ' || i || ', "amount": 1000, "currency": "EUR", '
                         || '"status": "succeeded", "description": "'
                         || repeat('x', 200) || '"}', 'UTF8') END,
    created,
    CASE WHEN i %% 100 = 0 THEN NULL ELSE created + interval '200 milliseconds' END,
    created + interval '24 hours'
FROM (
    SELECT i,
           -- in-progress rows are recent: they were claimed in the last few minutes
           CASE WHEN i %% 100 = 0 THEN now() - (i %% 600) * interval '1 second'
                ELSE now() - (i::float / %(rows)s) * interval '30 hours' END AS created
    FROM generate_series(1, %(rows)s) AS i
) AS source
"""


def ensure_database(name: str) -> None:
    """Create the benchmark database when it does not exist."""
    import psycopg

    params = {"host": os.environ.get("PGHOST", "127.0.0.1"), "user": "postgres"}
    with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def fill(rows: int, refill: bool) -> None:
    """Fill the table with ``rows`` records unless it already holds that many."""
    from django.db import connection

    from django_idempotency.models import IdempotencyRecord

    present = IdempotencyRecord.objects.count()
    if present == rows and not refill:
        print(f"table already holds {present:,} records; --refill starts again")
        return
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_idempotency_record, django_idempotency_step")
        cursor.execute(FILL_SQL, {"rows": rows})
    # VACUUM sets the visibility map, so index-only scans work as on a table that has been
    # live for a while; ANALYZE gives the planner real statistics.
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE django_idempotency_record")
    print(f"filled {rows:,} records in {time.perf_counter() - started:.1f} s")


def timed(call: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """The first (cold) time and the median of ``repeat`` more."""
    started = time.perf_counter()
    call()
    cold = time.perf_counter() - started
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return cold, statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--refill", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--budget", type=float, default=1.0, help="seconds allowed per figure")
    args = parser.parse_args()

    ensure_database(DATABASE)
    from django.conf import settings

    # The test settings' own database stays untouched: every alias points at the bench one.
    for alias in settings.DATABASES.values():
        alias["NAME"] = DATABASE
    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from django.utils import timezone

    from django_idempotency.models import IdempotencyRecord, RecordStatus

    call_command("migrate", verbosity=0)
    fill(args.rows, args.refill)
    admin, _ = User.objects.get_or_create(
        username="bench-admin", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(admin)
    base = "/admin/django_idempotency/idempotencyrecord/"
    some = IdempotencyRecord.objects.filter(status=RecordStatus.COMPLETED).only("pk", "key").last()
    # Row i = 2 of the fill holds a binary body.
    binary = IdempotencyRecord.objects.filter(key=hashlib.md5(b"2key").hexdigest()).first()
    assert some is not None
    assert binary is not None

    now = timezone.localtime()
    today = f"created_at__year={now.year}&created_at__month={now.month}&created_at__day={now.day}"

    def page(url: str) -> Callable[[], Any]:
        def get() -> Any:
            response = client.get(url)
            assert response.status_code == 200, (url, response.status_code)
            return response

        return get

    def stats_command() -> None:
        call_command("idempotency_stats", stdout=StringIO())

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("changelist", page(base)),
        ("changelist ?status=completed", page(f"{base}?status__exact=completed")),
        ("changelist ?status=failed", page(f"{base}?status__exact=failed")),
        ("changelist ?operation=op-07.create", page(f"{base}?operation=op-07.create")),
        ("changelist ?expired=yes", page(f"{base}?expired=yes")),
        ("changelist ?expired=no", page(f"{base}?expired=no")),
        ("changelist ?lease=stale", page(f"{base}?lease=stale")),
        ("changelist ?lease=live", page(f"{base}?lease=live")),
        ("changelist ?created_at=today", page(f"{base}?{today}")),
        (
            "changelist ?status=failed&operation",
            page(f"{base}?status__exact=failed&operation=op-01.create"),
        ),
        ("changelist ?q=<key>", page(f"{base}?q={some.key}")),
        ("changelist ?q=user:42", page(f"{base}?q=user:42")),
        ("changelist page 50", page(f"{base}?p=50")),
        ("changelist sorted by account", page(f"{base}?o=2")),
        ("changelist sorted by expiry", page(f"{base}?o=7")),
        ("changelist oldest first", page(f"{base}?o=-6")),
        ("detail (JSON body)", page(f"{base}{some.pk}/change/")),
        ("detail (binary body)", page(f"{base}{binary.pk}/change/")),
        ("idempotency_stats", stats_command),
    ]
    print(
        f"{IdempotencyRecord.objects.count():,} records; cold = first call, warm = median "
        f"of {args.repeat}"
    )
    print(f"{'case':<40} {'cold':>8} {'warm':>8}")
    slow = []
    for name, call in cases:
        cold, warm = timed(call, args.repeat)
        flag = "" if max(cold, warm) < args.budget else "  OVER BUDGET"
        print(f"{name:<40} {cold * 1000:7.0f}ms {warm * 1000:7.0f}ms{flag}")
        if flag:
            slow.append(name)
    if slow:
        print(f"over {args.budget} s: {', '.join(slow)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
