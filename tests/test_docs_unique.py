"""The code of docs/unique-tasks.md runs as shown: example_project/docs_examples/unique_tasks.py
(and the Tasks framework's section of example_project/docs_examples/tasks_framework.py)."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.utils import timezone

pytest.importorskip("celery", reason="Celery is an optional dependency")
pytest.importorskip(
    "example_project", reason="the example project is not here (tox tests the wheel)"
)

from django_idempotency.models import OutboxMessage, OutboxStatus, OutboxUniqueKey
from example_project.docs_examples import unique_tasks as shown

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def test_beat_every_minute_leaves_one_rebuild_waiting():
    first = shown.every_minute()
    assert [shown.every_minute() for _ in range(3)] == [first] * 3
    assert OutboxMessage.objects.count() == 1
    OutboxMessage.objects.update(status=OutboxStatus.DEAD)
    assert shown.every_minute() != first


def test_a_second_click_is_told_and_nothing_is_written():
    first, queued = shown.request_export(7)
    again, queued_again = shown.request_export(7)
    assert (queued, queued_again, again) == (True, False, first)
    assert OutboxMessage.objects.count() == 1


def test_one_digest_per_ten_minutes():
    first = shown.digest_soon(3)
    assert shown.digest_soon(3) == first
    OutboxUniqueKey.objects.update(held_until=timezone.now())
    assert shown.digest_soon(3) != first


@pytest.mark.skipif(not settings.HAS_DJANGO_TASKS, reason="no Tasks framework installed")
def test_the_tasks_framework_takes_a_key_through_its_backend():
    from example_project.docs_examples import tasks_framework

    first = tasks_framework.every_minute()
    assert tasks_framework.every_minute() == first
    assert OutboxMessage.objects.count() == 1
