"""One live task per key for a task not under ``@idempotent_task()``, on every database, in
one process: its worker reports the run on the key's row (Celery's ``task_prerun`` and
``task_postrun``; the Tasks framework's ``task_started`` and ``task_finished``), which
``unique_until="started"`` and ``"finished"`` read. Real workers:
``tests/test_unique_tasks_servers.py``.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import _unique, maintenance, outbox
from django_idempotency.conf import app_settings
from django_idempotency.models import OutboxMessage, OutboxStatus, OutboxUniqueKey
from tests.testapp.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

celery = pytest.importorskip("celery", reason="Celery is an optional dependency")

from tests.testapp.tasks import count_plain, hold_plain, hold_plain_time_limited  # noqa: E402

MINUTE = timedelta(minutes=1)


def once(key: str, task: object, *args: Any, **options: Any) -> uuid.UUID:
    with transaction.atomic():
        return outbox.enqueue_once(key, task, *(args or ("tag", 0.0)), **options)


def sent(message_id: uuid.UUID) -> None:
    OutboxMessage.objects.filter(pk=message_id).update(
        status=OutboxStatus.SENT, sent_at=timezone.now()
    )


def started(message_id: uuid.UUID, lease: timedelta = MINUTE) -> bool:
    return _unique.run_started(app_settings.DATABASE, lease, message_id=message_id)


def ended(message_id: uuid.UUID) -> None:
    _unique.run_ended(app_settings.DATABASE, message_id=message_id)


def effects(tag: str) -> int:
    return ProviderCall.objects.filter(key=f"effect:{tag}").count()


# -- the key's row tells -------------------------------------------------------------------------


@pytest.mark.parametrize("task", [hold_plain, "tests.hold_plain"], ids=["task", "name"])
def test_finished_holds_the_key_until_the_reported_run_ended(task: object):
    first = once("nightly", task)
    message = OutboxMessage.objects.get()
    assert message.run_reported
    assert OutboxUniqueKey.objects.get().run_ttl == app_settings.TTL
    assert once("nightly", task) == first  # waiting for the relay
    sent(first)
    assert once("nightly", task) == first  # sent, not started
    assert started(first)
    assert once("nightly", task) == first  # running
    ended(first)
    second = once("nightly", task)
    assert second != first
    assert OutboxMessage.objects.count() == 2
    assert OutboxUniqueKey.objects.get().message_id == second


def test_started_frees_the_key_once_the_run_is_reported_started():
    first = once("nightly", hold_plain, unique_until="started")
    sent(first)
    assert once("nightly", hold_plain, unique_until="started") == first
    assert started(first)
    assert once("nightly", hold_plain, unique_until="started") != first


def test_a_dead_workers_reported_run_frees_the_key_when_its_lease_ran_out():
    first = once("nightly", hold_plain)
    sent(first)
    assert started(first, lease=timedelta(seconds=-1))  # its worker died long ago
    assert once("nightly", hold_plain) != first


def test_a_reported_run_never_started_frees_the_key_after_the_ttl():
    """The broker lost the message: held for the ``TTL`` after it was sent, as a run's
    record would be kept."""
    first = once("nightly", hold_plain)
    OutboxMessage.objects.filter(pk=first).update(
        status=OutboxStatus.SENT, sent_at=timezone.now() - app_settings.TTL + MINUTE
    )
    assert once("nightly", hold_plain) == first
    OutboxMessage.objects.filter(pk=first).update(
        sent_at=timezone.now() - app_settings.TTL - timedelta(seconds=1)
    )
    assert once("nightly", hold_plain) != first


def test_a_late_report_of_a_message_whose_key_was_taken_over_changes_nothing():
    first = once("nightly", hold_plain)
    sent(first)
    assert started(first, lease=timedelta(seconds=-1))
    second = once("nightly", hold_plain)
    sent(second)
    assert not started(first)  # a redelivery of the dead run's message
    ended(first)
    row = OutboxUniqueKey.objects.get()
    assert (row.message_id, row.started_at, row.finished_at) == (second, None, None)
    assert once("nightly", hold_plain) == second


def test_a_run_reported_ended_is_not_started_again_by_a_redelivery():
    first = once("nightly", hold_plain)
    sent(first)
    started(first)
    ended(first)
    assert not started(first)  # acks_late: redelivered after it ended
    assert OutboxUniqueKey.objects.get().finished_at is not None


def test_a_duration_and_a_task_under_idempotent_task_are_not_reported():
    from tests.testapp.tasks import hold_unique

    once("a", hold_plain, unique_until=MINUTE)
    once("b", hold_unique)
    assert not OutboxMessage.objects.filter(run_reported=True).exists()
    assert not OutboxMessage.objects.filter(
        pk=once("c", hold_plain_time_limited), run_reported=False
    ).exists()


def test_the_purge_keeps_a_message_whose_reported_run_holds_its_lease():
    first = once("nightly", hold_plain)
    long_ago = timezone.now() - app_settings.TTL - app_settings.OUTBOX_RETENTION
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.SENT, sent_at=long_ago)
    started(first)
    maintenance.purge_expired()
    assert OutboxMessage.objects.filter(pk=first).exists()
    assert once("nightly", hold_plain) == first
    ended(first)
    maintenance.purge_expired()
    assert not OutboxMessage.objects.filter(pk=first).exists()
    assert not OutboxUniqueKey.objects.exists()


# -- Celery: the relay asks, the worker's signals report -----------------------------------------


@pytest.fixture
def eager() -> Iterator[None]:
    from tests import celery_app

    celery_app.app.conf.task_always_eager = True
    try:
        yield
    finally:
        celery_app.app.conf.task_always_eager = False


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("fail", [False, True], ids=["succeeded", "failed"])
def test_a_celery_run_reports_its_start_and_its_end_on_its_key(fail: bool):
    first = once("nightly", count_plain, "eager", fail)
    assert outbox.relay(once=True).sent == 1
    assert effects("eager") == 1
    row = OutboxUniqueKey.objects.get()
    assert row.started_at is not None
    assert row.finished_at is not None
    assert row.lease_expires_at == row.started_at + app_settings.LEASE
    second = once("nightly", count_plain, "eager", fail)
    assert second != first
    assert outbox.relay(once=True).sent == 1
    assert effects("eager") == 2


@pytest.mark.usefixtures("eager")
def test_a_celery_tasks_hard_time_limit_is_its_reported_runs_lease():
    from django_idempotency.tasks import _reported_lease
    from tests.testapp.tasks import PLAIN_TIME_LIMIT_SECONDS

    limit = timedelta(seconds=PLAIN_TIME_LIMIT_SECONDS + 1)
    assert _reported_lease(hold_plain_time_limited) == limit
    assert _reported_lease(hold_plain) == app_settings.LEASE


@pytest.mark.usefixtures("eager")
def test_a_celery_task_not_sent_by_the_relay_reports_nothing():
    first = once("nightly", count_plain, "direct")
    count_plain.apply(args=("direct",), task_id=str(first))  # no header: not the relay's
    assert effects("direct") == 1
    row = OutboxUniqueKey.objects.get()
    assert (row.started_at, row.finished_at) == (None, None)


# -- Django's Tasks framework through the outbox -------------------------------------------------


needs_tasks = pytest.mark.skipif(
    not settings.HAS_DJANGO_TASKS,
    reason="Django's Tasks framework with django-tasks-db is not installed",
)


@needs_tasks
@pytest.mark.parametrize("fail", [False, True], ids=["succeeded", "failed"])
def test_a_django_task_run_by_the_database_worker_reports_its_run(fail: bool):
    from django_idempotency import tasks_backend
    from tests.helpers import work_tasks
    from tests.testapp.tasks_framework import count_plain as django_plain

    with transaction.atomic():
        first = tasks_backend.enqueue_once("nightly", django_plain, "db", fail)
    assert outbox.relay(once=True).sent == 1
    message = OutboxMessage.objects.get()
    row = OutboxUniqueKey.objects.get()
    assert message.run_reported
    assert row.run_id == message.delivery["result_id"]
    with transaction.atomic():  # handed over, not started: held
        assert tasks_backend.enqueue_once("nightly", django_plain, "db", fail).id == first.id
    work_tasks()
    assert effects("db") == 1
    row.refresh_from_db()
    assert row.started_at is not None
    assert row.finished_at is not None
    with transaction.atomic():
        assert tasks_backend.enqueue_once("nightly", django_plain, "db", fail).id != first.id


@needs_tasks
def test_a_django_task_run_inside_the_hand_over_reports_its_run_by_its_message():
    """A backend that runs a task inside its ``enqueue`` (``ImmediateBackend``) starts it
    before its result id is known."""
    from django_idempotency import tasks_backend
    from tests.testapp.tasks_framework import count_plain as django_plain

    django_tasks = "django.tasks" if importlib.util.find_spec("django.tasks") else "django_tasks"
    immediate = f"{django_tasks}.backends.immediate.ImmediateBackend"
    tasks = {**settings.TASKS, "worker": {"BACKEND": immediate}}
    with override_settings(TASKS=tasks):
        with transaction.atomic():
            first = tasks_backend.enqueue_once("nightly", django_plain, "now")
        assert outbox.relay(once=True).sent == 1
        assert effects("now") == 1
        row = OutboxUniqueKey.objects.get()
        assert row.started_at is not None
        assert row.finished_at is not None
        with transaction.atomic():
            assert tasks_backend.enqueue_once("nightly", django_plain, "now").id != first.id
