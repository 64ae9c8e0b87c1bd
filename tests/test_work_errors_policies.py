"""The work's own transaction refused as a deadlock or a serialization failure, or its
connection lost while the view catches the error itself: what each recovery policy keeps.

Under ``"fail"`` (and a callable policy) the body's external calls may have happened: a
retry must never run the body again, whatever the database refused (PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.utils import timezone

from django_idempotency import StoreUnavailable, run_once
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import assert_released_or_given_back, postgres_only
from tests.testapp.models import Charge, ProviderCall

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    postgres_only,
]
on_postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="PostgreSQL's SQLSTATEs and pg_sleep"
)
IDENTITY = {"account": "consumer:mail", "operation": "mail.send"}


def provider_calls() -> int:
    return ProviderCall.objects.using("provider").count()


def committed_charges() -> int:
    return Charge.objects.using("provider").count()


def refused_as(sqlstate: str) -> Any:
    """A body that calls the provider, writes, and then has its transaction refused by the
    server with ``sqlstate`` (a deadlock 40P01, a serialization failure 40001)."""

    def body() -> str:
        ProviderCall.objects.using("provider").create(key="charge")
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        with connection.cursor() as cursor:
            cursor.execute(
                f"DO $$ BEGIN RAISE EXCEPTION 'refused' USING ERRCODE = '{sqlstate}'; END $$"
            )
        return "charged"

    return body


def cut_own_connection() -> None:
    """End the server side of the default connection from another one, as an administrator
    or a failover would (``pg_terminate_backend``; ``KILL`` on MariaDB)."""
    mysql = connection.vendor == "mysql"
    with connection.cursor() as cursor:
        cursor.execute("SELECT CONNECTION_ID()" if mysql else "SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    with connections["provider"].cursor() as cursor:
        cursor.execute("KILL %s" if mysql else "SELECT pg_terminate_backend(%s)", [pid])


def reconcile(record: Any) -> None:
    return None  # a callable policy that cannot tell: retry


@on_postgresql
@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
@pytest.mark.parametrize("policy", ["fail", reconcile], ids=["fail", "callable"])
def test_a_refused_transaction_under_a_keeping_policy_never_runs_the_body_again(
    sqlstate: str, policy: Any
) -> None:
    with pytest.raises(StoreUnavailable) as refused:
        run_once(refused_as(sqlstate), **IDENTITY, key="k-1", recovery=policy)
    assert refused.value.ran
    assert provider_calls() == 1
    assert committed_charges() == 0
    record = IdempotencyRecord.objects.get()  # kept, its lease given back
    assert record.status == RecordStatus.IN_PROGRESS
    assert record.lease_expires_at <= timezone.now()


@on_postgresql
@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
def test_a_refused_transaction_under_retry_releases(sqlstate: str) -> None:
    with pytest.raises(StoreUnavailable):
        run_once(refused_as(sqlstate), **IDENTITY, key="k-1", recovery="retry")
    assert provider_calls() == 1
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_a_view_that_catches_the_lost_connection_and_answers(policy: str) -> None:
    """The body's connection is terminated under it; the body catches the error and
    returns normally: its outcome cannot be stored (503, ran), nothing commits."""

    def body() -> str:
        ProviderCall.objects.using("provider").create(key="charge")
        cut_own_connection()
        try:
            Charge.objects.create(account="consumer", amount=1, currency="EUR")
        except OperationalError:
            return "swallowed"
        return "wrote"

    with pytest.raises(StoreUnavailable) as refused:
        run_once(body, **IDENTITY, key="k-1", recovery=policy)
    assert refused.value.ran
    assert not connection.in_atomic_block
    assert provider_calls() == 1
    assert committed_charges() == 0
    assert_released_or_given_back(policy)


@on_postgresql
def test_a_caught_statement_timeout_still_stores_the_answer() -> None:
    """The body's own error, caught and answered on a connection that still works: its
    answer is stored (its transaction rolled back), and replayed."""
    calls: list[str] = []

    def body() -> str:
        calls.append("x")
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = '50ms'")
            try:
                with transaction.mark_for_rollback_on_error():
                    cursor.execute("SELECT pg_sleep(1)")
            except OperationalError:
                return "timed out"
        return "slept"

    assert run_once(body, **IDENTITY, key="k-1", recovery="fail") == "timed out"
    assert run_once(body, **IDENTITY, key="k-1", recovery="fail") == "timed out"
    assert calls == ["x"]
    assert committed_charges() == 0
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_a_closed_cursor_in_the_body_is_the_bodys_error_not_a_lost_connection(
    policy: str,
) -> None:
    """The driver's InterfaceError for a cursor the body closed itself, on a connection that
    works: the body's own error (it propagates, the claim released), never the store's
    503 with its lease given back."""
    from django.db import InterfaceError, ProgrammingError

    calls: list[str] = []

    def body() -> str:
        calls.append("x")
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        with connection.cursor() as cursor:
            pass
        cursor.execute("SELECT 1")
        return "unreachable"

    with pytest.raises((InterfaceError, ProgrammingError)):  # psycopg's, MySQLdb's
        run_once(body, **IDENTITY, key="k-1", recovery=policy)
    assert committed_charges() == 0
    assert IdempotencyRecord.objects.count() == 0  # released: the retry runs afresh
    assert calls == ["x"]


def test_under_resume_a_step_whose_connection_is_lost_is_store_unavailable() -> None:
    """A resumable operation's step loses its connection (the backend terminated under
    it): the store's failure, as in one transaction (503 / StoreUnavailable, ran), the
    steps recorded before it kept, the lease given back; never the body's own error."""
    from django_idempotency import step

    def first() -> str:
        ProviderCall.objects.using("provider").create(key="first")
        return "one"

    def second() -> str:
        cut_own_connection()
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        return "two"

    def body() -> str:
        step("first", first)
        step("second", second)
        return "done"

    with pytest.raises(StoreUnavailable) as refused:
        run_once(body, **IDENTITY, key="k-1", recovery="resume")
    assert refused.value.ran
    assert provider_calls() == 1
    assert committed_charges() == 0
    record = IdempotencyRecord.objects.get()
    assert record.status == RecordStatus.IN_PROGRESS
    assert record.lease_expires_at <= timezone.now()


