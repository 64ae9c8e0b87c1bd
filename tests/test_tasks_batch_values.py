"""The relay's batch into django-tasks-db (one INSERT, its rows as one JSON parameter on
PostgreSQL) against values at their limits: each row as ``DatabaseBackend.enqueue`` writes
it for the same task, arguments and options."""

from __future__ import annotations

import zoneinfo
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.conf import settings

if not settings.HAS_DJANGO_TASKS:
    pytest.skip("needs Django's Tasks framework with django-tasks-db", allow_module_level=True)

from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_tasks_db.models import DBTaskResult

from django_idempotency import outbox
from django_idempotency.models import OutboxMessage, OutboxStatus
from tests.testapp.tasks_framework import record_plain

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

TASK_TABLE = DBTaskResult._meta.db_table

HOSTILE: list[Any] = [
    "\u2028\u2029 é 😀 \U0010ffff",
    '{"args": [1], "kwargs": {}}',
    "\\u0000 \\ud800",
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1.5e300,
    5e-324,
    -0.0,
    0.1,
    {"": None, "😀": [True, False, {}], "a" * 300: []},
    [[[[[[[[[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]]]]]]]],
    "x" * 200_000,
]


def columns(row: DBTaskResult[Any, Any]) -> dict[str, Any]:
    found = {field.attname: getattr(row, field.attname) for field in DBTaskResult._meta.fields}
    del found["id"], found["enqueued_at"]
    return found


def handed(ids: list[Any]) -> list[DBTaskResult[Any, Any]]:
    return [
        DBTaskResult.objects.get(pk=OutboxMessage.objects.get(pk=pk).delivery["result_id"])
        for pk in ids
    ]


def compare(enqueued: list[tuple[Any, list[Any]]]) -> list[DBTaskResult[Any, Any]]:
    from django_tasks_db.compat import task_backends

    with transaction.atomic():
        ids = [task.enqueue(*args).id for task, args in enqueued]
    with CaptureQueriesContext(connection) as queries:
        result = outbox.relay(once=True)
    assert result.sent == len(enqueued)
    assert result.failed == 0
    inserts = [
        q
        for q in queries.captured_queries
        if q["sql"].lstrip().upper().startswith("INSERT") and TASK_TABLE in q["sql"]
    ]
    assert len(inserts) == 1
    rows = handed(ids)
    worker = task_backends["worker"]
    with transaction.atomic():
        own = [worker.enqueue(row.task, *row.args_kwargs.values()).db_result for row in rows]
    for row, reference in zip(rows, own, strict=True):
        reference.refresh_from_db()
        assert columns(row) == columns(reference)
        assert repr(columns(row)) == repr(columns(reference))
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {OutboxStatus.SENT}
    return rows


def test_hostile_arguments_are_written_as_enqueue_writes_them() -> None:
    rows = compare([(record_plain, [value]) for value in HOSTILE])
    assert [row.args_kwargs["args"][0] for row in rows][:4] == HOSTILE[:4]


ZONES = ["Asia/Kathmandu", "America/St_Johns", "Pacific/Chatham", "Europe/Amsterdam"]


def test_run_after_in_odd_offsets_and_far_moments() -> None:
    moments = [
        datetime(2031, 3, 30, 2, 30, 0, 123456, tzinfo=zoneinfo.ZoneInfo(zone)) for zone in ZONES
    ]
    moments.append(datetime(1900, 1, 1, 0, 0, 1, tzinfo=zoneinfo.ZoneInfo("Europe/Amsterdam")))
    moments.append(datetime(9998, 12, 31, 23, 59, 59, 999999, tzinfo=zoneinfo.ZoneInfo("UTC")))
    moments.append(timezone.now() + timedelta(microseconds=1))
    rows = compare([(record_plain.using(run_after=m), [str(n)]) for n, m in enumerate(moments)])
    # (a moment in a DST gap compares unequal across zones: compared as instants)
    assert [row.run_after.timestamp() for row in rows] == [m.timestamp() for m in moments]


@pytest.mark.parametrize("priority", [-100, 100, 0])
def test_priorities_at_their_limits(priority: int) -> None:
    rows = compare([(record_plain.using(priority=priority), ["p"]), (record_plain, ["q"])])
    assert rows[0].priority == priority


@override_settings(USE_TZ=False, TIME_ZONE="America/St_Johns")
def test_without_time_zones() -> None:
    later = datetime(2031, 1, 1, 12, 0)
    rows = compare([(record_plain, ["a"]), (record_plain.using(run_after=later), ["b"])])
    assert rows[1].run_after == later


@pytest.mark.skipif(connection.vendor == "sqlite", reason="two relays at once: a server's")
def test_two_relays_at_once_hand_each_message_over_once() -> None:
    import threading

    from django.db import connections

    with transaction.atomic():
        ids = [record_plain.enqueue(f"m-{n}").id for n in range(400)]
    results: list[Any] = []
    start = threading.Barrier(2)

    def run() -> None:
        try:
            start.wait(10)
            results.append(outbox.relay(once=True, batch_size=25))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 2
    assert sum(result.sent for result in results) == 400
    assert all(result.sent for result in results)  # both took batches
    assert DBTaskResult.objects.count() == 400
    rows = handed(ids)
    assert len({row.pk for row in rows}) == 400
    assert sorted(row.args_kwargs["args"][0] for row in rows) == sorted(
        f"m-{n}" for n in range(400)
    )


def unstorable_write(message: OutboxMessage) -> None:
    """A sender whose write on the relay's connection fails before reaching the database
    (its value cannot be prepared) for the messages whose first argument is ``"bad"``."""
    from tests.testapp.models import ProviderCall

    if message.args[:1] == ["bad"]:
        OutboxMessage.objects.create(task="x", args=[object()], kwargs={})
    ProviderCall.objects.create(key=f"sent:{message.args[0]}")


@override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.test_tasks_batch_values.unstorable_write"})
def test_a_send_that_fails_before_its_first_statement_fails_alone() -> None:
    from tests.testapp.models import ProviderCall

    with transaction.atomic():
        outbox.write("tests.other", ["good-1"], {})
        bad = outbox.write("tests.other", ["bad"], {}).id
        outbox.write("tests.other", ["good-2"], {})
    result = outbox.relay(once=True)
    assert (result.sent, result.failed) == (2, 1)
    assert sorted(ProviderCall.objects.values_list("key", flat=True)) == [
        "sent:good-1",
        "sent:good-2",
    ]
    message = OutboxMessage.objects.get(pk=bad)
    assert message.status == OutboxStatus.PENDING
    assert message.attempts == 1
    assert "JSON" in message.last_error or "serializable" in message.last_error
