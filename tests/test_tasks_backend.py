"""Django's Tasks framework through the outbox, in-process: enqueue, relay, deliver, run.

Black-box, against DESIGN.md's "Django's Tasks framework" and "Transactional outbox": the
tasks of ``tests.testapp.tasks_framework`` are enqueued with ``task.enqueue()`` on the default
backend of tests/settings.py (``OutboxBackend``, delivering to the database backend
``worker``), the relay runs in this process with its default settings (no ``OUTBOX_SENDER``),
and django-tasks-db's own ``Worker`` (the loop of ``manage.py db_worker``) runs what was
delivered. Effects are counted; tests/test_tasks_worker.py does the same with real processes.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings

if not settings.HAS_DJANGO_TASKS:  # tests/settings.py: django-tasks-db and a Tasks framework
    pytest.skip(
        "Django's Tasks framework (Django 6, or the django-tasks backport) with django-tasks-db "
        "is not installed",
        allow_module_level=True,
    )

from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_tasks_db.compat import task_enqueued
from django_tasks_db.models import DBTaskResult

from django_idempotency import outbox
from django_idempotency.models import IdempotencyRecord, OutboxMessage, OutboxStatus
from tests.helpers import work_tasks
from tests.live import ROOT
from tests.testapp.models import ProviderCall
from tests.testapp.tasks_framework import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    effects,
    record_async,
    record_effect,
    record_plain,
    record_with_context,
    starts,
)

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

MODULE = "tests.testapp.tasks_framework"


def relay() -> outbox.RelayResult:
    """One relay run, as ``relay_outbox --once`` does, with the default settings."""
    return outbox.relay(once=True)


def delivered(tag: str) -> list[DBTaskResult[Any, Any]]:
    """The database backend's rows that carry ``tag`` as the task's first argument."""
    return [row for row in DBTaskResult.objects.all() if row.args_kwargs["args"][:1] == [tag]]


def pending_again(message_id: str) -> None:
    """As the admin's requeue would: the message is due again (a second delivery)."""
    OutboxMessage.objects.filter(pk=message_id).update(
        status=OutboxStatus.PENDING, available_at=timezone.now()
    )


# -- enqueue commits or rolls back with the caller's work ------------------------------------


def enqueue_then_fail(tag: str) -> None:
    """Enqueue in a transaction that then rolls back."""
    with transaction.atomic():
        record_effect.enqueue(tag)
        raise ZeroDivisionError


def test_an_enqueue_in_a_transaction_that_rolls_back_writes_and_runs_nothing():
    with pytest.raises(ZeroDivisionError):
        enqueue_then_fail("rolled-back")
    assert not OutboxMessage.objects.exists()
    assert relay().sent == 0
    work_tasks()
    assert not DBTaskResult.objects.exists()
    assert (starts("rolled-back"), effects("rolled-back")) == (0, 0)


def test_a_committed_enqueue_writes_one_message_and_its_result_id_is_the_message_id():
    with transaction.atomic():
        result = record_effect.enqueue("committed", hold=0.0)
    message = OutboxMessage.objects.get()
    assert result.id == str(message.id)
    uuid.UUID(result.id)
    assert message.status == OutboxStatus.PENDING
    assert message.task == f"{MODULE}.record_effect" == record_effect.module_path
    assert (message.args, message.kwargs) == (["committed"], {"hold": 0.0})
    assert result.status == TaskResultStatus.READY
    assert result.task.func is record_effect.func
    assert (result.args, result.kwargs) == (["committed"], {"hold": 0.0})
    assert result.backend == "default"
    assert (result.errors, result.worker_ids, result.finished_at) == ([], [], None)
    # Nothing runs before the relay.
    work_tasks()
    assert (starts("committed"), DBTaskResult.objects.count()) == (0, 0)


