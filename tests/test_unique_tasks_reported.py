"""One live task per key for a task not under ``@idempotent_task()``, on every database, in
one process: its worker reports the run on the key's row (Celery's ``task_prerun`` and
``task_postrun``; the Tasks framework's ``task_started`` and ``task_finished``), which
``unique_until="started"`` and ``"finished"`` read. Real workers:
``tests/test_unique_tasks_servers.py``.
"""

from __future__ import annotations

import importlib.util
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
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
    """Sent a minute ago: a dead run's lease that ran out since (its worker died after it
    started the run) is no older than that."""
    OutboxMessage.objects.filter(pk=message_id).update(
        status=OutboxStatus.SENT, sent_at=timezone.now() - timedelta(minutes=1)
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


def test_an_empty_run_id_is_no_runs_id():
    """A backend that gave the relay an empty result id: nothing is written on the key,
    and a report by an empty id reaches no key whose run id was left empty."""
    first = once("nightly", hold_plain)
    sent(first)
    _unique.runs_known_by(app_settings.DATABASE, [(first, "")])
    assert OutboxUniqueKey.objects.get().run_id == ""  # a key whose run id is not known
    assert not _unique.run_started(app_settings.DATABASE, MINUTE, run_id="")
    _unique.run_ended(app_settings.DATABASE, run_id="")
    row = OutboxUniqueKey.objects.get()
    assert (row.started_at, row.finished_at) == (None, None)
    assert once("nightly", hold_plain) == first


def test_a_dead_workers_reported_run_frees_the_key_when_its_lease_ran_out():
    first = once("nightly", hold_plain)
    sent(first)
    assert started(first, lease=timedelta(seconds=-1))  # its worker died long ago
    assert once("nightly", hold_plain) != first


@pytest.mark.parametrize("until", ["started", "finished"])
def test_a_message_sent_again_after_its_reported_run_died_holds_its_key_until_it_runs(
    until: str,
):
    """Its worker died, its reported run's lease ran out; the message was made pending
    again and the relay sent it again. That delivery waits for a worker: the dead run's
    report is no news of it, and a second message would run beside it."""
    first = once("nightly", hold_plain, unique_until=until)
    sent(first)
    # Its worker died; its lease ran out before the relay sent it again (a minute ago).
    assert started(first, lease=timedelta(minutes=-2))
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.PENDING)
    assert once("nightly", hold_plain, unique_until=until) == first
    sent(first)
    assert once("nightly", hold_plain, unique_until=until) == first
    assert OutboxMessage.objects.count() == 1
    assert started(first)  # the new delivery's run
    if until == "started":
        assert once("nightly", hold_plain, unique_until=until) != first
    else:
        assert once("nightly", hold_plain, unique_until=until) == first
        ended(first)
        assert once("nightly", hold_plain, unique_until=until) != first


@pytest.mark.parametrize("until", ["started", "finished"])
def test_a_message_sent_again_after_its_reported_run_failed_holds_its_key_until_it_runs(
    until: str,
):
    """Its run failed and reported its end; the message was made pending again (an
    ``UPDATE``) and the relay sent it again: the earlier run's end is no news of the
    delivery that now waits for a worker, and a second message would run beside it."""
    handed: list[uuid.UUID] = []
    first = once("nightly", hold_plain, unique_until=until)
    assert outbox.relay_batch(sender=lambda message: handed.append(message.id)).sent == 1
    assert started(first)
    ended(first)  # the run failed
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.PENDING)
    assert outbox.relay_batch(sender=lambda message: handed.append(message.id)).sent == 1
    assert handed == [first, first]
    assert once("nightly", hold_plain, unique_until=until) == first
    assert started(first)  # the new delivery's run
    if until == "finished":
        assert once("nightly", hold_plain, unique_until=until) == first
        ended(first)
    assert once("nightly", hold_plain, unique_until=until) != first
    assert OutboxMessage.objects.count() == 2


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


