"""The package's migrations undone and done again on PostgreSQL: what their own SQL adds
(the record table's fillfactor, the claim function, the foreign keys that cascade) is gone
after ``migrate django_idempotency 0003`` and back after ``migrate`` (read from the server's
catalog), check E052 names what is missing meanwhile, and the engine claims and completes
again on the schema made anew."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from django_idempotency import run_once
from django_idempotency.checks import check_database
from django_idempotency.models import IdempotencyRecord
from tests.helpers import new_key

pytestmark = pytest.mark.django_db(transaction=True)

if connection.vendor != "postgresql":
    pytest.skip("the migrations' own SQL runs on PostgreSQL (and MariaDB)", allow_module_level=True)

APP = "django_idempotency"
CASCADES = ("idempotency_step_record_fk", "idempotency_outbox_key_message_fk")


def one(sql: str, params: Any = ()) -> Any:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()[0]


def schema() -> dict[str, Any]:
    """What the migrations' own SQL leaves in the catalog."""
    return {
        "claim functions": one(
            "SELECT count(*) FROM pg_proc WHERE proname = 'django_idempotency_record_claim'"
        ),
        "record options": one(
            "SELECT reloptions FROM pg_class WHERE relname = 'django_idempotency_record'"
        ),
        "cascading keys": one(
            "SELECT count(*) FROM pg_constraint WHERE conname = ANY(%s) AND confdeltype = 'c'",
            [list(CASCADES)],
        ),
    }


def after(name: str) -> list[str]:
    """The package's migrations after ``name``, in order (every later release adds some)."""
    loader = MigrationLoader(connection, ignore_no_migrations=True)
    names = sorted(migration for app, migration in loader.disk_migrations if app == APP)
    return [migration for migration in names if migration[:4] > name[:4]]


def test_the_migrations_undo_their_own_sql_and_do_it_again():
    migrated = schema()
    assert migrated == {
        "claim functions": 1,
        "record options": ["fillfactor=80"],
        "cascading keys": 2,
    }
    call_command("migrate", "django_idempotency", "0010", verbosity=0)
    try:
        assert schema()["claim functions"] == 0
        # E052 names what is not there: here a migration, every table being there.
        assert [e.msg.split(": ", 1)[1] for e in check_database(databases=["default"])] == [
            f"its migrations {', '.join(after('0010'))} are not applied. "
            "Protected requests may be refused (503 idempotency_store_unavailable) until they "
            "are."
        ]
        call_command("migrate", "django_idempotency", "0003", verbosity=0)
        assert schema() == {"claim functions": 0, "record options": None, "cascading keys": 0}
        (error,) = check_database(databases=["default"])
        assert "the tables django_idempotency_outbox" in error.msg
        assert "0005_outbox" in error.msg
    finally:
        call_command("migrate", "django_idempotency", verbosity=0)
    assert schema() == migrated
    assert check_database(databases=["default"]) == []
    calls: list[str] = []

    def work() -> str:
        calls.append("ran")
        return "done"

    key = new_key()
    for _ in range(2):
        assert run_once(work, account="a", operation="op", key=key) == "done"
    assert calls == ["ran"]
    assert IdempotencyRecord.objects.count() == 1