def test_outbox_enqueue_takes_a_task_of_the_framework_as_its_own_enqueue_does():
    """``outbox.enqueue`` takes what ``outbox.enqueue_once`` takes: a task on the outbox
    backend is written as ``task.enqueue()`` writes it, and delivered once."""
    with transaction.atomic():
        message_id = outbox.enqueue(
            record_effect.using(priority=7, queue_name="emails"), "via-outbox", hold=0.0
        )
    row = OutboxMessage.objects.get()
    assert row.pk == message_id
    assert (row.task, row.args, row.kwargs) == (
        record_effect.module_path,
        ["via-outbox"],
        {"hold": 0.0},
    )
    assert record_effect.get_result(str(message_id)).task.priority == 7
    assert relay().sent == 1
    (handed_over,) = delivered("via-outbox")
    assert (handed_over.priority, handed_over.queue_name) == (7, "emails")
    work_tasks()
    assert (starts("via-outbox"), effects("via-outbox")) == (1, 1)
    with transaction.atomic(), pytest.raises(TypeError, match="outbox backend"):
        outbox.enqueue(record_effect.using(backend="worker"), "not-on-the-outbox")
    assert OutboxMessage.objects.count() == 1


def named_too_long(tag: str) -> None:
    """A task whose module path is longer than a task name is stored (255 characters)."""


named_too_long.__qualname__ = "t" * 255


def test_a_task_whose_path_is_too_long_to_store_is_refused_and_the_transaction_goes_on():
    from django_idempotency import tasks_backend
    from tests.testapp.tasks_framework import task

    too_long = task()(named_too_long)
    assert len(too_long.module_path) > 255
    with transaction.atomic():
        with pytest.raises(ValueError, match="255"):
            too_long.enqueue("long")
        with pytest.raises(ValueError, match="255"):
            tasks_backend.enqueue_once("k", too_long, "long")
        ProviderCall.objects.create(key="after-the-refusals")
    assert not OutboxMessage.objects.exists()
    assert ProviderCall.objects.filter(key="after-the-refusals").count() == 1


def test_an_enqueue_outside_a_transaction_raises_and_writes_nothing():
    with pytest.raises(TransactionManagementError):
        record_effect.enqueue("autocommit")
    assert not OutboxMessage.objects.exists()


def test_arguments_json_cannot_hold_are_refused_and_the_transaction_goes_on():
    with transaction.atomic():
        with pytest.raises(TypeError):
            record_effect.enqueue(object())  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            record_effect.enqueue("nul\x00")
        ProviderCall.objects.create(key="after-the-refusals")
    assert not OutboxMessage.objects.exists()
    assert ProviderCall.objects.filter(key="after-the-refusals").count() == 1


# -- delivered, run once -------------------------------------------------------------------------


def test_a_committed_task_is_delivered_to_the_worker_backend_and_runs_once():
    with transaction.atomic():
        result = record_effect.enqueue("once")
    assert (relay().sent, relay().sent) == (1, 0)
    assert OutboxMessage.objects.get().status == OutboxStatus.SENT
    (row,) = delivered("once")
    assert row.backend_name == "worker"
    assert row.task_path == f"{MODULE}.record_effect"
    assert row.args_kwargs["args"] == ["once"]
    # The message's identity travels with it, in the task's keyword arguments.
    assert result.id in json.dumps(row.args_kwargs["kwargs"])
    work_tasks()
    row.refresh_from_db()
    assert row.status == TaskResultStatus.SUCCESSFUL, row.traceback
    assert row.return_value["tag"] == "once"
    assert (starts("once"), effects("once")) == (1, 1)


def test_a_message_delivered_twice_runs_its_body_once():
    with transaction.atomic():
        result = record_effect.enqueue("twice")
    relay()
    work_tasks()
    pending_again(result.id)
    assert relay().sent == 1
    work_tasks()
    rows = delivered("twice")
    assert len(rows) == 2
    assert [row.status for row in rows] == [TaskResultStatus.SUCCESSFUL] * 2, [
        row.traceback for row in rows
    ]
    # The second delivery was answered with the first one's stored result.
    assert rows[0].return_value == rows[1].return_value
    assert (starts("twice"), effects("twice")) == (1, 1)
    assert IdempotencyRecord.objects.filter(account="task", key=result.id).count() == 1


# -- a batch handed over together ---------------------------------------------------------------

TASK_TABLE = DBTaskResult._meta.db_table
OUTBOX_TABLE = OutboxMessage._meta.db_table