@pytest.mark.parametrize("run", ["reported", "recorded"])
def test_a_message_waiting_for_the_relay_holds_its_key_whatever_its_run_said(run: str):
    """The relay published the message and its worker ran it to its end (reported on the
    key; or, under ``@idempotent_task()``, failed), but the relay's batch rolled back (its
    process killed before the commit): the message waits for the relay again, which sends
    it again. Every message holds its key while it waits for the relay; a second message
    would run beside that second send."""
    from tests.testapp.tasks import hold_unique

    task = hold_plain if run == "reported" else hold_unique
    first = once("nightly", task)
    if run == "reported":
        assert started(first)
        ended(first)
    else:
        _unique.finished(app_settings.DATABASE, first)  # its run failed
    row = OutboxUniqueKey.objects.get()
    assert row.finished_at is not None
    assert OutboxMessage.objects.get().status == OutboxStatus.PENDING
    assert once("nightly", task) == first
    assert OutboxMessage.objects.count() == 1


def test_a_run_reported_ended_is_not_started_again_by_a_redelivery():
    first = once("nightly", hold_plain)
    sent(first)
    started(first)
    ended(first)
    assert not started(first)  # acks_late: redelivered after it ended
    assert OutboxUniqueKey.objects.get().finished_at is not None


@pytest.mark.parametrize("until", ["started", "finished"])
@pytest.mark.parametrize("task", [hold_plain, "tests.hold_plain"], ids=["task", "name"])
def test_a_sender_of_ones_own_cannot_have_a_run_reported_and_is_refused(task: object, until: str):
    """Only the default sender asks Celery's worker to report a run (its header): a message
    another sender hands to Kafka or a webhook would hold its key until the ``TTL`` after
    it was sent, whatever became of its run. Refused, as before runs were reported; a
    duration and a task under ``@idempotent_task()`` still work."""
    from tests.testapp.tasks import hold_unique

    with override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.record"}):
        with pytest.raises(ValueError, match="OUTBOX_SENDER"):
            once("nightly", task, unique_until=until)
        assert not OutboxMessage.objects.exists()
        assert not OutboxUniqueKey.objects.exists()
        once("a", task, unique_until=MINUTE)
        once("b", hold_unique, unique_until=until)
    assert OutboxMessage.objects.filter(run_reported=False).count() == 2
    celery_sender = "django_idempotency.celery_sender.send"
    with override_settings(IDEMPOTENCY={"OUTBOX_SENDER": celery_sender}):
        once("c", task, unique_until=until)
    from django_idempotency.celery_sender import send

    with override_settings(IDEMPOTENCY={"OUTBOX_SENDER": send}):
        once("d", task, unique_until=until)
    assert OutboxMessage.objects.filter(run_reported=True).count() == 2


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


def test_the_celery_senders_batch_asks_exactly_the_reported_messages_for_a_report():
    """Through the broker (one producer for the batch): the header goes with the messages
    written reported, and with no other message of the batch."""
    from celery.signals import before_task_publish

    published: dict[str, object] = {}

    def seen(headers: Any = None, **kwargs: Any) -> None:
        published[headers["id"]] = headers.get(_unique.RUN_HEADER)

    before_task_publish.connect(seen, weak=False)
    try:
        with transaction.atomic():
            reported = [once("a", hold_plain), once("b", count_plain, "b")]
            others = [
                outbox.enqueue("tests.count_plain", ["plain"]),
                outbox.enqueue_once("timed", count_plain, "timed", unique_until=MINUTE),
            ]
        assert outbox.relay(once=True).sent == 4
    finally:
        before_task_publish.disconnect(seen)
    assert published == {
        **{str(message): "1" for message in reported},
        **{str(message): None for message in others},
    }


@pytest.mark.parametrize(
    ("pool", "killed"),
    [("prefork", True), ("threads", False), ("solo", False), ("no.such.Pool", False)],
)
def test_a_celery_tasks_hard_time_limit_is_its_reported_runs_lease_where_the_pool_kills_it(
    pool: str, killed: bool
):
    """The prefork pool kills a run at its hard time limit: no run outlives it. The other
    pools let a run go on past it: the lease is ``LEASE``, as for a task without a limit
    and for an eager run."""
    from types import SimpleNamespace

    from django_idempotency import tasks
    from django_idempotency.tasks import _reported_lease
    from tests.testapp.tasks import PLAIN_TIME_LIMIT_SECONDS

    limit = timedelta(seconds=PLAIN_TIME_LIMIT_SECONDS + 1)
    try:
        tasks.worker_starting(sender=SimpleNamespace(pool_cls=pool))
        assert _reported_lease(hold_plain_time_limited) == (limit if killed else app_settings.LEASE)
        assert _reported_lease(hold_plain) == app_settings.LEASE
        hold_plain_time_limited.push_request(is_eager=True)  # type: ignore[call-arg]
        try:
            assert _reported_lease(hold_plain_time_limited) == app_settings.LEASE
        finally:
            hold_plain_time_limited.pop_request()
    finally:
        tasks.worker_starting(sender=SimpleNamespace(pool_cls="threads"))


