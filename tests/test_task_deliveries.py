"""Whose delivery a body under ``@idempotent_task()`` belongs to.

Black-box, against DESIGN.md's "Every shape a project writes protects or is refused where it
is made" and "A task that reports success without running its body ... is a defect":

- a task of Django's Tasks framework enqueued straight onto a real backend (no outbox
  message) is a delivery of that backend's task result, and runs once per enqueue however
  often the backend runs it;
- a function under ``@idempotent_task()`` called inside a Celery task is not a delivery of
  that Celery task: it never shares the Celery task's record, nor another function's.

Effects are counted as ``ProviderCall`` rows.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from django_idempotency import outbox
from django_idempotency.models import (
    IdempotencyRecord,
    OutboxMessage,
    OutboxStatus,
    OutboxUniqueKey,
)
from tests.helpers import celery_worker, postgres_only, wait_drained, wait_until, work_tasks
from tests.testapp.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def effects(prefix: str) -> int:
    return ProviderCall.objects.filter(key=f"effect:{prefix}").count()


def starts(tag: str) -> int:
    return ProviderCall.objects.filter(key__startswith=f"start:{tag}:").count()


# -- Django's Tasks framework: a task enqueued on the real backend --------------------------


needs_tasks = pytest.mark.skipif(
    not settings.HAS_DJANGO_TASKS, reason="Django's Tasks framework and django-tasks-db"
)


@needs_tasks
def test_a_task_enqueued_on_the_real_backend_runs_once_however_often_it_is_run():
    from django_tasks_db.models import DBTaskResult

    from tests.testapp.tasks_framework import TaskResultStatus, record_direct

    result = record_direct.enqueue("direct")
    work_tasks()
    # The backend runs the same enqueued task again (an operator's requeue, a redelivery).
    DBTaskResult.objects.filter(pk=result.id).update(status=TaskResultStatus.READY)
    work_tasks()
    row = DBTaskResult.objects.get(pk=result.id)
    assert row.status == TaskResultStatus.SUCCESSFUL, row.traceback
    assert effects("direct") == 1
    # Another enqueue is another delivery.
    record_direct.enqueue("direct")
    work_tasks()
    assert effects("direct") == 2


# -- Celery: functions under @idempotent_task() called inside a Celery task -------------------


celery = pytest.importorskip("celery", reason="Celery is an optional dependency")


def test_two_keyed_functions_called_inside_one_celery_task_both_run():
    from tests.testapp.tasks import ship_and_bill

    outcome = ship_and_bill.apply(("one",), task_id=str(uuid.uuid4()))
    assert outcome.get() == ["shipped one", "billed one"]
    assert (effects("ship:one"), effects("bill:one")) == (1, 1)
    # A second Celery task that ships and bills the same item: each function's key dedupes.
    ship_and_bill.apply(("one",), task_id=str(uuid.uuid4())).get()
    assert (effects("ship:one"), effects("bill:one")) == (1, 1)


def test_keyed_functions_inside_a_deduplicated_celery_task_run_once_and_so_does_it():
    from tests.testapp.tasks import ship_and_bill_once

    task_id = str(uuid.uuid4())
    first = ship_and_bill_once.apply(("two",), task_id=task_id)
    assert first.get() == ["shipped two", "billed two"]
    ship_and_bill_once.apply(("two",), task_id=task_id).get()
    assert (effects("outer:two"), effects("ship:two"), effects("bill:two")) == (1, 1, 1)


if settings.HAS_DJANGO_TASKS:
    from celery import shared_task

    from django_idempotency.tasks import idempotent_task
    from tests.testapp.tasks_framework import record_called

    @shared_task(name="tests.call_django_tasks")
    def call_django_tasks(*tags: str) -> list[Any]:
        """A plain Celery task that calls a Django task's function for each tag."""
        return [record_called.call(tag) for tag in tags]

    @shared_task(name="tests.call_django_task_once")
    @idempotent_task()
    def call_django_task_once(tag: str) -> Any:
        """A deduplicated Celery task that calls a Django task's function."""
        ProviderCall.objects.create(key=f"effect:outer:{tag}")
        return record_called.call(tag)