def statements(queries: CaptureQueriesContext, verb: str, table: str) -> int:
    """How many captured statements start with ``verb`` and name ``table`` (SQLite's
    write lock, an UPDATE of no row, left out)."""
    return sum(
        1
        for query in queries.captured_queries
        if query["sql"].lstrip().upper().startswith(verb)
        and table in query["sql"]
        and "WHERE 1 = 0" not in query["sql"]
    )


def test_a_batch_is_handed_over_in_one_insert_and_marked_sent_in_one_update():
    tags = [f"batch-{n}" for n in range(5)]
    with transaction.atomic():
        ids = [record_effect.enqueue(tag).id for tag in tags]
    with CaptureQueriesContext(connection) as queries:
        assert relay().sent == 5
    assert statements(queries, "INSERT", TASK_TABLE) == 1
    assert statements(queries, "UPDATE", OUTBOX_TABLE) == 1
    assert DBTaskResult.objects.count() == 5
    # Each message knows its task's row: get_result follows it.
    for message_id in ids:
        message = OutboxMessage.objects.get(pk=message_id)
        assert message.status == OutboxStatus.SENT
        assert DBTaskResult.objects.filter(pk=message.delivery["result_id"]).exists()
    work_tasks()
    assert [effects(tag) for tag in tags] == [1] * 5
    result = record_effect.get_result(ids[0])
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"tag": "batch-0", "pid": os.getpid()}


def row_columns(row: DBTaskResult[Any, Any]) -> dict[str, Any]:
    """A task row's columns, as read back, but those each enqueue makes its own."""
    columns = {field.attname: getattr(row, field.attname) for field in DBTaskResult._meta.fields}
    del columns["id"], columns["enqueued_at"]
    return columns


def test_a_batch_writes_the_rows_the_backends_own_enqueue_writes_and_signals_each_as_it_does():
    from django_tasks_db.compat import task_backends

    later = timezone.now() + timedelta(hours=1)
    enqueued = [
        (record_effect, ["plain-options"], {}),
        (record_effect.using(priority=7, queue_name="emails"), ["options"], {"hold": 0.0}),
        (record_effect.using(run_after=later), ["deferred"], {}),
        (record_plain, ["no-decorator"], {}),
        (record_effect, ["plain-options-again"], {}),
    ]
    with transaction.atomic():
        ids = [task.enqueue(*args, **kwargs).id for task, args, kwargs in enqueued]
    signalled: list[Any] = []

    def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
        signalled.append(task_result)

    task_enqueued.connect(receive)
    try:
        with CaptureQueriesContext(connection) as queries:
            assert relay().sent == 5
    finally:
        task_enqueued.disconnect(receive)
    assert statements(queries, "INSERT", TASK_TABLE) == 1  # the batch's path, not one by one
    handed = [
        DBTaskResult.objects.get(pk=OutboxMessage.objects.get(pk=message_id).delivery["result_id"])
        for message_id in ids
    ]
    # One task_enqueued per message, in the batch's order, each carrying the result that
    # the row itself gives (as DatabaseBackend.enqueue sends it).
    assert [str(result.id) for result in signalled] == [str(row.id) for row in handed]
    assert signalled == [row.task_result for row in handed]
    # Each row as DatabaseBackend.enqueue writes it for the same task and arguments.
    worker = task_backends["worker"]
    with transaction.atomic():
        own = [worker.enqueue(row.task, *row.args_kwargs.values()).db_result for row in handed]
    for row, reference in zip(handed, own, strict=True):
        reference.refresh_from_db()
        assert row_columns(row) == row_columns(reference)
    assert [row.run_after == later for row in handed] == [False, False, True, False, False]
    assert [row.priority for row in handed] == [0, 7, 0, 0, 0]