@pytest.mark.usefixtures("eager")
def test_a_celery_task_not_sent_by_the_relay_reports_nothing():
    first = once("nightly", count_plain, "direct")
    count_plain.apply(args=("direct",), task_id=str(first))  # no header: not the relay's
    assert effects("direct") == 1
    row = OutboxUniqueKey.objects.get()
    assert (row.started_at, row.finished_at) == (None, None)


def test_a_replacement_reports_only_on_the_key_of_a_message_written_reported():
    """A Celery replacement (``Task.replace``) carries no header: it is reported by its task
    id where that id is a message written ``run_reported``, and nowhere else."""
    from tests.testapp.tasks import hold_unique

    reported, recorded = once("a", hold_plain), once("b", hold_unique)
    sent(reported)
    sent(recorded)
    for message in (reported, recorded):
        assert _unique.run_started(
            app_settings.DATABASE, MINUTE, message_id=message, reported_only=True
        ) == (message == reported)
        _unique.run_ended(app_settings.DATABASE, message_id=message, reported_only=True)
    rows = {row.message_id: row for row in OutboxUniqueKey.objects.all()}
    assert rows[reported].started_at is not None
    assert rows[reported].finished_at is not None
    assert (rows[recorded].started_at, rows[recorded].finished_at) == (None, None)


@pytest.mark.usefixtures("eager")
def test_a_celery_run_that_replaces_itself_eagerly_ends_after_its_replacement():
    """Eagerly, the replacement runs inside the run it replaces (``sig.apply()``): one
    report of the start, one of the end."""
    from tests.testapp.tasks import gated_plain

    ProviderCall.objects.create(key="gate:replaced")
    first = once("nightly", gated_plain, "replaced", "replace")
    with CaptureQueriesContext(connection) as queries:
        assert outbox.relay(once=True).sent == 1
    assert effects("replaced") == 1
    assert len(key_statements(queries)) == 2, key_statements(queries)
    assert OutboxUniqueKey.objects.get().finished_at is not None
    assert once("nightly", gated_plain, "replaced", "replace") != first


@pytest.mark.usefixtures("eager")
def test_a_celery_run_that_raises_ignore_has_ended():
    """``Ignore`` ends a run (Celery records nothing more of it); only a replacement's
    ``Ignore`` leaves the rest of the run to the replacement."""
    from tests.testapp.tasks import gated_plain

    first = once("nightly", gated_plain, "ignored", "ignore")
    assert outbox.relay(once=True).sent == 1
    assert OutboxUniqueKey.objects.get().finished_at is not None
    assert once("nightly", gated_plain, "ignored", "ignore") != first


# -- Django's Tasks framework through the outbox -------------------------------------------------


needs_tasks = pytest.mark.skipif(
    not settings.HAS_DJANGO_TASKS,
    reason="Django's Tasks framework with django-tasks-db is not installed",
)


@needs_tasks
@pytest.mark.parametrize("fail", [False, True], ids=["succeeded", "failed"])
@pytest.mark.parametrize("kind", ["def", "async-def", "takes-context"])
def test_a_django_task_run_by_the_database_worker_reports_its_run(kind: str, fail: bool):
    from django_idempotency import tasks_backend
    from tests.helpers import work_tasks
    from tests.testapp import tasks_framework

    django_plain = {
        "def": tasks_framework.count_plain,
        "async-def": tasks_framework.count_plain_async,
        "takes-context": tasks_framework.count_plain_with_context,
    }[kind]

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


#: Django's ``ImmediateBackend`` (Django 6's or the backport's): it runs a task inside its
#: ``enqueue``.
IMMEDIATE = (
    f"{'django.tasks' if importlib.util.find_spec('django.tasks') else 'django_tasks'}"
    ".backends.immediate.ImmediateBackend"
)