@needs_tasks
def test_a_django_tasks_function_called_twice_in_one_celery_task_runs_twice():
    outcome = call_django_tasks.apply(("first", "second"), task_id=str(uuid.uuid4()))
    assert outcome.get() == [{"tag": "first"}, {"tag": "second"}]
    assert (effects("first"), effects("second")) == (1, 1)


@needs_tasks
def test_a_django_tasks_function_called_in_a_deduplicated_celery_task_runs():
    task_id = str(uuid.uuid4())
    outcome = call_django_task_once.apply(("inner",), task_id=task_id)
    assert outcome.get() == {"tag": "inner"}
    assert (effects("outer:inner"), effects("inner")) == (1, 1)
    # Its own record, and no other: the Celery task's.
    assert list(IdempotencyRecord.objects.values_list("operation", "key")) == [
        ("task:tests.call_django_task_once", task_id)
    ]


# -- the shapes of a Celery task whose delivery it is ----------------------------------------


@pytest.mark.parametrize("name", ["bound_retry", "wrapped_twice", "wrapped_bare", "class_based"])
def test_each_shape_of_celery_task_is_keyed_by_its_own_delivery(name):
    from tests.celery_app import app
    from tests.testapp import tasks

    task = app.register_task(tasks.ClassBased()) if name == "class_based" else getattr(tasks, name)
    task_id = str(uuid.uuid4())
    for _ in range(2):
        outcome = task.apply((name,), task_id=task_id)
        assert outcome.successful(), outcome.traceback
    assert ProviderCall.objects.filter(key__startswith=f"effect:{name}").count() == 1
    assert list(IdempotencyRecord.objects.values_list("operation", "key")) == [
        (f"task:tests.{name}", task_id)
    ]


# -- Celery's canvas: a link callback of a message delivered twice --------------------------


@pytest.mark.usefixtures("eager_celery")
def test_a_link_callback_runs_once_however_often_its_parent_is_delivered():
    """Celery sends a parent's ``link`` callbacks after each delivery that succeeds, a
    replay too. Each used to go out under a new task id, so a callback under
    ``@idempotent_task()`` ran once per delivery of its parent."""
    from tests.testapp.tasks import linked_callback, linked_parent

    task_id = str(uuid.uuid4())
    for _ in range(2):
        outcome = linked_parent.apply(("p",), task_id=task_id, link=linked_callback.s("c"))
        assert outcome.get() == "p"
    assert (effects("parent:p"), effects("callback:c")) == (1, 1)
    # Another message of the parent is another callback.
    linked_parent.apply(("p",), task_id=str(uuid.uuid4()), link=linked_callback.s("c"))
    assert effects("callback:c") == 2


@postgres_only
@pytest.mark.servers
@pytest.mark.usefixtures("clean_queue")
def test_a_worker_runs_the_link_callback_of_a_message_delivered_twice_once():
    from tests.testapp.tasks import linked_callback, linked_parent

    task_id = str(uuid.uuid4())
    with celery_worker():
        for _ in range(2):
            linked_parent.apply_async(("w",), task_id=task_id, link=linked_callback.s("w"))
        wait_until(lambda: effects("callback:w") >= 1, "the callback to run")
        wait_drained()
    assert (effects("parent:w"), effects("callback:w")) == (1, 1)


@pytest.mark.parametrize("shape", ["map", "starmap", "chunks"])
def test_the_items_of_a_map_delivered_twice_run_once(shape):
    """``task.map``, ``starmap`` and ``chunks`` run a task's items inside one message of
    Celery's own (``celery.map``, ``celery.starmap``) as calls of the task. Each item is a
    delivery of that message: keyed by its id and the item's place, it runs once however
    often the message is delivered. They used to run as plain calls, every time."""
    from tests.testapp.tasks import record_effect

    tags = ["item-1", "item-2", "item-3"]
    canvas = {
        "map": lambda: record_effect.map(tags),
        "starmap": lambda: record_effect.starmap([(tag,) for tag in tags]),
        "chunks": lambda: record_effect.chunks([(tag,) for tag in tags], 3).group().tasks[0],
    }[shape]()
    task_id = str(uuid.uuid4())
    for _ in range(2):
        outcome = canvas.apply(task_id=task_id)
        assert outcome.successful(), outcome.traceback
    assert [effects(tag) for tag in tags] == [1, 1, 1]
    # Another message is another delivery of each item.
    canvas.apply(task_id=str(uuid.uuid4()))
    assert [effects(tag) for tag in tags] == [2, 2, 2]