@override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.record"})
def test_a_batch_of_tasks_and_other_messages_marks_each_with_its_own_delivery():
    with transaction.atomic():
        tasks = [record_effect.enqueue(f"mixed-{n}").id for n in range(3)]
        others = [outbox.write("tests.mixed.other", [n], {}).id for n in range(3)]
    with CaptureQueriesContext(connection) as queries:
        assert relay().sent == 6
    assert statements(queries, "UPDATE", OUTBOX_TABLE) == 1
    assert DBTaskResult.objects.count() == 3
    for message_id in tasks:
        delivery = OutboxMessage.objects.get(pk=message_id).delivery
        assert DBTaskResult.objects.filter(pk=delivery["result_id"]).exists()
    # The messages of the other sender keep their delivery as written: none.
    assert [OutboxMessage.objects.get(pk=pk).delivery for pk in others] == [{}] * 3
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {OutboxStatus.SENT}
    assert ProviderCall.objects.filter(key__startswith="sent:").count() == 3


def test_a_batch_costs_the_same_statements_whatever_its_size():
    counts = []
    for size in (2, 40):
        with transaction.atomic():
            for n in range(size):
                record_effect.enqueue(f"size-{size}-{n}")
        with CaptureQueriesContext(connection) as queries:
            assert outbox.relay(once=True, batch_size=size + 1).sent == size
        counts.append(len(queries.captured_queries))
    assert counts[0] == counts[1]
    assert DBTaskResult.objects.count() == 42


def test_a_batch_hands_its_tasks_over_oldest_first_for_the_worker_to_take_them_so():
    tags = [f"order-{n}" for n in range(60)]
    with transaction.atomic():
        ids = [record_effect.enqueue(tag).id for tag in tags]
    assert relay().sent == 60
    rows = {
        str(message.id): DBTaskResult.objects.get(pk=message.delivery["result_id"])
        for message in OutboxMessage.objects.all()
    }
    enqueued_at = [rows[message_id].enqueued_at for message_id in ids]
    # Strictly increasing: the worker takes equal priorities by enqueued_at, and a tie
    # would leave the order of the tied tasks to the database.
    assert all(a < b for a, b in itertools.pairwise(enqueued_at)), enqueued_at
    assert list(DBTaskResult.objects.all()) == [  # in the model's ordering, the worker's
        rows[message_id] for message_id in ids
    ]


def test_a_batch_delivered_twice_runs_each_body_once():
    tags = [f"twice-batch-{n}" for n in range(4)]
    with transaction.atomic():
        ids = [record_effect.enqueue(tag).id for tag in tags]
    assert relay().sent == 4
    for message_id in ids:
        pending_again(message_id)
    assert relay().sent == 4
    assert DBTaskResult.objects.count() == 8
    work_tasks()
    assert set(DBTaskResult.objects.values_list("status", flat=True)) == {
        TaskResultStatus.SUCCESSFUL
    }
    assert [(starts(tag), effects(tag)) for tag in tags] == [(1, 1)] * 4
    assert IdempotencyRecord.objects.filter(account="task").count() == 4


def test_a_message_its_task_cannot_be_bound_for_fails_alone_and_the_batch_goes_on():
    with transaction.atomic():
        ids = [record_effect.enqueue(f"bound-{n}").id for n in range(3)]
    # Another program wrote a priority out of range into the middle message's delivery.
    OutboxMessage.objects.filter(pk=ids[1]).update(
        delivery={**OutboxMessage.objects.get(pk=ids[1]).delivery, "priority": 10_000}
    )
    result = relay()
    assert (result.sent, result.failed, result.dead) == (2, 1, 0)
    assert DBTaskResult.objects.count() == 2
    refused = OutboxMessage.objects.get(pk=ids[1])
    assert (refused.status, refused.attempts) == (OutboxStatus.PENDING, 1)
    assert "result_id" not in refused.delivery
    work_tasks()
    assert [effects(f"bound-{n}") for n in range(3)] == [1, 0, 1]


