"""One live task per key (``outbox.enqueue_once``) on every database, in one process.

Messages and key rows are counted; a run's state is the ``@idempotent_task`` record the
worker writes (made here as the worker makes it, or by an eager run). Real workers, relays
and racing processes: ``tests/test_unique_tasks_servers.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

import pytest
from django.db import OperationalError, connections, transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.utils import timezone

from django_idempotency import (
    InvalidKey,
    OutcomeUnknown,
    TaskAlreadyQueued,
    _unique,
    maintenance,
    outbox,
)
from django_idempotency.models import (
    IdempotencyRecord,
    OutboxMessage,
    OutboxStatus,
    OutboxUniqueKey,
)
from tests.helpers import in_thread, postgres_only

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

celery = pytest.importorskip("celery", reason="Celery is an optional dependency")

from tests.testapp.models import ProviderCall  # noqa: E402
from tests.testapp.tasks import (  # noqa: E402
    calls_a_closed_operation,
    enqueues_a_follow_up,
    fail_once,
    record_effect,
    record_effect_by_tag,
    refused_by_the_database,
)

TASK = "tests.record_effect"


def once(key: str = "nightly", task: object = record_effect, *args: Any, **options: Any) -> Any:
    with transaction.atomic():
        return outbox.enqueue_once(key, task, *(args or ("tag",)), **options)


def messages() -> int:
    return OutboxMessage.objects.count()


def run_record(message_id: uuid.UUID, status: str, lease: timedelta | None = None) -> None:
    """The worker's record of a message's run, as ``@idempotent_task`` writes it."""
    account, operation, key = _unique.record_identity(TASK, message_id)
    now = timezone.now()
    IdempotencyRecord.objects.create(
        account=account,
        operation=operation,
        key=key,
        request_hash="-",
        status=status,
        lease_token=uuid.uuid4(),
        lease_expires_at=now + lease if lease is not None else None,
        expires_at=now + timedelta(days=1),
    )


def sent(message_id: uuid.UUID) -> None:
    """Sent a minute ago: a dead run's lease that ran out since (its worker died after it
    started the run) is no older than that."""
    OutboxMessage.objects.filter(pk=message_id).update(
        status=OutboxStatus.SENT, sent_at=timezone.now() - timedelta(minutes=1)
    )


# -- one live message per key ----------------------------------------------------------------------


def test_a_free_key_writes_one_message_and_holds_the_key():
    first = once()
    assert messages() == 1
    holder = OutboxUniqueKey.objects.get()
    assert (holder.task, holder.key, holder.message_id) == (TASK, "nightly", first)
    assert holder.unique_until == "finished"


def test_a_held_key_returns_the_live_message_and_writes_nothing():
    first = once()
    assert [once() for _ in range(5)] == [first] * 5
    assert messages() == 1
    assert OutboxUniqueKey.objects.count() == 1


def test_other_arguments_under_a_held_key_write_nothing_and_answer_the_live_message():
    first = once("nightly", record_effect, "first")
    assert once("nightly", record_effect, "second") == first
    assert list(OutboxMessage.objects.values_list("args", flat=True)) == [["first"]]


def test_on_conflict_raise_carries_the_live_message_id_and_leaves_the_transaction_usable():
    first = once()
    with transaction.atomic():
        with pytest.raises(TaskAlreadyQueued) as caught:
            outbox.enqueue_once("nightly", record_effect, "tag", on_conflict="raise")
        # The caller's transaction goes on: its own writes still commit.
        outbox.enqueue(record_effect, "other work")
    assert caught.value.message_id == first
    assert isinstance(caught.value, __import__("django_idempotency").IdempotencyError)
    assert messages() == 2


def test_task_already_queued_crosses_a_process_boundary_with_its_message_id():
    """Pickled (a process pool, a result backend that pickles), as raised."""
    import pickle

    first = once()
    with pytest.raises(TaskAlreadyQueued) as caught, transaction.atomic():
        outbox.enqueue_once("nightly", record_effect, "tag", on_conflict="raise")
    copy = pickle.loads(pickle.dumps(caught.value))
    assert type(copy) is TaskAlreadyQueued
    assert (copy.message_id, str(copy)) == (first, str(caught.value))
    assert messages() == 1


def test_the_key_is_scoped_by_the_task_name():
    a = once("k", record_effect)
    b = once("k", fail_once)
    c = once("other", record_effect)
    assert len({a, b, c}) == 3
    assert messages() == 3


def test_the_tasks_own_arguments_named_key_or_task_are_the_tasks():
    """``key`` and ``task`` are positional-only: a task's own keyword arguments of those
    names go to the task, whatever the kind of task."""
    with transaction.atomic():
        by_task = outbox.enqueue_once("k", record_effect, "tag", key="its-key", task="its-task")
        by_name = outbox.enqueue_once("k", TASK, key="its-key", task="its-task")
    assert by_task == by_name
    assert list(OutboxMessage.objects.values_list("args", "kwargs")) == [
        (["tag"], {"key": "its-key", "task": "its-task"})
    ]
    assert OutboxUniqueKey.objects.get().key == "k"


def test_keys_compare_exactly():
    assert once("Nightly") != once("nightly")
    assert messages() == 2


class Undone(Exception):
    """Rolls the enqueue's transaction back."""