@postgres_only
@pytest.mark.servers
@pytest.mark.usefixtures("clean_queue")
def test_a_map_whose_other_delivery_died_mid_item_runs_every_item_once_after_the_lease():
    """Two deliveries of one starmap message; the first one's worker process is killed
    inside its first item. The other delivery meets that item's live lease: its map is
    retried after the lease (not failed, which would leave the rest of the items unrun),
    takes the dead item over, and runs the next."""
    import os
    import signal

    from tests import celery_app
    from tests.testapp.tasks import MEDIUM_LEASE_SECONDS, record_effect_medium_lease

    # The map's retry after the lease comes within the visibility timeout: past it, the
    # retried message was handed out once more, and the queue drained 10 s later.
    assert MEDIUM_LEASE_SECONDS < celery_app.VISIBILITY_TIMEOUT
    canvas = record_effect_medium_lease.starmap([("map-held", 60), ("map-next", 0)])
    task_id = str(uuid.uuid4())
    with celery_worker(concurrency=2):
        for _ in range(2):
            canvas.apply_async(task_id=task_id)
        wait_until(lambda: starts("map-held") == 1, "the first item to start")
        pid = ProviderCall.objects.get(key__startswith="start:map-held:").key.rsplit(":", 1)[1]
        os.kill(int(pid), signal.SIGKILL)
        wait_until(lambda: effects("map-next") == 1, "the other delivery to run every item")
        wait_drained()
    assert (starts("map-held"), effects("map-held"), effects("map-next")) == (2, 1, 1)


# -- a task that replaces itself (self.replace) ---------------------------------------------


def pages(tag: str) -> list[str]:
    keys = ProviderCall.objects.filter(key__startswith=f"effect:{tag}:")
    return sorted(keys.values_list("key", flat=True))


@postgres_only
@pytest.mark.servers
@pytest.mark.usefixtures("clean_queue")
def test_a_task_that_replaces_itself_keeps_the_work_of_every_page():
    """``self.replace()`` sends the replacement under the task's own id and raises
    ``Ignore`` through the body. The body's work was rolled back as if it had failed, while
    Celery reported the whole import a success: only the last page's rows were left."""
    from tests.testapp.tasks import paged

    task_id = str(uuid.uuid4())
    with celery_worker():
        paged.apply_async(("worker", 1, 3), task_id=task_id)
        # A duplicate of the first message, after the pages: it runs nothing again.
        wait_until(lambda: len(pages("worker")) == 3, "every page")
        paged.apply_async(("worker", 1, 3), task_id=task_id)
        wait_drained()
    assert pages("worker") == ["effect:worker:1", "effect:worker:2", "effect:worker:3"]


def test_a_task_that_replaces_itself_eagerly_runs_every_page_once():
    """Eagerly, the replacement runs inside the replaced body, under the same task id: it
    met the replaced run's own claim and failed (DeliveryInProgress)."""
    from tests.testapp.tasks import paged

    task_id = str(uuid.uuid4())
    for _ in range(2):
        outcome = paged.apply(("eager", 1, 3), task_id=task_id)
        assert outcome.successful(), outcome.traceback
    assert pages("eager") == ["effect:eager:1", "effect:eager:2", "effect:eager:3"]


# -- a task that calls itself directly inside its own run ---------------------------------


@postgres_only
@pytest.mark.servers
@pytest.mark.usefixtures("clean_queue")
def test_a_task_that_calls_itself_directly_runs_in_a_worker():
    """A call of the task inside its own run inherits the run's request (Celery's
    ``Task.__call__`` copies it), task id included: it was taken for the same delivery,
    met the run's own claim, and retried the whole task after every lease, for ever."""
    from tests.testapp.tasks import tree

    task_id = str(uuid.uuid4())
    with celery_worker():
        for _ in range(2):  # and a duplicate of the message, which runs nothing again
            tree.apply_async(("walk", 2), task_id=task_id)
        wait_until(lambda: len(pages("walk")) == 3, "every level", timeout=20)
        wait_drained()
    assert pages("walk") == ["effect:walk:0", "effect:walk:1", "effect:walk:2"]


