"""How the relay hands messages of Django's Tasks framework over, whatever backend takes them.

tests/test_tasks_backend.py delivers to the suite's django-tasks-db backend, whose batches go
in one multi-row ``INSERT``. Here the other backends: one that is no django-tasks-db (its own
``enqueue``, task after task), a ``DatabaseBackend`` subclass that writes its rows its own
way (its ``enqueue`` is kept), and messages whose backend is no longer there or never was
the outbox's (``TASKS`` changed between the enqueue and the relay, or another program wrote
the message): each of those is ``dead`` at once with why, and nothing is delivered
anywhere. Effects are counted: the backends' results and rows, the messages' states.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings

if not settings.HAS_DJANGO_TASKS:  # tests/settings.py: django-tasks-db and a Tasks framework
    pytest.skip(
        "Django's Tasks framework (Django 6, or the django-tasks backport) with django-tasks-db "
        "is not installed",
        allow_module_level=True,
    )

from django.db import transaction
from django.test import override_settings
from django_tasks_db.backend import DatabaseBackend
from django_tasks_db.compat import task_backends
from django_tasks_db.models import DBTaskResult

from django_idempotency import _senders, outbox
from django_idempotency.models import OutboxMessage, OutboxStatus
from tests.testapp.tasks_framework import (
    TaskResultDoesNotExist,
    TaskResultStatus,
    effects,
    record_effect,
)

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def outbox_to(alias: str, backend: dict[str, Any]) -> dict[str, Any]:
    """``TASKS`` whose default backend is the outbox, delivering to ``backend`` (``alias``)."""
    return {
        "default": {
            "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
            "OPTIONS": {"DELIVER_TO": alias},
        },
        alias: backend,
    }


class OwnRowsBackend(DatabaseBackend):
    """A ``DatabaseBackend`` that writes its rows its own way: counts its enqueues."""

    enqueued = 0

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        type(self).enqueued += 1
        return super().enqueue(task, args, kwargs)


def enqueue(*tags: str) -> list[str]:
    with transaction.atomic():
        return [record_effect.enqueue(tag).id for tag in tags]


def tags_delivered() -> list[str]:
    return sorted(row.args_kwargs["args"][0] for row in DBTaskResult.objects.all())


@override_settings(
    TASKS=outbox_to("dummy", {"BACKEND": "django_tasks.backends.dummy.DummyBackend"})
)
def test_a_backend_that_is_no_database_backend_gets_each_task_through_its_own_enqueue():
    ids = enqueue("dummy-1", "dummy-2", "dummy-3")
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (3, 0, 0)
    dummy = task_backends["dummy"]
    assert sorted(handed.args[0] for handed in dummy.results) == ["dummy-1", "dummy-2", "dummy-3"]
    # Each message knows the result id the backend gave its task.
    given = {str(handed.id) for handed in dummy.results}
    assert {m.delivery["result_id"] for m in OutboxMessage.objects.filter(pk__in=ids)} == given
    assert not DBTaskResult.objects.exists()
    # Relayed again: nothing more is handed over.
    assert outbox.relay(once=True).sent == 0
    assert len(dummy.results) == 3


OWN_ROWS = {"BACKEND": f"{__name__}.OwnRowsBackend", "QUEUES": ["default"]}


@override_settings(TASKS=outbox_to("own", OWN_ROWS))
def test_a_database_backend_that_writes_its_own_rows_keeps_its_enqueue():
    OwnRowsBackend.enqueued = 0
    enqueue("own-1", "own-2")
    assert outbox.relay(once=True).sent == 2
    assert OwnRowsBackend.enqueued == 2
    assert tags_delivered() == ["own-1", "own-2"]
    assert set(DBTaskResult.objects.values_list("backend_name", flat=True)) == {"own"}


def dead_with(message_id: str) -> str:
    message = OutboxMessage.objects.get(pk=message_id)
    assert (message.status, message.sent_at) == (OutboxStatus.DEAD, None)
    return message.last_error


def deliver_through(message_id: str, backend: object) -> None:
    """As another program (or a ``TASKS`` since changed) would: the message names ``backend``."""
    message = OutboxMessage.objects.get(pk=message_id)
    OutboxMessage.objects.filter(pk=message_id).update(
        delivery={**message.delivery, "backend": backend}
    )


@pytest.mark.parametrize(
    ("backend", "why"),
    [
        ("gone", "the Tasks backend 'gone' cannot be had"),
        ("worker", "the Tasks backend 'worker' is no outbox backend"),
        (7, "the Tasks backend 7 cannot be had"),
    ],
)
def test_a_message_whose_backend_is_not_an_outbox_backend_is_dead_and_the_batch_goes_on(
    backend, why
):
    ids = enqueue("before", "orphan", "after")
    deliver_through(ids[1], backend)
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (2, 0, 1)
    assert why in dead_with(ids[1])
    assert tags_delivered() == ["after", "before"]
    # Nothing brings it back on a later run.
    assert outbox.relay(once=True).sent == 0
    assert tags_delivered() == ["after", "before"]
    assert effects("orphan") == 0


def test_a_process_without_the_tasks_framework_sends_none_of_its_messages(monkeypatch):
    # What a relay process gets where neither django.tasks nor the backport is importable:
    # no task framework registered the hand-over of its messages.
    ids = enqueue("unloadable-1", "unloadable-2")
    monkeypatch.setattr(_senders, "_backends", [])
    result = outbox.relay(once=True)
    assert (result.sent, result.dead) == (0, 2)
    for message_id in ids:
        assert "cannot load" in dead_with(message_id)
    assert not DBTaskResult.objects.exists()


def test_only_the_configured_sender_hands_messages_over_together():
    with pytest.raises(TypeError, match="only the configured sender"):
        _senders.send_together(print, "a group", [])


def test_relay_batch_sends_one_batch_of_the_size_asked():
    enqueue("batch-1", "batch-2", "batch-3")
    sizes = [outbox.relay_batch(batch_size=2).sent, outbox.relay_batch(batch_size=2).sent]
    assert sizes == [2, 1]
    assert outbox.relay_batch().sent == 0
    assert tags_delivered() == ["batch-1", "batch-2", "batch-3"]
    with pytest.raises(ValueError, match="batch_size must be a whole number from 1 to"):
        outbox.relay_batch(batch_size=0)


def test_get_result_of_an_id_that_is_no_message_and_of_a_task_its_backend_pruned():
    with pytest.raises(TaskResultDoesNotExist):
        record_effect.get_result("not-a-message-id")
    (result_id,) = enqueue("pruned")
    assert outbox.relay(once=True).sent == 1
    assert record_effect.get_result(result_id).status == TaskResultStatus.READY
    # The worker backend pruned its row: the message's own state answers, under its id.
    assert DBTaskResult.objects.all().delete()[0] == 1
    result = record_effect.get_result(result_id)
    assert (result.id, result.args) == (result_id, ["pruned"])
    assert OutboxMessage.objects.get(pk=result_id).status == OutboxStatus.SENT