def enqueue_then_roll_back(key: str, task: object, *args: Any) -> None:
    with transaction.atomic():
        outbox.enqueue_once(key, task, *args)
        raise Undone


def test_an_enqueue_rolled_back_leaves_the_key_free():
    with pytest.raises(Undone):
        enqueue_then_roll_back("nightly", record_effect, "tag")
    assert (messages(), OutboxUniqueKey.objects.count()) == (0, 0)
    kept = once()
    assert OutboxMessage.objects.get().pk == kept


def test_two_enqueues_in_one_transaction_give_one_message():
    with transaction.atomic():
        a = outbox.enqueue_once("nightly", record_effect, "tag")
        b = outbox.enqueue_once("nightly", record_effect, "tag")
    assert a == b
    assert messages() == 1


# -- when a message stops holding its key ----------------------------------------------------------


@pytest.mark.parametrize("until", ["started", "finished"])
def test_a_sent_message_no_worker_started_holds_its_key(until: str):
    first = once(unique_until=until)
    sent(first)
    assert once(unique_until=until) == first


@pytest.mark.parametrize("until", ["started", "finished"])
def test_a_sent_message_without_a_run_for_longer_than_the_tasks_ttl_frees_its_key(until: str):
    """Its run's record was purged after the task's TTL, or the broker lost the message."""
    from django_idempotency.conf import app_settings

    first = once(unique_until=until)
    sent(first)
    OutboxMessage.objects.filter(pk=first).update(
        sent_at=timezone.now() - app_settings.TTL + timedelta(minutes=1)
    )
    assert once(unique_until=until) == first
    OutboxMessage.objects.filter(pk=first).update(
        sent_at=timezone.now() - app_settings.TTL - timedelta(seconds=1)
    )
    assert once(unique_until=until) != first


def test_started_frees_the_key_once_a_worker_started_the_run():
    first = once(unique_until="started")
    sent(first)
    run_record(first, "in_progress", lease=timedelta(minutes=1))
    second = once(unique_until="started")
    assert second != first
    assert messages() == 2
    assert OutboxUniqueKey.objects.get().message_id == second


def test_finished_holds_the_key_while_the_run_holds_a_live_lease():
    first = once()
    sent(first)
    run_record(first, "in_progress", lease=timedelta(minutes=1))
    assert once() == first


@pytest.mark.parametrize("status", ["completed", "failed"])
def test_finished_frees_the_key_when_the_run_finished(status: str):
    first = once()
    sent(first)
    run_record(first, status)
    assert once() != first
    assert messages() == 2


def test_a_dead_workers_run_frees_the_key_when_its_lease_ran_out():
    first = once()
    sent(first)
    run_record(first, "in_progress", lease=timedelta(seconds=-1))
    assert once() != first


@pytest.mark.parametrize("until", ["started", "finished"])
def test_a_message_sent_again_after_its_worker_died_holds_its_key_until_it_runs(until: str):
    """Its worker died, its run's lease ran out; the message was made pending again (the
    admin's requeue, or an ``UPDATE``, as for a database backend that never redelivers) and
    the relay sent it again. That delivery waits for a worker: the dead run's record is
    no news of it, and a second message would run beside it."""
    first = once(unique_until=until)
    sent(first)
    # Its lease ran out before the relay sent the message again (a minute ago).
    run_record(first, "in_progress", lease=timedelta(minutes=-2))
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.PENDING)
    assert once(unique_until=until) == first
    sent(first)
    assert once(unique_until=until) == first
    assert messages() == 1
    # The redelivery takes the dead run's lease over: it started.
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() + timedelta(minutes=1))
    if until == "started":
        assert once(unique_until=until) != first
    else:
        assert once(unique_until=until) == first
        IdempotencyRecord.objects.update(status="completed")
        assert once(unique_until=until) != first


def test_a_dead_message_frees_its_key():
    first = once()
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.DEAD)
    assert once() != first