@on_postgresql
@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
def test_under_resume_a_step_refused_as_a_deadlock_or_a_conflict_is_store_unavailable(
    sqlstate: str,
) -> None:
    """A resumable operation's step has its transaction refused by the server (a deadlock,
    a serialization failure; on Galera a certification conflict, at its COMMIT when
    another node took the record over): the store's failure, as in one transaction (503 /
    StoreUnavailable, ran), never the view's 500. The step before it is kept, the failing
    step's write rolled back, the lease given back; the next attempt resumes after the
    first step, which never runs again."""
    from django_idempotency import step

    ran: list[str] = []

    def first() -> str:
        ran.append("first")
        ProviderCall.objects.using("provider").create(key="first")
        return "one"

    def second() -> str:
        ran.append("second")
        if ran.count("second") == 1:  # refused the first time only
            refused_as(sqlstate)()
        return "two"

    def body() -> str:
        return step("first", first) + step("second", second)

    with pytest.raises(StoreUnavailable) as refused:
        run_once(body, **IDENTITY, key="k-1", recovery="resume")
    assert refused.value.ran
    assert provider_calls() == 2  # the first step's, and the refused step's own
    assert committed_charges() == 0
    record = IdempotencyRecord.objects.get()
    assert record.status == RecordStatus.IN_PROGRESS
    assert record.lease_expires_at <= timezone.now()

    assert run_once(body, **IDENTITY, key="k-1", recovery="resume") == "onetwo"
    assert ran == ["first", "second", "second"]
    assert provider_calls() == 2