def test_a_task_that_calls_itself_directly_runs_eagerly():
    from tests.testapp.tasks import tree

    task_id = str(uuid.uuid4())
    for _ in range(2):
        assert tree.apply(("eager-walk", 2), task_id=task_id).get() == 2
    assert pages("eager-walk") == [
        "effect:eager-walk:0",
        "effect:eager-walk:1",
        "effect:eager-walk:2",
    ]
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == [task_id]


# -- one live task per key: a run that Celery retries has not ended ---------------------------


@postgres_only  # the task's body writes through a second connection
@pytest.mark.usefixtures("eager_celery")
def test_a_run_celery_autoretries_keeps_its_key_until_the_retry_ends():
    from tests.testapp.tasks import autoretried

    with transaction.atomic():
        first = outbox.enqueue_once("k", autoretried, "k", "auto")
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.SENT, sent_at=timezone.now())
    outcome = autoretried.apply(args=("k", "auto"), task_id=str(first))
    # The retried run found its own message holding the key: nothing more was enqueued.
    assert outcome.get() == str(first)
    assert OutboxMessage.objects.count() == 1
    assert effects("auto") == 1
    assert OutboxUniqueKey.objects.get().finished_at is None


@postgres_only  # the task's body writes through a second connection
@pytest.mark.usefixtures("eager_celery")
def test_a_run_whose_autoretries_are_spent_frees_its_key():
    from tests.testapp.tasks import autoretried_in_vain

    with transaction.atomic():
        first = outbox.enqueue_once("k", autoretried_in_vain, "spent")
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.SENT, sent_at=timezone.now())
    outcome = autoretried_in_vain.apply(args=("spent",), task_id=str(first))
    assert isinstance(outcome.result, RuntimeError)
    assert ProviderCall.objects.filter(key__startswith="start:spent:").count() == 3
    assert OutboxUniqueKey.objects.get().finished_at is not None
    with transaction.atomic():
        assert outbox.enqueue_once("k", autoretried_in_vain, "spent") != first


@postgres_only
@pytest.mark.servers
@pytest.mark.usefixtures("clean_queue")
def test_a_run_that_puts_its_message_back_keeps_its_key_until_the_next_run_ends():
    """``Reject(requeue=True)`` under ``acks_late`` hands the message back to the broker: the
    worker runs it again, so the run has not ended, and its key stays held (as for a retry).
    Freed, an enqueue meanwhile wrote a second live message for the key."""
    from tests.testapp.tasks import rejected_once

    with transaction.atomic():
        first = outbox.enqueue_once("k", rejected_once, "k", "rejected")
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.SENT, sent_at=timezone.now())
    with celery_worker():
        rejected_once.apply_async(("k", "rejected"), task_id=str(first))
        wait_until(lambda: effects("rejected") == 1, "the run after the requeue to commit")
        wait_drained()
    # The run after the requeue found its own message holding the key.
    assert ProviderCall.objects.filter(key="failed:rejected").count() == 1
    assert OutboxMessage.objects.count() == 1
    assert OutboxUniqueKey.objects.get().message_id == first


# -- a key callable that answers no key ------------------------------------------------------


def test_a_key_callable_that_answers_none_runs_nothing_rather_than_run_unprotected():
    from tests.testapp.tasks import keyed_by_payload

    task_id = str(uuid.uuid4())
    outcomes = [keyed_by_payload.apply(({"tag": "keyless"},), task_id=task_id) for _ in range(2)]
    # Refused, like a missing key anywhere else; never a body that runs on every delivery.
    assert [outcome.failed() for outcome in outcomes] == [True, True]
    assert effects("keyless") == 0
    # With its key, it runs once.
    for _ in range(2):
        keyed_by_payload.apply(({"tag": "keyed", "id": "e-1"},), task_id=str(uuid.uuid4())).get()
    assert effects("keyed") == 1