@needs_tasks
def test_a_django_task_run_inside_the_hand_over_reports_its_run_by_its_message():
    """A backend that runs a task inside its ``enqueue`` (``ImmediateBackend``) starts it
    before its result id is known."""
    from django_idempotency import tasks_backend
    from tests.testapp.tasks_framework import count_plain as django_plain

    tasks = {**settings.TASKS, "worker": {"BACKEND": IMMEDIATE}}
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


@needs_tasks
def test_a_django_message_not_reported_run_inside_the_hand_over_touches_no_key():
    """Handed over to a backend that runs it inside its ``enqueue``, a message not written
    reported is known not to be: no key is looked for by a result id none can know."""
    from tests.testapp.tasks_framework import count_plain as django_plain

    with override_settings(TASKS={**settings.TASKS, "worker": {"BACKEND": IMMEDIATE}}):
        with transaction.atomic():
            django_plain.enqueue("plain")
        with CaptureQueriesContext(connection) as queries:
            assert outbox.relay(once=True).sent == 1
    assert effects("plain") == 1
    assert key_statements(queries) == []


@needs_tasks
@pytest.mark.parametrize("target", ["database", "immediate"])
def test_a_django_task_run_inside_a_reported_run_leaves_that_runs_report_alone(target: str):
    """A reported run whose body enqueues a task on a backend that runs it at once
    (``ImmediateBackend``): that inner run neither ends the outer one's report (its key
    then held until the lease ran out) nor, inside the relay's hand-over to an
    ``ImmediateBackend``, is taken for the message handed over (its key then freed while
    the outer run goes on)."""
    from django_idempotency import tasks_backend
    from tests.helpers import work_tasks
    from tests.testapp.tasks_framework import count_plain_nesting

    tasks = {**settings.TASKS, "immediate": {"BACKEND": IMMEDIATE}}
    if target == "immediate":
        tasks["worker"] = {"BACKEND": IMMEDIATE}
    with override_settings(TASKS=tasks):
        with transaction.atomic():
            first = tasks_backend.enqueue_once("nightly", count_plain_nesting, "outer", "nightly")
        assert outbox.relay(once=True).sent == 1
        if target == "database":
            work_tasks()
        assert (effects("outer"), effects("outer:inner")) == (1, 1)
        # Still held by the outer run after the inner one ended.
        assert ProviderCall.objects.filter(key="held:outer").count() == 1
        assert not ProviderCall.objects.filter(key="freed:outer").exists()
        row = OutboxUniqueKey.objects.get()
        assert row.started_at is not None
        assert row.finished_at is not None  # the outer run's end, reported
        with transaction.atomic():
            second = tasks_backend.enqueue_once("nightly", count_plain_nesting, "outer", "nightly")
        assert second.id != first.id


@needs_tasks
def test_a_batch_mixing_reported_and_other_django_messages_writes_their_run_ids_at_once():
    """The relay hands a batch over into django-tasks-db in one ``INSERT``; the result
    ids of the reported messages among it go on their keys in one ``UPDATE`` more,
    however many they are, and on no other key."""
    from django_idempotency import tasks_backend
    from tests.helpers import work_tasks
    from tests.testapp import tasks_framework

    with transaction.atomic():
        reported = [
            tasks_backend.enqueue_once(f"r{n}", tasks_framework.count_plain, f"r{n}").id
            for n in range(3)
        ]
        reported.append(
            tasks_backend.enqueue_once("async", tasks_framework.count_plain_async, "async").id
        )
        timed = tasks_backend.enqueue_once(
            "timed", tasks_framework.count_plain, "timed", unique_until=MINUTE
        ).id
        recorded = tasks_backend.enqueue_once("recorded", tasks_framework.hold_unique, "rec", 0).id
        tasks_framework.count_plain.enqueue("plain")
    with CaptureQueriesContext(connection) as queries:
        assert outbox.relay(once=True).sent == 7
    written = key_statements(queries)
    assert len(written) == 1, written
    messages = {str(m.id): m for m in OutboxMessage.objects.all()}
    rows = {str(row.message_id): row for row in OutboxUniqueKey.objects.all()}
    assert {m: rows[m].run_id for m in reported} == {
        m: messages[m].delivery["result_id"] for m in reported
    }
    assert (rows[timed].run_id, rows[recorded].run_id) == ("", "")
    work_tasks()
    rows = {str(row.message_id): row for row in OutboxUniqueKey.objects.all()}
    assert all(rows[m].finished_at is not None for m in reported)
    assert (rows[timed].started_at, rows[recorded].started_at) == (None, None)