def test_a_batch_whose_hand_over_fails_is_handed_over_one_by_one_and_only_the_culprit_fails():
    def refuse(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if task_result.args[:1] == ["culprit"]:
            raise RuntimeError("the backend refused this one")

    with transaction.atomic():
        ids = [record_effect.enqueue(tag).id for tag in ("first", "culprit", "last")]
    task_enqueued.connect(refuse)
    try:
        with CaptureQueriesContext(connection) as queries:
            result = relay()
    finally:
        task_enqueued.disconnect(refuse)
    assert (result.sent, result.failed, result.dead) == (2, 1, 0)
    # The batch's INSERT, rolled back to its savepoint, then one per message.
    assert statements(queries, "INSERT", TASK_TABLE) == 4
    assert sorted(row.args_kwargs["args"][0] for row in DBTaskResult.objects.all()) == [
        "first",
        "last",
    ]
    culprit = OutboxMessage.objects.get(pk=ids[1])
    assert (culprit.status, culprit.attempts) == (OutboxStatus.PENDING, 1)
    assert culprit.last_error == "RuntimeError: the backend refused this one"
    work_tasks()
    assert [effects(tag) for tag in ("first", "culprit", "last")] == [1, 0, 1]


def test_a_task_that_takes_its_context_runs_once_per_message():
    with transaction.atomic():
        result = record_with_context.enqueue("context")
    relay()
    work_tasks()
    pending_again(result.id)
    relay()
    work_tasks()
    rows = delivered("context")
    assert [row.status for row in rows] == [TaskResultStatus.SUCCESSFUL] * 2, [
        row.traceback for row in rows
    ]
    assert rows[0].return_value["attempt"] == 1
    assert (starts("context"), effects("context")) == (1, 1)


def test_a_task_not_under_idempotent_task_runs_once_per_delivery_with_its_own_arguments():
    with transaction.atomic():
        result = record_plain.enqueue("plain")
    relay()
    work_tasks()
    pending_again(result.id)
    relay()
    work_tasks()
    rows = delivered("plain")
    assert [row.status for row in rows] == [TaskResultStatus.SUCCESSFUL] * 2, [
        row.traceback for row in rows
    ]
    # No reserved argument is added for a task that would not strip it.
    assert [row.args_kwargs for row in rows] == [{"args": ["plain"], "kwargs": {}}] * 2
    # At least once: delivered twice, it ran twice.
    assert (starts("plain"), effects("plain")) == (2, 2)


def test_a_plain_call_of_the_function_is_not_a_delivery():
    record_effect.call("called")
    record_effect.call("called")
    assert effects("called") == 2
    assert not IdempotencyRecord.objects.filter(account="task").exists()


def test_the_signature_stays_as_written():
    assert str(inspect.signature(record_effect.func)) == (
        "(tag: 'str', hold: 'float' = 0.0) -> 'dict[str, Any]'"
    )
    assert str(inspect.signature(record_with_context.func)) == (
        "(context: 'TaskContext', tag: 'str') -> 'dict[str, Any]'"
    )
    assert record_effect.name == "record_effect"
    assert record_effect.func.__doc__ is not None
    assert "once per outbox message" in record_effect.func.__doc__


# -- what travels with the message -----------------------------------------------------------


def test_priority_and_queue_name_travel_to_the_worker_backend():
    with transaction.atomic():
        record_effect.using(priority=7, queue_name="emails").enqueue("options")
    relay()
    (row,) = delivered("options")
    assert (row.priority, row.queue_name, row.backend_name) == (7, "emails", "worker")
    work_tasks()
    assert effects("options") == 1


def test_run_after_travels_and_nothing_runs_before_it():
    run_after = timezone.now() + timedelta(seconds=3)
    with transaction.atomic():
        record_effect.using(run_after=run_after).enqueue("later")
    relay()
    work_tasks()
    assert starts("later") == 0
    # Handed over at once (the worker backend defers it) or kept until then (the relay does).
    rows = delivered("later")
    assert [row.run_after for row in rows] in ([], [run_after])
    time.sleep(max(0.0, (run_after - timezone.now()).total_seconds()) + 0.2)
    relay()
    work_tasks()
    (row,) = delivered("later")
    assert row.run_after == run_after
    assert row.status == TaskResultStatus.SUCCESSFUL, row.traceback
    assert (starts("later"), effects("later")) == (1, 1)


def test_the_backend_can_do_what_the_worker_backend_can():
    from django_tasks_db.compat import task_backends

    outbox_backend, target = task_backends["default"], task_backends["worker"]
    for capability in ("supports_defer", "supports_priority", "supports_async_task"):
        assert getattr(outbox_backend, capability) == getattr(target, capability), capability
    # The worker backend's queues are the ones it accepts.
    with transaction.atomic():
        record_effect.using(queue_name="emails").enqueue("a-known-queue")
    with pytest.raises(InvalidTask), transaction.atomic():
        record_effect.using(queue_name="no-such-queue").enqueue("an-unknown-queue")
    assert OutboxMessage.objects.count() == 1


def test_the_backends_queues_are_the_worker_backends():
    """DESIGN: the backend's queues are those of the backend it delivers to."""
    from django_tasks_db.compat import task_backends

    outbox_backend, target = task_backends["default"], task_backends["worker"]
    assert outbox_backend.queues == target.queues == {"default", "emails"}


def test_a_deferred_tasks_result_carries_its_run_after_however_it_is_read():
    """``run_after`` travels with the message as priority and queue do: the ``TaskResult``
    of ``enqueue()``, of ``enqueue_once()`` and of ``get_result()`` names it, before and
    after the hand-over."""
    from django_idempotency import tasks_backend

    run_after = timezone.now() + timedelta(hours=1)
    deferred = record_effect.using(run_after=run_after, priority=7, queue_name="emails")
    with transaction.atomic():
        enqueued = deferred.enqueue("deferred-result")
        once = tasks_backend.enqueue_once("deferred-key", deferred, "deferred-once")
        again = tasks_backend.enqueue_once("deferred-key", deferred, "deferred-once")
    assert OutboxMessage.objects.count() == 2
    wanted = (run_after, 7, "emails")
    for result in (enqueued, once, again, record_effect.get_result(enqueued.id)):
        assert (result.task.run_after, result.task.priority, result.task.queue_name) == wanted
    relay()
    assert DBTaskResult.objects.count() == 2
    handed_over = record_effect.get_result(enqueued.id)
    assert handed_over.id == enqueued.id
    assert (handed_over.task.run_after, handed_over.task.priority) == (run_after, 7)
    work_tasks()
    assert starts("deferred-result") == starts("deferred-once") == 0


NO_FRILLS = {
    "default": {
        "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
        "OPTIONS": {"DELIVER_TO": "plain"},
    },
    "plain": {"BACKEND": "tests.testapp.tasks_framework.NoFrillsBackend"},
}


@override_settings(TASKS=NO_FRILLS)
def test_what_the_worker_backend_cannot_do_is_refused_before_anything_is_written():
    from django_tasks_db.compat import task_backends

    backend = task_backends["default"]
    assert (backend.supports_defer, backend.supports_priority) == (False, False)
    in_an_hour = timezone.now() + timedelta(hours=1)
    with transaction.atomic():
        with pytest.raises(InvalidTask):
            record_effect.using(run_after=in_an_hour).enqueue("deferred")
        with pytest.raises(InvalidTask):
            record_effect.using(priority=5).enqueue("prioritised")
        record_effect.enqueue("allowed")
    assert list(OutboxMessage.objects.values_list("args", flat=True)) == [["allowed"]]


# -- results -------------------------------------------------------------------------------------


def test_get_result_answers_for_a_message_not_yet_delivered():
    with transaction.atomic():
        result = record_effect.enqueue("result")
    fetched = record_effect.get_result(result.id)
    assert fetched.id == result.id
    assert fetched.status == TaskResultStatus.READY
    assert (fetched.args, fetched.kwargs) == (["result"], {})
    result.refresh()
    assert result.status == TaskResultStatus.READY
    with pytest.raises(TaskResultDoesNotExist):
        record_effect.get_result(str(uuid.uuid4()))


# -- no Celery -----------------------------------------------------------------------------------

WITHOUT_CELERY = textwrap.dedent(
    """
    import importlib.abc, os, sys

    class NoCelery(importlib.abc.MetaPathFinder):
        tried = []

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("celery", "kombu"):
                self.tried.append(name)
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    finder = NoCelery()
    sys.meta_path.insert(0, finder)
    # What an uninstalled package looks like to importlib.util.find_spec: nothing.
    sys.modules["celery"] = None
    sys.modules["kombu"] = None
    # The example project loads its Celery app: left out, as the tox env `core` leaves it.
    sys.modules["example_project"] = None

    import django
    from django.core.management import call_command
    from django.db import transaction

    django.setup()
    call_command("migrate", verbosity=0)

    import django_idempotency.tasks
    from django_idempotency import outbox
    from django_tasks_db.management.commands.db_worker import Worker
    from tests.testapp.tasks_framework import effects, record_effect

    with transaction.atomic():
        result = record_effect.enqueue("no-celery")
    first = outbox.relay(once=True)
    Worker(queue_names=["*"], interval=0, batch=True, backend_name="worker",
           startup_delay=False, max_tasks=None, worker_id="w", excluded_queue_names=[]).run()
    from django_idempotency.models import OutboxMessage
    OutboxMessage.objects.update(status="pending")
    second = outbox.relay(once=True)
    Worker(queue_names=["*"], interval=0, batch=True, backend_name="worker",
           startup_delay=False, max_tasks=None, worker_id="w", excluded_queue_names=[]).run()
    loaded = sorted(n for n in sys.modules if n.split(".")[0] == "celery" and sys.modules[n])
    try:
        django_idempotency.tasks.relay_outbox
    except ImportError as exc:  # the Celery beat task says why it is not there
        beat = "celery" in str(exc)
    print(first.sent, second.sent, effects("no-celery"), loaded, beat)
    """
)


def test_it_works_without_celery():
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "TEST_DB": "sqlite",
        "SQLITE_NAME": ":memory:",
        "PYTHONPATH": str(ROOT),
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_CELERY],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "1 1 1 [] True", done.stdout + done.stderr


