"""The transaction's BEGIN rides with its first statement (PostgreSQL on Django's defaults).

Where the completion carries the ``COMMIT`` (the engine's block is the connection's only
one, psycopg 3, statements sent as text), the block's ``BEGIN`` goes in the same round trip
as the body's first statement: a first operation takes the claim's round trip and one per
statement of the transaction, no more. Every statement of the body stays in that one
transaction, whatever the first statement is and however it fails; a shape the ride cannot
take (``executemany``, a server-side cursor) leaves psycopg to send its ``BEGIN`` alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from django_idempotency import run_once
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import begins_alone, committed_charges, libpq_trace, simple_queries
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="the BEGIN with a statement: PostgreSQL's"
    ),
    pytest.mark.skipif(
        connection.settings_dict["OPTIONS"].get("prepare_threshold") is not None,
        reason="with prepared statements psycopg sends BEGIN alone",
    ),
]
IDENTITY = {"account": "consumer:mail", "operation": "mail.send"}
CHARGES = Charge._meta.db_table


def round_trips(lines: list[str]) -> int:
    return sum("\tReadyForQuery\t" in line for line in lines)


def charge(amount: int = 1) -> int:
    return Charge.objects.create(account="consumer", amount=amount, currency="EUR").pk


def assert_connection_as_before() -> None:
    """Back in autocommit, Django's and psycopg's, nothing open, no wrapper left."""
    assert not connection.in_atomic_block
    assert connection.get_autocommit()
    assert connection.connection.autocommit
    assert connection.connection.info.transaction_status == 0  # idle
    assert connection.execute_wrappers == []


def once(body: Callable[[], Any], key: str = "k-1") -> Any:
    return run_once(body, **IDENTITY, key=key)


def test_a_first_operation_takes_three_round_trips() -> None:
    """The claim; BEGIN with the INSERT; the completion with the COMMIT."""
    with libpq_trace() as lines:
        pk = once(charge)
    assert round_trips(lines) == 3
    sent = simple_queries(lines)
    assert len(sent) == 3
    assert sent[1].startswith('"BEGIN; INSERT INTO')
    assert sent[2].endswith('; COMMIT"')
    assert not begins_alone(lines)
    assert Charge.objects.get().pk == pk  # the statement's own result read back
    assert committed_charges() == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    assert_connection_as_before()
    # The replay: the claim alone, and nothing runs again.
    with libpq_trace() as lines:
        assert once(charge) == pk
    assert round_trips(lines) == 1
    assert committed_charges() == 1


def test_a_body_without_statements_sends_its_transaction_in_one_round_trip() -> None:
    with libpq_trace() as lines:
        assert once(lambda: "done") == "done"
    assert round_trips(lines) == 2
    assert simple_queries(lines)[1].startswith('"BEGIN; WITH done AS')
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    assert_connection_as_before()


def test_every_statement_after_the_first_stays_in_the_transaction() -> None:
    """Work after the first statement, then a failure: all of it rolled back."""

    def fails_after_work() -> None:
        charge()
        charge()
        assert committed_charges() == 0  # not committed while the body runs
        raise RuntimeError("after the work")

    with pytest.raises(RuntimeError):
        once(fails_after_work)
    assert committed_charges() == 0
    assert not IdempotencyRecord.objects.exists()  # released: a retry runs afresh
    assert_connection_as_before()
    assert once(charge) > 0
    assert committed_charges() == 1


def test_a_first_statement_the_client_refuses_leaves_the_transaction_to_psycopg() -> None:
    """A value psycopg cannot adapt fails before anything is sent: the BEGIN did not go,
    and the next statement still opens the transaction (never autocommitted)."""

    def refused_then_work() -> None:
        with pytest.raises(DatabaseError), connection.cursor() as cursor:
            cursor.execute("SELECT %s", [object()])  # type: ignore[list-item]
        charge()
        assert committed_charges() == 0
        raise RuntimeError("after the work")

    with pytest.raises(RuntimeError):
        once(refused_then_work)
    assert committed_charges() == 0
    assert_connection_as_before()


def test_a_first_statement_the_server_refuses_rolls_the_transaction_back() -> None:
    """The first statement fails on the server inside a savepoint the body took: the
    transaction it began goes on, and commits the rest."""

    def refused_in_a_savepoint() -> int:
        with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")
        return charge()

    with libpq_trace() as lines:
        pk = once(refused_in_a_savepoint)
    assert simple_queries(lines)[1].startswith('"BEGIN; SAVEPOINT')
    assert Charge.objects.get().pk == pk
    assert committed_charges() == 1
    assert_connection_as_before()


def test_a_first_statement_that_fails_outright_rolls_back_and_releases() -> None:
    def refused() -> None:
        with connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO {CHARGES} (account) VALUES (NULL)")

    with pytest.raises(DatabaseError):
        once(refused)
    assert not IdempotencyRecord.objects.exists()
    assert_connection_as_before()
    assert once(charge) > 0
    assert committed_charges() == 1


def test_executemany_first_gets_psycopgs_own_begin() -> None:
    def many_then_fail() -> None:
        with connection.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO {CHARGES} (account, amount, currency, provider_charge,"
                " created_at) VALUES (%s, %s, %s, '', now())",
                [("a", 1, "EUR"), ("b", 2, "EUR")],
            )
        assert committed_charges() == 0
        raise RuntimeError("after the work")

    with libpq_trace() as lines, pytest.raises(RuntimeError):
        once(many_then_fail)
    assert begins_alone(lines)
    assert committed_charges() == 0
    assert_connection_as_before()


@pytest.mark.skipif(
    bool(connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS")),
    reason="QuerySet.iterator() without a server-side cursor (PgBouncer's settings)",
)
def test_a_server_side_cursor_first_gets_psycopgs_own_begin() -> None:
    Charge.objects.create(account="before", amount=1, currency="EUR")

    def iterate_then_write() -> list[str]:
        accounts = [c.account for c in Charge.objects.all().iterator(chunk_size=10)]
        charge()
        return accounts

    with libpq_trace() as lines:
        assert once(iterate_then_write) == ["before"]
    assert begins_alone(lines)
    assert committed_charges() == 2
    assert_connection_as_before()


def test_the_connections_isolation_level_rides_with_its_begin() -> None:
    from psycopg import IsolationLevel

    def isolation() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            return str(cursor.fetchone()[0])

    connection.ensure_connection()
    raw = connection.connection
    raw.isolation_level = IsolationLevel.REPEATABLE_READ
    try:
        with libpq_trace() as lines:
            assert once(isolation) == "repeatable read"
    finally:
        raw.isolation_level = None
    assert simple_queries(lines)[1].startswith('"BEGIN ISOLATION LEVEL REPEATABLE READ; SHOW')


def test_inside_a_callers_transaction_nothing_rides() -> None:
    with libpq_trace() as lines, transaction.atomic():
        once(charge)
        assert committed_charges() == 0
        transaction.set_rollback(True)
    assert not any(q.startswith('"BEGIN;') for q in simple_queries(lines))
    assert committed_charges() == 0
    assert connection.execute_wrappers == []


def test_wrappers_of_the_caller_and_the_body_see_the_statements_as_sent_by_django() -> None:
    seen: list[str] = []

    def outer(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    def body() -> int:
        with connection.execute_wrapper(outer):
            return charge()

    with connection.execute_wrapper(outer), CaptureQueriesContext(connection) as logged:
        once(body)
    # The caller's wrapper: the claim, the INSERT, the completion; the body's: the INSERT.
    assert len(seen) == 4
    assert not any(sql.startswith("BEGIN") for sql in seen)
    # (Django logs its own "BEGIN" when the block starts; never the statement's.)
    assert not any(q["sql"].startswith("BEGIN;") for q in logged.captured_queries)
    assert connection.execute_wrappers == []
    assert committed_charges() == 1
    # A caller's wrapper only: the BEGIN rides, and that wrapper saw the statement unchanged.
    seen.clear()
    with connection.execute_wrapper(outer), libpq_trace() as lines:
        once(charge, key="k-2")
    assert simple_queries(lines)[1].startswith('"BEGIN; INSERT')
    assert len(seen) == 3
    assert seen[1].startswith("INSERT")
    assert committed_charges() == 2


def test_a_wrapper_that_runs_the_statement_again_finds_the_ride_gone() -> None:
    """A caller's wrapper retrying the statement: the second run is the statement alone,
    inside the transaction the first began."""
    runs: list[str] = []

    def twice(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith("INSERT") and not runs:
            runs.append(sql)
            execute(sql, params, many, context)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(twice):
        once(charge)
    assert committed_charges() == 2  # the wrapper's choice: both INSERTs, in one commit
    assert_connection_as_before()


def test_a_first_statement_in_psycopgs_pipeline_mode_gets_psycopgs_own_begin() -> None:
    def in_a_pipeline() -> int:
        connection.ensure_connection()
        with connection.connection.pipeline():
            pk = charge()
        charge()
        assert committed_charges() == 0
        return pk

    with libpq_trace() as lines:
        once(in_a_pipeline)
    assert begins_alone(lines)
    assert committed_charges() == 2
    assert_connection_as_before()