@needs_tasks
def test_a_hand_over_that_failed_midway_leaves_no_report_of_its_rolled_back_runs():
    """A batch handed over together fails at its second message, after its first ran
    (``ImmediateBackend`` runs a task inside its ``enqueue``): the batch rolls back, the
    reports of that attempt with it, and the messages go one by one. Each key then tells
    only what its last hand-over did: the run id of the run that counted, and no start of
    the run that failed."""
    from django_idempotency import tasks_backend
    from tests.testapp import tasks_framework

    refusing = "tests.testapp.tasks_framework.RefusingImmediateBackend"
    tasks = {**settings.TASKS, "worker": {"BACKEND": refusing}}
    with override_settings(TASKS=tasks):
        with transaction.atomic():
            ids = {
                tag: str(tasks_backend.enqueue_once(tag, tasks_framework.count_plain, tag).id)
                for tag in ("first", "refused", "last")
            }
            plain = tasks_framework.count_plain.enqueue("plain").id
        relayed = outbox.relay(once=True)
    assert (relayed.sent, relayed.failed) == (3, 1)
    assert [effects(tag) for tag in ("first", "refused", "last", "plain")] == [1, 0, 1, 1]
    messages = {str(m.id): m for m in OutboxMessage.objects.all()}
    assert messages[ids["refused"]].status == OutboxStatus.PENDING
    assert messages[plain].status == OutboxStatus.SENT
    rows = {row.key: row for row in OutboxUniqueKey.objects.all()}
    for tag in ("first", "last"):
        row = rows[tag]
        assert row.run_id == messages[ids[tag]].delivery["result_id"]
        assert row.started_at is not None
        assert row.finished_at is not None
    refused = rows["refused"]
    assert (refused.run_id, refused.started_at, refused.finished_at) == ("", None, None)


@needs_tasks
@pytest.mark.skipif(connection.vendor == "sqlite", reason="a worker with a connection of its own")
def test_a_run_started_before_the_hand_over_committed_frees_its_key_when_it_ends():
    """A ``DELIVER_TO`` backend that keeps its tasks outside the outbox's database (a
    broker's): its worker may start a task before the relay's transaction, which writes the
    run's id on its key, has committed. That start finds no key to report on; its end,
    after the commit, frees the key, which was held until the ``TTL`` after sending."""
    from django_idempotency import tasks_backend
    from tests.testapp import tasks_framework

    broker = "tests.testapp.tasks_framework.BrokerLikeBackend"
    with override_settings(TASKS={**settings.TASKS, "worker": {"BACKEND": broker}}):
        with transaction.atomic():
            first = tasks_backend.enqueue_once("nightly", tasks_framework.gated_plain, "early")
        try:
            assert outbox.relay(once=True).sent == 1
            row = OutboxUniqueKey.objects.get()
            assert row.run_id == OutboxMessage.objects.get().delivery["result_id"]
            assert row.started_at is None  # its start came too early to be reported
        finally:
            tasks_framework.GATES.setdefault("early", threading.Event()).set()
            for run in tasks_framework.BrokerLikeBackend.RUNS:
                run.join(30)
            tasks_framework.BrokerLikeBackend.RUNS.clear()
        assert effects("early") == 1
        assert OutboxUniqueKey.objects.get().finished_at is not None
        with transaction.atomic():
            second = tasks_backend.enqueue_once("nightly", tasks_framework.gated_plain, "late")
        assert second.id != first.id


# -- what a run not reported costs ---------------------------------------------------------------


def key_statements(queries: CaptureQueriesContext) -> list[str]:
    """The statements that read or wrote the keys of enqueue_once."""
    table = OutboxUniqueKey._meta.db_table
    return [query["sql"] for query in queries.captured_queries if table in query["sql"]]


@pytest.mark.usefixtures("eager")
def test_a_celery_run_reported_costs_one_update_at_its_start_and_one_at_its_end():
    once("nightly", count_plain, "costs")
    with CaptureQueriesContext(connection) as queries:
        assert outbox.relay(once=True).sent == 1
    assert effects("costs") == 1
    written = key_statements(queries)
    assert len(written) == 2, written
    assert all(sql.startswith("UPDATE") for sql in written)


