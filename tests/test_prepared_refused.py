"""A prepared statement the server no longer has: what a pooler that hands out its server
connections per transaction does to the engine's prepared statements (PgBouncer before 1.21
in transaction mode), reproduced on one connection by deallocating the claim's statement
behind psycopg's back. The request that meets it still gets its answer (the statement runs
again, unprepared), the engine prepares nothing more on that database in this process, and
every effect happens once. ``make test-poolers`` runs the real pooler."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from django_idempotency._store import statements
from django_idempotency.models import IdempotencyRecord
from tests.helpers import needs_drf, new_key
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="psycopg's prepared statements"),
    pytest.mark.django_db(transaction=True, databases="__all__"),
    needs_drf,
]
CHARGE = {"amount": 1000, "currency": "EUR"}
CLAIM_CALL = "SELECT * FROM django_idempotency_record_claim("


def prepared_here() -> list[tuple[str, str]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT name, statement FROM pg_prepared_statements")
        return list(cursor.fetchall())


@pytest.fixture
def preparing() -> Iterator[None]:
    """The default database prepares the engine's statements at their first run, and is
    trusted to again after the test."""
    options = connection.settings_dict["OPTIONS"]
    before = options.get("prepare_threshold", "unset")
    connection.close()
    options["prepare_threshold"] = 0
    try:
        yield
    finally:
        connection.close()
        statements.refused.discard(connection.alias)
        if before == "unset":
            options.pop("prepare_threshold", None)
        else:
            options["prepare_threshold"] = before


def test_a_prepared_claim_the_server_lost_runs_unprepared_and_nothing_is_prepared_again(
    api: Any, preparing: None, caplog: pytest.LogCaptureFixture
) -> None:
    key = new_key()
    first = api.post("/charges/", CHARGE, key=key)
    assert first.status_code == 201
    (claim,) = [name for name, text in prepared_here() if text.startswith(CLAIM_CALL)]
    with connection.cursor() as cursor:
        cursor.execute(f'DEALLOCATE "{claim}"')
    replays = [api.post("/charges/", CHARGE, key=key) for _ in range(3)]
    fresh = api.post("/charges/", CHARGE, key=new_key())
    assert [r.status_code for r in replays] == [201] * 3
    assert all(r.content == first.content for r in replays)
    assert fresh.status_code == 201
    assert (Charge.objects.count(), IdempotencyRecord.objects.count()) == (2, 2)
    # Said once, and nothing more is prepared on that database.
    refusals = [r for r in caplog.records if "refused a prepared statement" in r.getMessage()]
    assert len(refusals) == 1
    assert connection.alias in statements.refused
    connection.close()
    assert api.post("/charges/", CHARGE, key=new_key()).status_code == 201
    assert [text for _, text in prepared_here() if text.startswith(CLAIM_CALL)] == []
    assert Charge.objects.count() == 3
