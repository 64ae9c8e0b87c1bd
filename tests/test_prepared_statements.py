"""The engine's statements prepared, where the connection allows it.

With ``OPTIONS["prepare_threshold"]`` set on a PostgreSQL connection, the claim, the
completion and the other fixed statements run on a server-binding cursor, and psycopg
prepares each once it has run that many times on the connection. Everything must behave as
without: the same answers, one side effect per key, the same records. ``make test-pg16`` and
the pool's run in ``make test-poolers`` run every database test this way; these tests switch
it on for themselves, so that ``make test`` covers it as well.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from django_idempotency._store import statements
from django_idempotency.models import IdempotencyRecord
from tests.helpers import ApiClient, needs_drf, new_key
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="psycopg's prepared statements"),
    needs_drf,
]
CHARGE = {"amount": 1000, "currency": "EUR"}
WAIT = 30
CLAIM_CALL = "SELECT * FROM django_idempotency_record_claim("


def prepared_here() -> list[str]:
    """The statements prepared on this thread's connection, as psycopg sent them."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.fixture
def threshold(request: Any) -> Iterator[int | None]:
    """``OPTIONS["prepare_threshold"]`` of the default database for one test."""
    value = request.param
    options = connection.settings_dict["OPTIONS"]
    before = options.get("prepare_threshold", "unset")
    # Every thread's connection reads this one dict when it connects.
    connection.close()
    options["prepare_threshold"] = value
    try:
        yield value
    finally:
        connection.close()
        if before == "unset":
            options.pop("prepare_threshold", None)
        else:
            options["prepare_threshold"] = before


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("threshold", [0, 2], indirect=True)
def test_prepared_claims_and_completions_answer_as_unprepared_ones(api, threshold):
    keys = [new_key() for _ in range(4)]
    firsts = [api.post("/charges/", CHARGE, key=key) for key in keys]
    replays = [api.post("/charges/", CHARGE, key=key) for key in keys for _ in range(3)]
    other_body = api.post("/charges/", {"amount": 1, "currency": "EUR"}, key=keys[0])

    assert [r.status_code for r in firsts] == [201] * 4
    assert [r.status_code for r in replays] == [201] * 12
    assert [r.content for r in replays] == [r.content for r in firsts for _ in range(3)]
    assert all(r["Idempotent-Replayed"] == "true" for r in replays)
    assert other_body.status_code == 422
    assert Charge.objects.count() == 4
    assert IdempotencyRecord.objects.filter(status="completed").count() == 4
    prepared = prepared_here()
    # The claim ran 17 times and the completion 4 on this connection: both are prepared.
    assert any(text.startswith(CLAIM_CALL) for text in prepared), prepared
    assert any(text.startswith('UPDATE "django_idempotency_record"') for text in prepared)
    # Values are bound, not written into the prepared text.
    assert not any(key in text for text in prepared for key in keys)


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("threshold", [None], indirect=True)
def test_without_a_threshold_nothing_is_prepared(api, threshold):
    for key in (new_key(), new_key()):
        for _ in range(3):
            assert api.post("/charges/", CHARGE, key=key).status_code == 201
    assert prepared_here() == []
    assert Charge.objects.count() == 2


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("threshold", [0], indirect=True)
def test_while_django_logs_queries_the_log_has_each_statement_with_its_values(api, threshold):
    key = new_key()
    with CaptureQueriesContext(connection) as queries:
        assert api.post("/charges/", CHARGE, key=key).status_code == 201
        assert api.post("/charges/", CHARGE, key=key).status_code == 201
    logged = [q["sql"] for q in queries.captured_queries]
    assert all(isinstance(sql, str) for sql in logged), logged
    claims = [sql for sql in logged if sql.startswith(CLAIM_CALL)]
    assert len(claims) == 2
    assert all(key in sql for sql in claims)
    assert Charge.objects.count() == 1


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("threshold", [0], indirect=True)
def test_an_error_inside_a_prepared_statement_is_djangos_error(threshold):
    # The cursor is wrapped as Django wraps its own: a refused value raises Django's
    # DataError, and the connection stays usable.
    from django.db import DataError

    with pytest.raises(DataError), statements.cursor("default") as cursor:
        cursor.execute("SELECT %s::int", ["not a number"])
    with statements.cursor("default") as cursor:
        cursor.execute("SELECT %s::int + 1", [41])
        assert cursor.fetchone() == (42,)


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("threshold", [0], indirect=True)
def test_a_storm_on_one_key_runs_the_view_once_with_prepared_statements(user, threshold):
    # Eight threads, each on a connection of its own that prepares at once, one key.
    key = new_key()
    start = threading.Barrier(8, timeout=WAIT)

    def send(_: int) -> int:
        client = ApiClient(user)
        try:
            start.wait()
            return int(client.post("/charges/", CHARGE, key=key).status_code)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(8) as pool:
        statuses = sorted(pool.map(send, range(8), timeout=WAIT))
    assert statuses.count(201) >= 1
    assert set(statuses) <= {201, 409}
    assert Charge.objects.count() == 1
    record = IdempotencyRecord.objects.get(key=key)
    assert record.status == "completed"


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("threshold", [0], indirect=True)
def test_a_column_changed_under_a_prepared_claim_is_prepared_anew(api, threshold):
    # A migration changes the type of a column the claim returns while this connection holds
    # the claim prepared. The claim's function casts what it returns, so its result type
    # stays, and the answers stay as they were (a statement that returns the column as it is
    # meets PostgreSQL's refusal: the next test).
    key = new_key()
    first = api.post("/charges/", CHARGE, key=key)
    assert first.status_code == 201
    assert api.post("/charges/", CHARGE, key=key).status_code == 201
    assert any(text.startswith(CLAIM_CALL) for text in prepared_here())
    table = IdempotencyRecord._meta.db_table
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN response_status TYPE integer')
        replays = [api.post("/charges/", CHARGE, key=key) for _ in range(3)]
        fresh = api.post("/charges/", CHARGE, key=new_key())
    finally:
        connection.close()
        with other.cursor() as cursor:
            cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN response_status TYPE smallint')
        other.close()
    assert [r.status_code for r in replays] == [201] * 3
    assert all(r.content == first.content for r in replays)
    assert fresh.status_code == 201
    assert Charge.objects.count() == 2


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("threshold", [0], indirect=True)
def test_a_read_prepared_before_its_column_changed_is_prepared_anew(api, threshold):
    # The claim's function casts what it returns, so a changed column leaves its result type
    # as it was; the record's read (a duplicate's wait, a lost lease's Retry-After) returns
    # the columns as they are. A migration changes one while this connection holds the read
    # prepared: PostgreSQL refuses it there ("cached plan must not change result type") for
    # the connection's life. Outside a transaction the read is prepared anew and answers;
    # inside one, the transaction is lost either way and the error is Django's.
    from django.db import NotSupportedError, transaction

    from django_idempotency._context import Operation
    from django_idempotency._store import fetch

    key = new_key()
    assert api.post("/charges/", CHARGE, key=key).status_code == 201
    record = IdempotencyRecord.objects.get(key=key)
    op = Operation(
        alias="default",
        account=record.account,
        operation=record.operation,
        key=key,
        request_hash=record.request_hash,
        fingerprint_version=record.fingerprint_version,
        recovery_policy=record.recovery_policy,
        lease=timedelta(seconds=30),
        ttl=timedelta(days=1),
    )
    before = fetch(op)
    assert before is not None
    assert before.response_status == 201
    assert fetch(op) == before
    table = IdempotencyRecord._meta.db_table
    read = [text for text in prepared_here() if text.startswith("SELECT") and table in text]
    assert read, prepared_here()
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN response_status TYPE integer')
        after = [fetch(op) for _ in range(3)]
        # Prepared anew for the new type; the column changed back, inside a transaction.
        with other.cursor() as cursor:
            cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN response_status TYPE smallint')
        with pytest.raises(NotSupportedError), transaction.atomic():
            fetch(op)
        assert fetch(op) == before  # the rollback made psycopg drop what it had prepared
    finally:
        connection.close()
        with other.cursor() as cursor:
            cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN response_status TYPE smallint')
        other.close()
    assert after == [before] * 3
    assert Charge.objects.count() == 1