def test_a_duration_holds_the_key_whatever_the_message_does_then_frees_it():
    first = once(unique_until=timedelta(minutes=5))
    sent(first)
    run_record(first, "completed")
    assert once(unique_until=timedelta(minutes=5)) == first
    OutboxUniqueKey.objects.update(held_until=timezone.now() - timedelta(seconds=1))
    second = once(unique_until=timedelta(minutes=5))
    assert second != first
    assert OutboxUniqueKey.objects.get().held_until > timezone.now()


@pytest.mark.parametrize("seconds", [300, 300.5])
def test_a_number_of_seconds_is_a_duration_as_for_ttl(seconds: float):
    """``unique_until=300`` means 300 seconds, as ``ttl=300`` and ``lease=300`` do."""
    began = timezone.now()
    first = once(unique_until=seconds)
    sent(first)
    run_record(first, "completed")
    assert once(unique_until=seconds) == first
    row = OutboxUniqueKey.objects.get()
    assert row.unique_until == "duration"
    held = timedelta(seconds=seconds)
    assert began + held <= row.held_until <= timezone.now() + held
    assert messages() == 1


def test_a_key_taken_over_keeps_one_row_pointing_at_the_new_message():
    first = once()
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.DEAD)
    second = once(unique_until="started")
    row = OutboxUniqueKey.objects.get()
    assert (row.message_id, row.unique_until, row.finished_at) == (second, "started", None)


@postgres_only  # the task's body writes through a second connection
@pytest.mark.usefixtures("eager_celery")
def test_a_run_that_ended_with_an_error_frees_its_key():
    first = once("k", fail_once, "failing")
    sent(first)
    with pytest.raises(RuntimeError):
        fail_once.apply(args=("failing",), task_id=str(first), throw=True)
    assert OutboxUniqueKey.objects.get().finished_at is not None
    assert once("k", fail_once, "failing") != first


@postgres_only
@pytest.mark.usefixtures("eager_celery")
def test_a_run_that_succeeded_frees_its_key_through_its_record():
    first = once("k", record_effect, "eager-unique")
    sent(first)
    record_effect.apply(args=("eager-unique",), task_id=str(first))
    assert IdempotencyRecord.objects.get(key=str(first)).status == "completed"
    assert once("k", record_effect, "eager-unique") != first


def effects(tag: str) -> int:
    return ProviderCall.objects.filter(key=f"effect:{tag}").count()


@pytest.mark.usefixtures("eager_celery")
def test_a_run_whose_body_raised_an_idempotency_error_frees_its_key():
    """TaskAlreadyQueued from an enqueue_once inside the body is the body's error like any
    other: the run failed, and its key is free at once (not a day later, the task's TTL)."""
    once("follow-up", "tests.follow_up", unique_until=timedelta(hours=1))
    first = once("k", enqueues_a_follow_up, "refused")
    sent(first)
    with pytest.raises(TaskAlreadyQueued):
        enqueues_a_follow_up.apply(args=("refused",), task_id=str(first), throw=True)
    assert effects("refused") == 0
    assert OutboxUniqueKey.objects.get(key="k").finished_at is not None
    assert once("k", enqueues_a_follow_up, "refused") != first
    assert messages() == 3


@pytest.mark.usefixtures("eager_celery")
def test_outcome_unknown_from_the_body_fails_the_run_and_frees_its_key():
    """An operation under run_once inside the body, closed as failed, answers
    OutcomeUnknown: the task's run failed (its work rolled back, Celery told so), which is
    not the skip of a delivery whose own record was closed."""
    IdempotencyRecord.objects.create(
        account="consumer:tests",
        operation="closed",
        key="unknown",
        request_hash=hashlib.sha256(b"").hexdigest(),
        status="failed",
        expires_at=timezone.now() + timedelta(days=1),
    )
    first = once("k", calls_a_closed_operation, "unknown")
    sent(first)
    result = calls_a_closed_operation.apply(args=("unknown",), task_id=str(first))
    assert result.state == "FAILURE"
    assert isinstance(result.result, OutcomeUnknown)
    assert effects("unknown") == 0
    assert not IdempotencyRecord.objects.filter(key=str(first)).exists()  # runs again
    assert once("k", calls_a_closed_operation, "unknown") != first


@postgres_only  # the body's transaction refused as a deadlock (40P01; MariaDB's 1213)
@pytest.mark.usefixtures("eager_celery")
def test_a_run_whose_transaction_the_database_refused_frees_its_key():
    """The body's transaction refused as a deadlock is StoreUnavailable (ran): the work
    rolled back, the claim released ("retry"), and nothing runs the message again. The
    run ended with an error: its key is free at once, not held a day (the task's TTL) by a
    sent message without a record."""
    from django_idempotency import StoreUnavailable

    first = once("k", refused_by_the_database, "refused")
    sent(first)
    result = refused_by_the_database.apply(args=("refused",), task_id=str(first))
    assert result.state == "FAILURE"
    assert isinstance(result.result, StoreUnavailable)
    assert effects("refused") == 0
    assert not IdempotencyRecord.objects.filter(key=str(first)).exists()
    assert OutboxUniqueKey.objects.get(key="k").finished_at is not None
    assert once("k", refused_by_the_database, "refused") != first
    assert messages() == 2