# -- found by a hostile review ------------------------------------------------------------------


def test_an_async_task_under_idempotent_task_runs_its_body_once_per_message():
    with transaction.atomic():
        result = record_async.enqueue("async-1")
    relay()
    work_tasks()
    pending_again(result.id)
    relay()
    work_tasks()
    rows = list(DBTaskResult.objects.all())
    assert len(rows) == 2  # delivered twice
    assert effects("async-1") == 1
    assert {row.status for row in rows} == {TaskResultStatus.SUCCESSFUL}


def other_sessions() -> int:
    """Client sessions on the test database besides this thread's."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        return int(cursor.fetchone()[0])


@pytest.mark.skipif(settings.TEST_DB != "postgres", reason="counts PostgreSQL's sessions")
def test_an_async_task_leaves_no_connection_open_in_the_thread_it_ran_in():
    """An ``async def`` body runs with the engine in a worker thread of asgiref's, which
    outlives the delivery: as at the end of a request, its connections are closed where
    CONN_MAX_AGE says so (0 here). Before, each such thread kept one open for good."""
    before = other_sessions()
    with transaction.atomic():
        record_async.enqueue("async-2")
    relay()
    work_tasks()
    assert effects("async-2") == 1
    deadline = time.monotonic() + 5  # a closed session's backend takes a moment to exit
    while (after := other_sessions()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after == before


def test_get_result_after_delivery_carries_the_return_value_and_refresh_follows_it():
    with transaction.atomic():
        result = record_effect.enqueue("rv")
    result.refresh()
    before = result.status
    relay()
    work_tasks()
    result.refresh()
    assert (before, result.status) == (TaskResultStatus.READY, TaskResultStatus.SUCCESSFUL)
    assert result.return_value == {"tag": "rv", "pid": os.getpid()}  # work_tasks() runs in-process
    assert record_effect.get_result(result.id).return_value == result.return_value
    assert effects("rv") == 1


def test_get_result_of_a_message_that_is_no_task_result_of_this_backend():
    with transaction.atomic():
        gone = outbox.write(
            "tests.no_such_module.gone_task",
            ["x"],
            {},
            {"backend": "default", "priority": 0, "queue_name": "default"},
        )
        celery_message = outbox.write("proj.celery_tasks.send_mail", ["x"], {}, None)
    backend = record_effect.get_backend()
    for message in (gone, celery_message):
        with pytest.raises(TaskResultDoesNotExist):
            backend.get_result(str(message.id))
    # The task that no longer imports does not hold the relay back.
    with transaction.atomic():
        record_effect.enqueue("after-gone")
    relay()
    work_tasks()
    assert effects("after-gone") == 1
