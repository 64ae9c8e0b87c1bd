"""Attacks on the BEGIN that rides with the body's first statement (PostgreSQL, psycopg 3, on
Django's defaults) and on the claim sent as text.

The ride puts psycopg's connection in autocommit for the body's first statement, so that
psycopg sends no ``BEGIN`` of its own, and the transaction that statement began goes on.
Whatever reads psycopg's autocommit while that transaction is open must still find the
state psycopg's own ``BEGIN`` would have left: Django's server-side cursors (holdable only
outside a transaction), and psycopg itself once the transaction ends under a block that is
still open (a statement after it must open a new transaction, never autocommit). Each test
counts the committed rows.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.db.models import F

from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests import test_begin_rides as rides
from tests.helpers import begins_alone, committed_charges, libpq_trace, simple_queries
from tests.test_begin_rides import CHARGES, assert_connection_as_before, charge, once
from tests.testapp.models import Charge

pytestmark = rides.pytestmark
server_side_cursors = pytest.mark.skipif(
    bool(connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS")),
    reason="QuerySet.iterator() without a server-side cursor (PgBouncer's settings)",
)


def test_the_ride_rides() -> None:
    """The attacks below are on the ride: it is taken here."""
    with libpq_trace() as lines:
        once(charge)
    assert simple_queries(lines)[1].startswith('"BEGIN; INSERT')


@server_side_cursors
def test_select_for_update_iterated_after_the_first_statement() -> None:
    """Django declares a server-side cursor WITH HOLD when psycopg's connection is in
    autocommit (a cursor used outside a transaction), and PostgreSQL refuses a holdable
    cursor FOR UPDATE. Inside the block, after the first statement, psycopg's connection
    must not look as if it were in autocommit."""
    Charge.objects.create(account="before", amount=1, currency="EUR")

    def charge_then_lock_and_bump() -> int:
        charge()
        bumped = 0
        for row in Charge.objects.select_for_update().order_by("pk").iterator(chunk_size=1):
            row.amount += 1
            row.save(update_fields=["amount"])
            bumped += 1
        return bumped

    assert once(charge_then_lock_and_bump) == 2
    assert committed_charges() == 2
    assert sorted(Charge.objects.values_list("amount", flat=True)) == [2, 2]
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    assert_connection_as_before()


@server_side_cursors
def test_a_cursor_left_open_is_not_materialised_at_the_commit() -> None:
    """A server-side cursor of the body's still open when the completion commits: a
    cursor declared inside a transaction ends with it; a holdable one is run to its end
    at the COMMIT (here failing on a row the body never read), and the work with it."""
    Charge.objects.create(account="before", amount=1, currency="EUR")
    Charge.objects.create(account="poison", amount=5, currency="EUR")
    kept: list[Any] = []

    def charge_then_peek() -> str:
        charge(amount=3)
        rows = (
            Charge.objects.annotate(inverse=1 / (F("amount") - 5))
            .order_by("pk")
            .values_list("account", "inverse")
            .iterator(chunk_size=1)
        )
        kept.append(rows)  # a generator still referenced when the body returns
        return str(next(rows)[0])

    try:
        assert once(charge_then_peek) == "before"
    finally:
        kept.clear()
    assert committed_charges() == 3
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    assert_connection_as_before()


def test_a_callers_wrapper_that_retries_a_first_statement_after_a_rollback() -> None:
    """A caller's execute wrapper that retries a statement refused for a lock (NOWAIT),
    after rolling the (just begun) transaction back on the driver: the retried statement
    and everything after it stay in one transaction with the completion; a body that fails
    after them leaves nothing committed, so its retry cannot apply the bump twice."""
    blocker_pk = Charge.objects.create(account="locked", amount=1, currency="EUR").pk
    locked = threading.Event()
    release = threading.Event()

    def hold_the_row() -> None:
        try:
            with transaction.atomic(using="provider"):
                Charge.objects.using("provider").select_for_update().get(pk=blocker_pk)
                locked.set()
                release.wait(10)
        finally:
            connections["provider"].close()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    assert locked.wait(10)
    retried: list[str] = []

    def retry_on_lock(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        try:
            return execute(sql, params, many, context)
        except OperationalError:
            retried.append(sql)
            context["connection"].connection.rollback()  # the failed statement's transaction
            release.set()
            holder.join(10)
            return execute(sql, params, many, context)

    def lock_bump_then_fail() -> None:
        row = Charge.objects.select_for_update(nowait=True).get(pk=blocker_pk)
        Charge.objects.filter(pk=row.pk).update(amount=F("amount") + 1)
        charge()
        raise RuntimeError("after the work")

    try:
        with connection.execute_wrapper(retry_on_lock), pytest.raises(RuntimeError):
            once(lock_bump_then_fail)
    finally:
        release.set()
        holder.join(10)
    assert len(retried) == 1
    # Nothing of the failed body committed: the bump and the charge were rolled back.
    assert Charge.objects.get(pk=blocker_pk).amount == 1
    assert committed_charges() == 1
    assert not IdempotencyRecord.objects.exists()
    assert_connection_as_before()


def test_the_backend_terminated_during_the_first_statement() -> None:
    """The first statement (with its BEGIN) cut by pg_terminate_backend: the store's failure,
    nothing committed, and the next operation on the replaced connection is one transaction
    again."""
    from django_idempotency.exceptions import StoreUnavailable

    killed = threading.Event()

    def terminate() -> None:
        other = connections["provider"]
        try:
            for _ in range(200):
                with other.cursor() as cursor:
                    cursor.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE query LIKE %s AND pid <> pg_backend_pid()",
                        ["%SELECT pg_sleep(5)"],
                    )
                    if cursor.fetchone() is not None:
                        killed.set()
                        return
                threading.Event().wait(0.02)
        finally:
            other.close()

    def sleep_first() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(5)")
        charge()

    killer = threading.Thread(target=terminate)
    killer.start()
    with pytest.raises(StoreUnavailable):
        once(sleep_first)
    killer.join(10)
    assert killed.is_set()
    assert committed_charges() == 0
    connection.close()

    def work_then_fail() -> None:
        charge()
        charge()
        raise RuntimeError("after the work")

    with pytest.raises(RuntimeError):
        once(work_then_fail, key="k-2")
    assert committed_charges() == 0
    assert_connection_as_before()
    once(charge, key="k-3")
    assert committed_charges() == 1


def test_a_first_statement_the_server_cannot_parse_then_work_then_failure() -> None:
    """A syntax error fails the whole text (the BEGIN with it): nothing began, and the
    body's next statements still run in one transaction, rolled back with the body."""
    from django.db import ProgrammingError

    def unparsable_then_work() -> None:
        with pytest.raises(ProgrammingError), connection.cursor() as cursor:
            cursor.execute("SELEC 1")
        charge()
        assert connection.connection.info.transaction_status != 0
        assert committed_charges() == 0
        raise RuntimeError("after the work")

    with pytest.raises(RuntimeError):
        once(unparsable_then_work)
    assert committed_charges() == 0
    assert_connection_as_before()