# -- refusals: nothing written ---------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "a b", "x" * 256, "é", None, 7])
def test_a_key_that_is_not_a_valid_key_is_refused(key: Any):
    with pytest.raises(InvalidKey if isinstance(key, str) else (InvalidKey, TypeError)):
        once(key)
    assert (messages(), OutboxUniqueKey.objects.count()) == (0, 0)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("Finished", ValueError),
        ("until_executed", ValueError),
        ("duration", ValueError),
        (timedelta(0), ValueError),
        (timedelta(seconds=-1), ValueError),
        (timedelta(days=40000), ValueError),
        (0, ValueError),
        (-60, ValueError),
        (float("nan"), ValueError),
        (10**12, ValueError),
        (True, TypeError),
        ("60", ValueError),
        (None, TypeError),
    ],
)
def test_an_unknown_or_empty_unique_until_is_refused(value: Any, error: type[Exception]):
    with pytest.raises(error, match="unique_until"):
        once(unique_until=value)
    assert messages() == 0


@pytest.mark.parametrize("value", ["ignore", "RAISE", None, True])
def test_an_unknown_on_conflict_is_refused(value: Any):
    with pytest.raises(ValueError, match="on_conflict"):
        once(on_conflict=value)
    assert messages() == 0


@pytest.mark.parametrize("until", ["started", "finished"])
@pytest.mark.parametrize("task", [TASK, record_effect_by_tag])
def test_a_task_whose_runs_are_not_recorded_by_message_has_them_reported_on_its_key(
    until: str, task: object
):
    """A task name, or a task keyed by its arguments: its worker reports the run on the
    key (tests/test_unique_tasks_reported.py)."""
    first = once(task=task, unique_until=until)
    assert OutboxMessage.objects.get().run_reported
    assert once(task=task, unique_until=until) == first
    assert messages() == 1


def test_a_task_name_takes_a_duration():
    first = once(task=TASK, unique_until=timedelta(minutes=1))
    assert once(task=TASK, unique_until=timedelta(minutes=1)) == first


def test_outside_a_transaction_it_raises_and_writes_nothing():
    with pytest.raises(TransactionManagementError):
        outbox.enqueue_once("nightly", record_effect, "tag")
    assert messages() == 0


def test_unstorable_arguments_are_refused_before_the_key_is_taken():
    with pytest.raises(TypeError):
        once("nightly", record_effect, "nul\x00")
    assert (messages(), OutboxUniqueKey.objects.count()) == (0, 0)
    assert once() is not None


# -- the purge -------------------------------------------------------------------------------------


@override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.record"})
def test_the_purge_takes_a_sent_messages_key_along():
    first = once()
    other = once("other")
    sent(first)
    OutboxMessage.objects.filter(pk=first).update(sent_at=timezone.now() - timedelta(days=30))
    assert maintenance.purge_expired().outbox_deleted == 1
    assert list(OutboxUniqueKey.objects.values_list("message_id", flat=True)) == [other]


# -- two transactions at once ----------------------------------------------------------------------


def racing(count: int, enqueue: Callable[[], uuid.UUID]) -> list[uuid.UUID]:
    """``count`` threads, each with its own connection, enqueue at once; each transaction
    stays open a moment after its enqueue, so that they overlap."""
    barrier = threading.Barrier(count)
    answers: list[uuid.UUID] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            barrier.wait(timeout=10)
            with transaction.atomic():
                answers.append(enqueue())
                threading.Event().wait(0.2)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    return answers


@postgres_only
def test_enqueues_racing_in_several_transactions_give_one_message():
    answers = racing(4, lambda: outbox.enqueue_once("race", record_effect, "tag"))
    assert messages() == 1
    assert set(answers) == {OutboxMessage.objects.get().pk}


@postgres_only
def test_enqueues_racing_for_a_freed_key_give_one_new_message():
    first = once("race")
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.DEAD)
    answers = racing(4, lambda: outbox.enqueue_once("race", record_effect, "tag"))
    assert messages() == 2
    (new,) = set(answers)
    assert new != first
    assert OutboxUniqueKey.objects.get().message_id == new


