"""The completion that carries the COMMIT, against the work's transaction: deferred checks
failing at the COMMIT, on_commit callbacks, cursors and savepoints left open, a statement
timeout and a terminated backend on the merged statement (PostgreSQL, psycopg 3)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection, connections, transaction

from django_idempotency import StoreUnavailable, run_once
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import assert_released_or_given_back, committed_charges
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's"),
]
IDENTITY = {"account": "consumer:mail", "operation": "mail.send"}


def clean_connection() -> None:
    assert not connection.in_atomic_block
    assert not connection.needs_rollback
    if connection.connection is not None:
        assert connection.connection.info.transaction_status == 0


@pytest.fixture
def deferred_table() -> Any:
    with connections["provider"].cursor() as cursor:
        cursor.execute(
            "CREATE TABLE deferred_work (n integer,"
            " CONSTRAINT deferred_work_n UNIQUE (n) DEFERRABLE INITIALLY DEFERRED)"
        )
        cursor.execute(
            "CREATE FUNCTION deferred_ratio() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM 1 / NEW.n; RETURN NULL; END $$"
        )
        cursor.execute(
            "CREATE CONSTRAINT TRIGGER deferred_ratio AFTER INSERT ON deferred_work"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION deferred_ratio()"
        )
    yield
    connection.close()
    with connections["provider"].cursor() as cursor:
        cursor.execute("DROP TABLE deferred_work")
        cursor.execute("DROP FUNCTION deferred_ratio()")


def insert_twice(calls: list[str], values: tuple[int, int]) -> str:
    calls.append("x")
    Charge.objects.create(account="consumer", amount=1, currency="EUR")
    with connection.cursor() as cursor:
        for n in values:
            cursor.execute("INSERT INTO deferred_work VALUES (%s)", [n])
    return "done"


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_deferred_unique_failing_at_commit_is_503_nothing_committed(deferred_table, policy):
    calls: list[str] = []
    with pytest.raises(StoreUnavailable):
        run_once(insert_twice, calls, (1, 1), **IDENTITY, key="k-1", recovery=policy)
    clean_connection()
    assert calls == ["x"]
    assert committed_charges() == 0
    assert_released_or_given_back(policy)


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_deferred_trigger_dividing_by_zero_at_commit_is_not_a_lost_lease(deferred_table, policy):
    """The body's own deferred check fails at COMMIT with a division by zero: the lease was
    never lost, so the answer is the store's failure (503, claim released or given back),
    never a 409 lease_lost with the record left claimed for a whole lease."""
    calls: list[str] = []
    with pytest.raises(StoreUnavailable):
        run_once(insert_twice, calls, (0, 5), **IDENTITY, key="k-1", recovery=policy)
    clean_connection()
    assert committed_charges() == 0
    assert_released_or_given_back(policy)


def test_on_commit_callbacks_run_once_after_the_commit():
    seen: list[int] = []

    def body() -> str:
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        transaction.on_commit(lambda: seen.append(committed_charges()))
        transaction.on_commit(lambda: seen.append(-1), robust=True)
        return "ok"

    assert run_once(body, **IDENTITY, key="k-1") == "ok"
    clean_connection()
    assert seen == [1, -1]
    assert run_once(body, **IDENTITY, key="k-1") == "ok"
    assert seen == [1, -1]


def test_a_failing_robust_callback_does_not_run_twice():
    seen: list[str] = []

    def boom() -> None:
        seen.append("boom")
        raise RuntimeError("callback")

    def body() -> str:
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        transaction.on_commit(boom, robust=True)
        transaction.on_commit(lambda: seen.append("after"))
        return "ok"

    assert run_once(body, **IDENTITY, key="k-1") == "ok"
    assert seen == ["boom", "after"]
    clean_connection()


def test_a_server_side_cursor_left_open_by_the_body():
    Charge.objects.create(account="consumer", amount=1, currency="EUR")
    Charge.objects.create(account="consumer", amount=2, currency="EUR")
    kept: list[Any] = []

    def body() -> str:
        iterator = Charge.objects.iterator(chunk_size=1)
        next(iterator)
        kept.append(iterator)
        Charge.objects.create(account="consumer", amount=3, currency="EUR")
        return "ok"

    assert run_once(body, **IDENTITY, key="k-1") == "ok"
    clean_connection()
    assert committed_charges() == 3
    kept[0].close()
    del kept[:]
    clean_connection()
    assert Charge.objects.count() == 3
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


def test_savepoints_left_in_the_body_and_select_for_update():
    def body() -> str:
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        sid = transaction.savepoint()
        Charge.objects.create(account="consumer", amount=2, currency="EUR")
        transaction.savepoint_rollback(sid)
        transaction.savepoint()  # left open
        list(Charge.objects.select_for_update())
        try:
            with transaction.atomic():
                Charge.objects.create(account="consumer", amount=3, currency="EUR")
                raise ValueError
        except ValueError:
            pass
        return "ok"

    assert run_once(body, **IDENTITY, key="k-1") == "ok"
    clean_connection()
    assert committed_charges() == 1
    assert connection.savepoint_ids == []


def raw() -> Any:
    import psycopg

    settings = connection.settings_dict
    return psycopg.connect(
        host=settings["HOST"] or None,
        port=settings["PORT"] or None,
        user=settings["USER"],
        dbname=settings["NAME"],
        autocommit=True,
    )


class RowHolder(threading.Thread):
    """Holds the record's row for ``seconds`` from another session (a purge's batch, a
    rotation), once started."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.locked = threading.Event()

    def run(self) -> None:
        with raw() as other, other.transaction():
            other.execute(f"SELECT 1 FROM {IdempotencyRecord._meta.db_table} FOR UPDATE")
            self.locked.set()
            time.sleep(self.seconds)