def test_djangos_query_log_shows_the_first_statement_as_django_sent_it() -> None:
    """Django's log reads psycopg's last query text: while it logs, the BEGIN goes alone."""
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as logged, libpq_trace() as lines:
        once(charge)
    assert begins_alone(lines)
    logged_sql = [query["sql"] for query in logged.captured_queries]
    assert any(sql.startswith("INSERT INTO") for sql in logged_sql), logged_sql
    assert not any(sql.startswith("BEGIN;") for sql in logged_sql), logged_sql


def test_raw_psycopg_statements_first_stay_in_the_transaction() -> None:
    """The driver's own cursor and COPY first (no execute wrapper sees them): psycopg sends
    its BEGIN, the ride steps aside, and everything rolls back with the body."""

    def raw_first_then_fail() -> None:
        raw = connection.connection
        with raw.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {CHARGES} (account, amount, currency, provider_charge, created_at)"
                " VALUES ('raw', 1, 'EUR', '', now())"
            )
            with cursor.copy(
                f"COPY {CHARGES} (account, amount, currency, provider_charge, created_at)"
                " FROM STDIN"
            ) as copy:
                copy.write_row(("copied", 1, "EUR", "", "2026-01-01T00:00:00Z"))
        charge()
        assert committed_charges() == 0
        raise RuntimeError("after the work")

    with pytest.raises(RuntimeError):
        once(raw_first_then_fail)
    assert committed_charges() == 0
    assert_connection_as_before()


def test_a_first_update_counts_its_own_rows() -> None:
    """Django reads the first statement's row count (an UPDATE's, a save() that updates
    rather than inserts): the statement's own, never the BEGIN's."""
    existing = Charge.objects.create(account="before", amount=1, currency="EUR")
    Charge.objects.create(account="before", amount=1, currency="EUR")

    def update_first() -> int:
        return Charge.objects.filter(account="before").update(amount=F("amount") + 1)

    def save_first() -> int:
        row = Charge(pk=existing.pk, account="saved", amount=7, currency="EUR")
        row.created_at = existing.created_at
        row.save()  # an UPDATE that finds its row: no INSERT after it
        return Charge.objects.count()

    assert once(update_first) == 2
    assert once(save_first, key="k-2") == 2
    assert committed_charges() == 2
    assert Charge.objects.get(pk=existing.pk).amount == 7


def test_an_isolation_level_the_body_sets_before_its_first_statement() -> None:
    """psycopg's BEGIN carries the isolation level its connection has when the transaction
    begins: a body that asks the driver for SERIALIZABLE before its first statement gets
    it, the BEGIN riding or not."""
    from psycopg import IsolationLevel

    changed: list[Any] = []

    def serializable() -> str:
        changed.append(connection.connection)
        connection.connection.isolation_level = IsolationLevel.SERIALIZABLE
        with connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            return str(cursor.fetchone()[0])

    try:
        assert once(serializable) == "serializable"
    finally:
        for raw in changed:  # never left to the next user of a pooled connection
            raw.isolation_level = None