@pytest.mark.usefixtures("eager")
def test_a_celery_run_not_reported_sends_no_statement_of_its_own():
    with CaptureQueriesContext(connection) as queries:
        count_plain.apply(args=("plain",))
    # The task's own INSERT of its effect, and nothing else.
    assert [query["sql"].split()[0] for query in queries.captured_queries] == ["INSERT"]


@needs_tasks
def test_a_django_task_enqueued_on_the_target_backend_costs_one_update_and_touches_no_key():
    """Not handed over by the outbox: its worker looks for a key that knows its result id
    (one ``UPDATE``), finds none, and reports no end."""
    from tests.helpers import work_tasks
    from tests.testapp.tasks_framework import count_plain as django_plain

    once("nightly", hold_plain)
    before = list(OutboxUniqueKey.objects.values())
    django_plain.using(backend="worker").enqueue("direct")
    with CaptureQueriesContext(connection) as queries:
        work_tasks()
    assert effects("direct") == 1
    written = key_statements(queries)
    assert len(written) == 1, written
    assert written[0].startswith("UPDATE")
    assert list(OutboxUniqueKey.objects.values()) == before


# -- the admin, the statistics and the audit of reported runs ------------------------------------


def test_the_admin_the_stats_and_the_audit_tell_each_reported_runs_key(admin_client: Any):
    import json
    from io import StringIO

    from django.core.management import call_command

    waiting, running, done, died = (once(key, hold_plain) for key in ("w", "r", "e", "d"))
    for message in (waiting, running, done, died):
        sent(message)
    started(running)
    started(done)
    ended(done)
    started(died, lease=timedelta(seconds=-1))
    live = {"w": True, "r": True, "e": False, "d": False}

    out = StringIO()
    call_command("idempotency_stats", "--json", "--unique-keys", "10", stdout=out)
    rows = json.loads(out.getvalue())["unique_keys"]
    assert {row["key"]: row["live"] for row in rows} == live
    out = StringIO()
    call_command("idempotency_audit", "--unique-keys", "--format", "json", stdout=out)
    assert {row["key"]: row["live"] for row in json.loads(out.getvalue())["unique_keys"]} == live

    page = admin_client.get("/admin/django_idempotency/outboxuniquekey/").content.decode()
    assert page.count("held (live)") == 2
    assert page.count("free (its message is no longer live)") == 2
    for row in OutboxUniqueKey.objects.all():
        detail = admin_client.get(f"/admin/django_idempotency/outboxuniquekey/{row.pk}/change/")
        assert detail.status_code == 200
        message = admin_client.get(
            f"/admin/django_idempotency/outboxmessage/{row.message_id}/change/"
        )
        state = "held (live)" if live[row.key] else "free (its message is no longer live)"
        assert f"{row.key} (finished): {state}" in message.content.decode()


# -- a worker's connection the server dropped while it was idle ----------------------------------


def drop_the_default_connection() -> None:
    """The server ends the default connection (an idle timeout, a restart): the next
    statement on it fails."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CONNECTION_ID()" if connection.vendor == "mysql" else "SELECT pg_backend_pid()"
        )
        (pid,) = cursor.fetchone()
    with connections["provider"].cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"KILL {int(pid)}")
        else:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.mark.skipif(connection.vendor == "sqlite", reason="a server that ends a connection")
@pytest.mark.parametrize("signal", ["task_prerun", "task_postrun"])
def test_a_run_reported_on_a_connection_the_server_dropped_is_reported_on_a_new_one(signal: str):
    """A Celery worker keeps its connection between tasks (``CONN_MAX_AGE``): the report is
    the first statement of the next run, and the one to find it dropped. Once more on a
    new connection, or the key stays held until the ``TTL`` after the message was sent."""
    from django_idempotency import tasks

    first = once("nightly", hold_plain)
    sent(first)
    if signal == "task_postrun":
        started(first)
    drop_the_default_connection()
    hold_plain.push_request(id=str(first), headers={_unique.RUN_HEADER: "1"})  # type: ignore[call-arg]
    try:
        if signal == "task_prerun":
            tasks.run_started(task=hold_plain, task_id=str(first))
        else:
            tasks.run_ended(task=hold_plain, task_id=str(first), state="SUCCESS")
    finally:
        hold_plain.pop_request()
        connection.close()
    row = OutboxUniqueKey.objects.get()
    assert row.started_at is not None
    assert (row.finished_at is not None) == (signal == "task_postrun")