def test_statement_timeout_on_the_merged_statement():
    """Another session holds the record's row: the completion waits, the statement
    timeout cancels it: 503, nothing committed, the claim released."""
    calls: list[str] = []
    holder = RowHolder(1.5)

    def body() -> str:
        calls.append("x")
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = '300ms'")
        holder.start()
        assert holder.locked.wait(5)
        return "ok"

    try:
        with pytest.raises(StoreUnavailable):
            run_once(body, **IDENTITY, key="k-1")
    finally:
        holder.join(10)
    clean_connection()
    assert calls == ["x"]
    assert committed_charges() == 0
    assert IdempotencyRecord.objects.count() == 0
    assert run_once(lambda: "again", **IDENTITY, key="k-1") == "again"


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_backend_terminated_while_the_merged_statement_waits(policy):
    calls: list[str] = []
    pid: list[int] = []
    holder = RowHolder(2.0)
    killed = threading.Event()

    def killer() -> None:
        deadline = time.monotonic() + 10
        with raw() as other:
            while time.monotonic() < deadline:
                row = other.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                    [pid[0]],
                ).fetchone()
                if row:
                    other.execute("SELECT pg_terminate_backend(%s)", [pid[0]])
                    killed.set()
                    return
                time.sleep(0.02)

    thread = threading.Thread(target=killer)

    def body() -> str:
        calls.append("x")
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid.append(cursor.fetchone()[0])
        holder.start()
        assert holder.locked.wait(5)
        thread.start()
        return "ok"

    try:
        with pytest.raises(StoreUnavailable):
            run_once(body, **IDENTITY, key="k-1", recovery=policy)
    finally:
        holder.join(10)
        thread.join(10)
    assert killed.is_set()
    assert not connection.in_atomic_block
    assert not connection.needs_rollback
    assert calls == ["x"]
    assert committed_charges() == 0
    records = list(IdempotencyRecord.objects.all())  # the connection is usable again
    if policy == "retry":
        assert records == []
    else:
        assert len(records) == 1
        assert records[0].status == RecordStatus.IN_PROGRESS
    assert run_once(lambda: "again", **IDENTITY, key="k-2") == "again"


def test_two_attempts_race_on_a_takeover_while_the_first_one_runs():
    """The first attempt outlives its lease; a second takes the record over and completes.
    The first one's completion (the COMMIT carried) finds no row of its lease: nothing of
    its work commits, and the second one's outcome stands."""
    from django_idempotency import InProgress

    calls: list[str] = []
    taken_over = threading.Event()
    errors: list[BaseException] = []
    states: list[tuple[bool, bool, int]] = []

    def first() -> str:
        calls.append("first")
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        assert taken_over.wait(20)
        return "first"

    def second() -> str:
        calls.append("second")
        Charge.objects.create(account="consumer", amount=2, currency="EUR")
        return "second"

    def run_first() -> None:
        try:
            run_once(first, **IDENTITY, key="k-1", lease=1)
        except BaseException as exc:
            errors.append(exc)
        finally:
            states.append(
                (
                    connection.in_atomic_block,
                    connection.needs_rollback,
                    connection.connection.info.transaction_status,
                )
            )
            connection.close()

    thread = threading.Thread(target=run_first)
    thread.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            assert run_once(second, **IDENTITY, key="k-1", lease=30) == "second"
            break
        except InProgress:
            continue
    taken_over.set()
    thread.join(30)
    assert calls == ["first", "second"]
    assert len(errors) == 1
    assert isinstance(errors[0], InProgress)
    assert states == [(False, False, 0)]
    assert committed_charges() == 1
    assert list(Charge.objects.values_list("amount", flat=True)) == [2]
    record = IdempotencyRecord.objects.get()
    assert record.status == RecordStatus.COMPLETED
    assert run_once(second, **IDENTITY, key="k-1") == "second"
    assert calls == ["first", "second"]


def test_an_operation_run_from_an_on_commit_callback_of_another():
    """A callback of the first operation's commit runs a second operation (its own
    transaction, its COMMIT carried too): each body once, both records completed, once."""
    calls: list[str] = []

    def second() -> str:
        calls.append("second")
        Charge.objects.create(account="consumer", amount=2, currency="EUR")
        return "second"

    def first() -> str:
        calls.append("first")
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        transaction.on_commit(lambda: run_once(second, **IDENTITY, key="k-2"))
        return "first"

    assert run_once(first, **IDENTITY, key="k-1") == "first"
    clean_connection()
    assert calls == ["first", "second"]
    assert committed_charges() == 2
    statuses = set(IdempotencyRecord.objects.values_list("status", flat=True))
    assert statuses == {RecordStatus.COMPLETED}
    assert IdempotencyRecord.objects.count() == 2
    assert run_once(first, **IDENTITY, key="k-1") == "first"
    assert calls == ["first", "second"]


def test_with_server_side_binding_the_completion_is_sent_alone():
    """OPTIONS["server_side_binding"]: the statements go through the extended protocol,
    which takes one statement at a time: the completion is sent alone, the block commits."""
    from tests.helpers import is_completion

    options = connection.settings_dict["OPTIONS"]
    connection.close()
    options["server_side_binding"] = True
    sent: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if is_completion(sql):
            sent.append(sql)
        return execute(sql, params, many, context)

    def body() -> str:
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        return "ok"

    try:
        with connection.execute_wrapper(wrapper):
            assert run_once(body, **IDENTITY, key="k-1") == "ok"
        assert type(connection.connection.cursor()).__name__ == "ServerBindingCursor"
    finally:
        connection.close()
        del options["server_side_binding"]
    assert len(sent) == 1
    assert not sent[0].rstrip().endswith("COMMIT")
    assert committed_charges() == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