@postgres_only
def test_enqueues_racing_with_on_conflict_raise_give_one_message_and_raise_for_the_others():
    winners: list[uuid.UUID] = []
    refused: list[TaskAlreadyQueued] = []

    def enqueue() -> uuid.UUID:
        try:
            winners.append(outbox.enqueue_once("race", record_effect, "t", on_conflict="raise"))
        except TaskAlreadyQueued as exc:
            refused.append(exc)
        return uuid.uuid4()

    racing(3, enqueue)
    assert (len(winners), len(refused), messages()) == (1, 2, 1)
    assert {exc.message_id for exc in refused} == set(winners)


@postgres_only
@pytest.mark.parametrize("freed", [False, True], ids=["new-key", "freed-key"])
def test_an_enqueue_rolled_back_while_another_waits_for_it_leaves_the_key_to_the_other(
    freed: bool,
):
    """The second enqueue waits on the first's uncommitted key; the first rolls back: the
    second writes its own message (``on_conflict="raise"`` does not raise)."""
    if freed:
        OutboxMessage.objects.filter(pk=once("k")).update(status=OutboxStatus.DEAD)
    inside, answers = threading.Event(), {}

    def first() -> None:
        with contextlib.suppress(Undone), transaction.atomic():
            outbox.enqueue_once("k", record_effect, "first")
            inside.set()
            threading.Event().wait(0.5)  # the second waits on this transaction meanwhile
            raise Undone

    def second() -> None:
        assert inside.wait(10)
        with transaction.atomic():
            answers["second"] = outbox.enqueue_once(
                "k", record_effect, "second", on_conflict="raise"
            )

    threads = [threading.Thread(target=in_thread(f)) for f in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    live = OutboxMessage.objects.get(status=OutboxStatus.PENDING)
    assert (live.pk, live.args) == (answers["second"], ["second"])
    assert OutboxUniqueKey.objects.get().message_id == answers["second"]
    assert messages() == (2 if freed else 1)


@pytest.fixture
def repeatable_read() -> Any:
    """The default connection in ``REPEATABLE READ``: a transaction reads one snapshot."""
    connection = connections["default"]
    if connection.vendor == "postgresql":
        import psycopg

        level: object = psycopg.IsolationLevel.REPEATABLE_READ
    else:
        level = "repeatable read"
    options = dict(connection.settings_dict.get("OPTIONS", {}))
    connection.close()
    connection.settings_dict["OPTIONS"] = {**options, "isolation_level": level}
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["OPTIONS"] = options


@postgres_only
@pytest.mark.usefixtures("repeatable_read")
def test_a_snapshot_older_than_a_redeliverys_takeover_never_frees_the_key():
    """The run's worker died (its lease ran out) and a redelivery took the run over, after
    the enqueue's transaction took its snapshot: that snapshot's stale lease must not free
    the key while the run runs again. MariaDB reads the newest rows; PostgreSQL refuses
    the transaction (a serialization failure, to retry)."""
    first = once()
    sent(first)
    run_record(first, "in_progress", lease=timedelta(seconds=-1))
    _, _, key = _unique.record_identity(TASK, first)

    def redelivery_takes_the_run_over() -> None:
        IdempotencyRecord.objects.filter(key=key).update(
            lease_token=uuid.uuid4(), lease_expires_at=timezone.now() + timedelta(minutes=1)
        )

    try:
        with transaction.atomic():
            # The caller's own work reads first: its snapshot is taken here.
            assert IdempotencyRecord.objects.get(key=key).lease_expires_at < timezone.now()
            worker = threading.Thread(target=in_thread(redelivery_takes_the_run_over))
            worker.start()
            worker.join(timeout=10)
            answer = outbox.enqueue_once("nightly", record_effect, "tag")
    except OperationalError:
        assert connections["default"].vendor == "postgresql"
    else:
        assert answer == first
    assert messages() == 1
    assert OutboxUniqueKey.objects.get().message_id == first


# -- Django's Tasks framework through OutboxBackend ------------------------------------------------

needs_tasks = pytest.mark.skipif(
    not __import__("django.conf").conf.settings.HAS_DJANGO_TASKS,
    reason="Django's Tasks framework with django-tasks-db is not installed",
)


@needs_tasks
def test_a_django_task_takes_a_key_through_its_outbox_backend():
    from django_idempotency import tasks_backend
    from tests.testapp.tasks_framework import record_effect as django_task

    with transaction.atomic():
        result = tasks_backend.enqueue_once("nightly", django_task, "tag")
        again = tasks_backend.enqueue_once("nightly", django_task.using(priority=5), "tag")
        same = outbox.enqueue_once("nightly", django_task, "tag")
    assert result.id == again.id == str(same)
    assert result.status.name == "READY"
    row = OutboxMessage.objects.get()
    assert (row.task, row.args, row.delivery["backend"]) == (
        django_task.module_path,
        ["tag"],
        "default",
    )
    assert OutboxUniqueKey.objects.get().task == django_task.module_path
    with pytest.raises(TaskAlreadyQueued) as caught, transaction.atomic():
        tasks_backend.enqueue_once("nightly", django_task, "tag", on_conflict="raise")
    assert str(caught.value.message_id) == result.id


@needs_tasks
def test_a_django_tasks_own_arguments_named_key_or_task_are_the_tasks():
    from django_idempotency import tasks_backend
    from tests.testapp.tasks_framework import record_plain

    with transaction.atomic():
        result = tasks_backend.enqueue_once("k", record_plain, key="its-key", task="its-task")
        assert outbox.enqueue_once("k", record_plain, key="x", task="y") == uuid.UUID(result.id)
    assert result.kwargs == {"key": "its-key", "task": "its-task"}
    assert OutboxMessage.objects.get().kwargs == result.kwargs
    assert OutboxUniqueKey.objects.get().key == "k"


@needs_tasks
def test_a_django_task_not_under_idempotent_task_takes_every_option():
    from django_idempotency import tasks_backend
    from tests.testapp.tasks_framework import record_plain

    with transaction.atomic():
        reported = tasks_backend.enqueue_once("r", record_plain, "tag")
        assert tasks_backend.enqueue_once("r", record_plain, "tag").id == reported.id
    assert OutboxMessage.objects.get(pk=reported.id).run_reported
    with transaction.atomic():
        hour = timedelta(hours=1)
        first = tasks_backend.enqueue_once("k", record_plain, "t", unique_until=hour)
        assert tasks_backend.enqueue_once("k", record_plain, "t", unique_until=hour).id == first.id
    assert messages() == 2


TWO_OUTBOX_BACKENDS = {
    "default": {
        "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
        "OPTIONS": {"DELIVER_TO": "worker"},
    },
    "bulk": {
        "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
        "OPTIONS": {"DELIVER_TO": "worker"},
    },
    "worker": {"BACKEND": "django_tasks_db.DatabaseBackend"},
}


@needs_tasks
@override_settings(TASKS=TWO_OUTBOX_BACKENDS)
def test_a_key_held_through_another_outbox_backend_answers_its_live_message():
    """Scope: the task's name and the key, whatever outbox backend the task is on."""
    from django_idempotency import tasks_backend
    from tests.testapp.tasks_framework import record_plain

    with transaction.atomic():
        first = tasks_backend.enqueue_once("k", record_plain.using(backend="bulk"), "first")
        again = tasks_backend.enqueue_once("k", record_plain, "second")
        assert outbox.enqueue_once("k", record_plain, "third") == uuid.UUID(first.id)
    assert (again.id, again.backend, again.args) == (first.id, "bulk", ["first"])
    with pytest.raises(TaskAlreadyQueued) as caught, transaction.atomic():
        tasks_backend.enqueue_once("k", record_plain, "fourth", on_conflict="raise")
    assert str(caught.value.message_id) == first.id
    assert messages() == 1


@needs_tasks
def test_a_django_task_on_another_backend_is_refused():
    from django_idempotency import tasks_backend
    from tests.testapp.tasks_framework import record_effect as django_task

    with pytest.raises(TypeError, match="outbox backend"), transaction.atomic():
        tasks_backend.enqueue_once("k", django_task.using(backend="worker"), "tag")
    assert messages() == 0


@needs_tasks
@pytest.mark.parametrize("task", [record_effect, TASK, None])
def test_the_tasks_frameworks_enqueue_once_refuses_what_is_no_task_of_the_framework(task: Any):
    """A Celery task or a name goes to ``outbox.enqueue_once``: a ``TypeError`` says so."""
    from django_idempotency import tasks_backend

    with pytest.raises(TypeError, match=r"outbox\.enqueue_once"), transaction.atomic():
        tasks_backend.enqueue_once("k", task, "tag")
    assert (messages(), OutboxUniqueKey.objects.count()) == (0, 0)


# -- which key holds which message: the admin, the statistics, the audit -------------------------


def test_the_admin_shows_which_message_holds_each_key(admin_client: Any):
    live = once("live-key")
    freed = once("freed-key")
    OutboxMessage.objects.filter(pk=freed).update(status=OutboxStatus.DEAD)
    page = admin_client.get("/admin/django_idempotency/outboxuniquekey/").content.decode()
    assert "live-key" in page
    assert str(live) in page
    assert page.count("held (live)") == 1
    assert page.count("free (its message is no longer live)") == 1
    holder = OutboxUniqueKey.objects.get(key="live-key")
    detail = admin_client.get(f"/admin/django_idempotency/outboxuniquekey/{holder.pk}/change/")
    assert detail.status_code == 200
    message_page = admin_client.get(f"/admin/django_idempotency/outboxmessage/{live}/change/")
    assert "live-key (finished): held (live)" in message_page.content.decode()
    found = admin_client.get("/admin/django_idempotency/outboxmessage/", {"q": "live-key"})
    assert str(live) in found.content.decode()
    assert str(freed) not in found.content.decode()


def test_stats_and_the_audit_list_each_key_with_its_message():
    import json
    from io import StringIO

    from django.core.management import call_command

    live = once("live-key")
    out = StringIO()
    call_command("idempotency_stats", stdout=out)
    assert any(
        "live-key" in line and str(live) in line and line.rstrip().endswith("live")
        for line in out.getvalue().splitlines()
    ), out.getvalue()
    out = StringIO()
    call_command("idempotency_stats", "--json", stdout=out)
    (row,) = json.loads(out.getvalue())["unique_keys"]
    assert (row["key"], row["message"], row["live"], row["message_status"]) == (
        "live-key",
        str(live),
        True,
        "pending",
    )
    out = StringIO()
    call_command("idempotency_audit", "--unique-keys", "--format", "json", stdout=out)
    assert [k["message"] for k in json.loads(out.getvalue())["unique_keys"]] == [str(live)]
    out = StringIO()
    call_command("idempotency_audit", "--unique-keys", stdout=out)
    assert "live-key" in out.getvalue()
    assert str(live) in out.getvalue()


# -- the shape of the code: policies declared once, an outbox without task frameworks -------------

PACKAGE = __import__("pathlib").Path(__import__("django_idempotency").__file__).parent
POLICY_WORDS = {"retry", "fail", "resume", "started", "finished", "duration"}


def _imports(path: Any) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("module", ["outbox", "_senders", "_relay", "_unique"])
def test_the_outbox_imports_nothing_of_celery_or_djangos_tasks(module: str):
    refused = ("celery", "django.tasks", "django_tasks", "kombu")
    ours = (
        "django_idempotency._tasks_compat",
        "django_idempotency.tasks_backend",
        "django_idempotency.tasks",
        "django_idempotency.celery_sender",
    )
    imported = _imports(PACKAGE / f"{module}.py")
    assert not [n for n in imported if n.split(".")[0] in refused or n.startswith(refused)]
    assert not [n for n in imported if n in ours or n.startswith(tuple(f"{o}." for o in ours))]


def test_no_module_compares_a_policy_by_its_name():
    """Readers ask a declared policy for a trait (``_policies``); none compares the word."""
    import ast

    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_policies.py" or "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                for value in values:
                    if isinstance(value, ast.Constant) and value.value in POLICY_WORDS:
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found


@override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.record"})
def test_the_purge_leaves_a_key_held_for_a_duration_longer_than_the_retention():
    """At most one a month: the message sent and purged after OUTBOX_RETENTION (7 days)
    still holds its key for the rest of the month."""
    from django_idempotency.conf import app_settings

    month = timedelta(days=30)
    first = once("monthly", unique_until=month)
    sent(first)
    past_retention = timezone.now() - app_settings.OUTBOX_RETENTION - timedelta(days=1)
    OutboxMessage.objects.filter(pk=first).update(sent_at=past_retention)
    OutboxUniqueKey.objects.update(created_at=past_retention, held_until=past_retention + month)
    maintenance.purge_expired()
    assert once("monthly", unique_until=month) == first
    assert messages() == 1
    # Once the month is over, the purge takes the message and its key.
    OutboxUniqueKey.objects.update(held_until=timezone.now() - timedelta(seconds=1))
    assert maintenance.purge_expired().outbox_deleted == 1
    assert OutboxUniqueKey.objects.count() == 0
    assert once("monthly", unique_until=month) != first
    assert messages() == 1


@override_settings(
    IDEMPOTENCY={
        "OUTBOX_SENDER": "tests.testapp.outbox.record",
        "OUTBOX_RETENTION": timedelta(minutes=1),
    }
)
def test_the_purge_leaves_a_key_whose_run_still_holds_its_lease():
    """A run longer than OUTBOX_RETENTION: its message is not purged from under it."""
    first = once()
    sent(first)
    OutboxMessage.objects.filter(pk=first).update(sent_at=timezone.now() - timedelta(minutes=5))
    run_record(first, "in_progress", lease=timedelta(minutes=10))
    maintenance.purge_expired()
    assert once() == first
    assert messages() == 1


@needs_tasks
def test_a_django_task_deferred_past_the_tasks_ttl_holds_its_key_until_it_could_have_run():
    """``run_after`` two days on: the message is handed over at once and waits in the
    worker's backend; a day later (the task's TTL) no run is recorded because none was due
    yet, and the key is still held."""
    from django_idempotency import tasks_backend
    from django_idempotency.conf import app_settings
    from tests.testapp.tasks_framework import record_effect as django_task

    later = django_task.using(run_after=timezone.now() + timedelta(days=2))
    with transaction.atomic():
        first = tasks_backend.enqueue_once("deferred", later, "tag")
    sent(uuid.UUID(first.id))
    handed_over = timezone.now() - app_settings.TTL - timedelta(hours=1)
    OutboxMessage.objects.filter(pk=first.id).update(sent_at=handed_over)
    OutboxUniqueKey.objects.update(created_at=handed_over)
    with transaction.atomic():
        again = tasks_backend.enqueue_once("deferred", later, "tag")
    assert again.id == first.id
    assert messages() == 1


@override_settings(
    IDEMPOTENCY={
        "OUTBOX_SENDER": "tests.testapp.outbox.record",
        "OUTBOX_RETENTION": timedelta(minutes=1),
    }
)
def test_the_purge_leaves_a_key_whose_late_run_holds_its_lease_past_the_tasks_ttl():
    """The worker took the message up late (a backlog longer than the task's TTL) and runs
    it now under a live lease: the key still holds (``holds`` reads the live run), so the
    purge must not take the message and its key from under the run."""
    from django_idempotency.conf import app_settings

    first = once()
    sent(first)
    handed_over = timezone.now() - app_settings.TTL - timedelta(hours=1)
    OutboxMessage.objects.filter(pk=first).update(sent_at=handed_over)
    OutboxUniqueKey.objects.update(created_at=handed_over)
    run_record(first, "in_progress", lease=timedelta(minutes=10))
    assert once() == first  # the live run holds the key
    purged = maintenance.purge_expired().outbox_deleted
    assert once() == first
    assert (purged, messages(), OutboxUniqueKey.objects.count()) == (0, 1, 1)


@needs_tasks
def test_a_django_task_deferred_to_the_last_day_of_the_calendar_holds_its_key_and_purges():
    """``run_after`` on 9999-12-31: the key's hold (``run_after`` plus the task's TTL)
    reaches past the last moment a datetime holds. The next enqueue and the purge still
    answer: the key holds, one message, nothing purged."""
    from django_idempotency import tasks_backend
    from tests.testapp.tasks_framework import record_effect as django_task

    last_day = django_task.using(run_after=datetime(9999, 12, 31, tzinfo=dt_timezone.utc))
    with transaction.atomic():
        first = tasks_backend.enqueue_once("deferred", last_day, "tag")
    sent(uuid.UUID(first.id))
    with transaction.atomic():
        again = tasks_backend.enqueue_once("deferred", last_day, "tag")
    purged = maintenance.purge_expired(now=timezone.now() + timedelta(days=30)).outbox_deleted
    assert (again.id, purged, messages(), OutboxUniqueKey.objects.count()) == (first.id, 0, 1, 1)


@postgres_only  # the worker's run starts on a connection of its own, mid-purge
@override_settings(
    IDEMPOTENCY={
        "OUTBOX_SENDER": "tests.testapp.outbox.record",
        "OUTBOX_RETENTION": timedelta(microseconds=1),
    }
)
def test_a_run_the_worker_takes_up_while_the_purge_runs_keeps_its_message_and_key():
    """The purge reads which runs hold a live lease, then purges the records, the audit
    records and only then the outbox: a late run (a backlog past the task's TTL) that a
    worker takes up meanwhile holds the key (``holds`` reads its live lease), so its
    message and key are not purged from under it, and the next enqueue writes nothing."""
    from django_idempotency.conf import app_settings

    first = once()
    sent(first)
    handed_over = timezone.now() - app_settings.TTL - timedelta(hours=1)
    OutboxMessage.objects.filter(pk=first).update(sent_at=handed_over)
    OutboxUniqueKey.objects.update(created_at=handed_over)
    IdempotencyRecord.objects.create(  # an expired record: the purge's first batch
        account="user:1",
        operation="op",
        key="old",
        request_hash="-",
        status="completed",
        expires_at=timezone.now() - timedelta(days=1),
    )
    started: list[bool] = []

    def worker_takes_it_up(batches: int, rows: int) -> None:
        if started:
            return
        worker = threading.Thread(
            target=in_thread(lambda: run_record(first, "in_progress", lease=timedelta(minutes=10)))
        )
        worker.start()
        worker.join(timeout=30)
        started.append(not worker.is_alive())

    result = maintenance.purge_expired(progress=worker_takes_it_up)
    assert started == [True]
    assert (result.deleted, result.outbox_deleted) == (1, 0)
    assert (messages(), OutboxUniqueKey.objects.count()) == (1, 1)
    assert once() == first  # the live run holds the key
    assert messages() == 1