def _succeeds() -> int:
    return charge()


def _fails_after_work() -> None:
    charge()
    raise RuntimeError("after the work")


def _first_statement_refused_by_the_server() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {CHARGES} (account) VALUES (NULL)")


def _first_statement_refused_by_the_client() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s", [object()])  # type: ignore[list-item]


def _sets_rollback_after_work() -> int:
    charge()
    transaction.set_rollback(True)
    return 1


@pytest.mark.parametrize(
    "body",
    [
        _succeeds,
        _fails_after_work,
        _first_statement_refused_by_the_server,
        _first_statement_refused_by_the_client,
        _sets_rollback_after_work,
    ],
)
def test_the_next_writes_on_the_connection_after_a_ride(body: Callable[[], Any]) -> None:
    """Whatever the ridden block did, the connection's next writes: one outside a block
    commits at once, one inside a block commits only with it (and a failure rolls it
    back)."""
    with contextlib.suppress(Exception):  # each body's own way of failing
        once(body)
    before = committed_charges()
    assert_connection_as_before()
    charge()
    assert committed_charges() == before + 1  # autocommitted

    def two_then_fail() -> None:
        with transaction.atomic():
            charge()
            charge()
            assert committed_charges() == before + 1
            raise RuntimeError("inside a block")

    with pytest.raises(RuntimeError):
        two_then_fail()
    assert committed_charges() == before + 1
    with transaction.atomic():
        charge()
        assert committed_charges() == before + 1
    assert committed_charges() == before + 2
    assert_connection_as_before()


def test_on_commit_callbacks_of_a_ridden_block() -> None:
    """Registered after the first statement: run once after the COMMIT the completion
    carried, never for a body that failed; a callback's write autocommits."""
    ran: list[str] = []

    def registers(tag: str, fail: bool) -> int:
        pk = charge()

        def callback() -> None:
            ran.append(tag)
            charge(amount=9)

        transaction.on_commit(callback)
        if fail:
            raise RuntimeError("after the work")
        return pk

    with pytest.raises(RuntimeError):
        once(lambda: registers("failed", True))
    assert ran == []
    assert committed_charges() == 0
    once(lambda: registers("ok", False), key="k-2")
    assert ran == ["ok"]
    assert committed_charges() == 2
    assert Charge.objects.filter(amount=9).count() == 1
    assert_connection_as_before()


def test_an_isolation_level_in_options_rides_with_the_begin() -> None:
    from psycopg import IsolationLevel

    def isolation() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            return str(cursor.fetchone()[0])

    options = connection.settings_dict["OPTIONS"]
    connection.close()
    options["isolation_level"] = IsolationLevel.SERIALIZABLE
    try:
        with libpq_trace() as lines:
            assert once(isolation) == "serializable"
    finally:
        del options["isolation_level"]
        if connection.connection is not None:
            # Django's pool keeps a connection's level when OPTIONS no longer name one.
            connection.connection.isolation_level = None
        connection.close()
    assert simple_queries(lines)[1].startswith('"BEGIN ISOLATION LEVEL SERIALIZABLE; SHOW')


@pytest.mark.parametrize("expired", ["lease", "record"])
def test_a_fresh_connections_text_claim_takes_over_as_the_function_does(expired: str) -> None:
    """The first claim of a server connection is text: a stale lease of the same request,
    or an expired record, is taken over from it as from the function's answer, once."""
    from datetime import timedelta

    from django_idempotency import _store
    from django_idempotency._store import claiming
    from tests.test_claim_statement import NOW, claim_request

    request = claim_request()
    first = _store.claim(request, NOW)
    assert first.claimed
    later = NOW + (request.lease if expired == "lease" else request.ttl) + timedelta(seconds=1)
    # The next claim as its server connection's first (text), Django's pool or not.
    claiming._function_called.discard(connection.connection)
    with libpq_trace() as lines:
        taken = _store.claim(request, later)
        again = _store.claim(request, later)
    assert simple_queries(lines)[0].startswith('"WITH late AS MATERIALIZED')
    assert taken.claimed
    assert taken.state.lease_token != first.state.lease_token
    assert not again.claimed  # the function's answer: the record the takeover holds
    assert again.state.lease_token is None
    assert IdempotencyRecord.objects.filter(key=request.key).count() == 1


def test_a_rider_an_interrupted_block_left_behind_steps_aside() -> None:
    """Installed, and then the block never ran (an interruption between the two): the next
    statement outside any block autocommits as it always does, and the rider is gone."""
    from django_idempotency._store import claiming

    with transaction.atomic():
        rider = claiming.begin_riding(connection)
    assert rider is not None
    assert connection.execute_wrappers == [rider]
    with libpq_trace() as lines:
        charge()
    assert connection.execute_wrappers == []
    assert not any(query.startswith('"BEGIN') for query in simple_queries(lines))
    assert committed_charges() == 1
