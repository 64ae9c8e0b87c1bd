"""The relay's batches against what breaks them: a relay run inside the caller's own
transaction, batch sizes at their limits, batches larger than one statement's parameters,
hand-overs that leave the batch's transaction unusable, and a hand-over into a database
other than the outbox's.

Sends are counted (a sender that appends each message it is handed to a list, which no
rollback takes back; the rows the Tasks backend wrote; the bodies that ran), never inferred
from a status.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.utils import timezone

from django_idempotency import outbox
from django_idempotency._validation import MAX_INT
from django_idempotency.models import OutboxMessage, OutboxStatus
from tests.factories import store_raw_json
from tests.helpers import postgres_only
from tests.testapp.outbox import sends

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


class Handed:
    """A sender that hands nothing anywhere: it keeps the id of every message it is given."""

    def __init__(self) -> None:
        self.ids: list[uuid.UUID] = []

    def __call__(self, message: OutboxMessage) -> None:
        self.ids.append(message.id)


def enqueued(task: str = "tests.a", *args: Any) -> uuid.UUID:
    with transaction.atomic():
        return outbox.enqueue(task, *args)


# -- a relay inside the caller's transaction ----------------------------------------------------


class CallersWorkFailed(Exception):
    """The caller's work fails after the relay ran: its transaction rolls back."""


def long_running(sender: Handed) -> object:
    """A relay that is not ``once``: stopped once it handed something over, or after 5 s."""
    deadline = time.monotonic() + 5
    return outbox.relay(
        sender=sender,
        listen=False,
        poll_interval=0.01,
        stop=lambda: bool(sender.ids) or time.monotonic() > deadline,
    )


RELAY_CALLS: dict[str, Callable[[Handed], object]] = {
    "relay-once": lambda sender: outbox.relay(once=True, sender=sender),
    "relay": lambda sender: long_running(sender),
    "drain": lambda sender: outbox.drain(sender=sender),
    "relay-batch": lambda sender: outbox.relay_batch(sender=sender),
}


@pytest.mark.parametrize("call", RELAY_CALLS.values(), ids=RELAY_CALLS.keys())
def test_a_relay_inside_the_callers_transaction_hands_over_nothing_it_has_not_committed(call):
    """The outbox promises "never before the commit": a relay run on a connection inside the
    caller's transaction.atomic() reads that transaction's own messages, and its batch is a
    savepoint that commits only with the caller. It is refused before it takes anything."""
    committed = enqueued("tests.committed")
    handed = Handed()
    refused: list[Exception] = []

    def callers_work() -> None:
        with transaction.atomic():
            outbox.enqueue("tests.uncommitted")
            try:
                call(handed)
            except TransactionManagementError as exc:
                refused.append(exc)
            raise CallersWorkFailed

    with pytest.raises(CallersWorkFailed):
        callers_work()
    assert handed.ids == []  # neither the uncommitted message, nor one marked in a rollback
    assert len(refused) == 1
    assert "transaction" in str(refused[0])
    assert list(OutboxMessage.objects.values_list("pk", "status")) == [
        (committed, OutboxStatus.PENDING)
    ]
    # Outside it, the relay sends what committed, once.
    assert outbox.relay(once=True, sender=handed).sent == 1
    assert handed.ids == [committed]


@pytest.mark.django_db(transaction=False)
def test_a_relay_inside_a_test_cases_transaction_is_no_callers_transaction():
    """pytest-django's db (Django's TestCase) wraps the test in transactions of its own: what
    the test committed is committed as far as the test is concerned, and the relay sends it."""
    first = enqueued("tests.a")
    handed = Handed()
    assert outbox.relay(once=True, sender=handed).sent == 1
    assert handed.ids == [first]


# -- batch sizes at their limits ----------------------------------------------------------------

# OUTBOX_BATCH_SIZE admits a whole number from 1 to MAX_INT (check E033); so must the argument.
BAD_SIZES = [0, -1, True, False, 1.5, "3", MAX_INT + 1, 2**63, math.inf, math.nan]


def run_with_batch_size(call: str, sender: Handed, size: object) -> object:
    if call == "relay":
        deadline = time.monotonic() + 5
        return outbox.relay(
            sender=sender,
            batch_size=size,  # type: ignore[arg-type]
            listen=False,
            poll_interval=0.01,
            stop=lambda: bool(sender.ids) or time.monotonic() > deadline,
        )
    if call == "relay-once":
        return outbox.relay(once=True, sender=sender, batch_size=size)  # type: ignore[arg-type]
    if call == "drain":
        return outbox.drain(sender=sender, batch_size=size)  # type: ignore[arg-type]
    return outbox.relay_batch(sender=sender, batch_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", BAD_SIZES, ids=repr)
@pytest.mark.parametrize("call", ["relay-once", "relay", "drain", "relay-batch"])
def test_a_batch_size_out_of_the_settings_range_is_refused_before_anything_is_sent(call, size):
    """True is no batch of one, 1.5 no batch at all, 2**63 no LIMIT a database takes, and a
    long-running relay does not turn a wrong argument into an endless run of errors."""
    pending = enqueued()
    handed = Handed()
    with pytest.raises(ValueError, match="batch_size must be a whole number from 1 to"):
        run_with_batch_size(call, handed, size)
    assert handed.ids == []
    assert OutboxMessage.objects.get(pk=pending).status == OutboxStatus.PENDING


@pytest.mark.parametrize("size", ["0", "-1", str(MAX_INT + 1), str(2**63), "1.5", "x"])
def test_relay_outbox_refuses_a_batch_size_out_of_the_settings_range(size):
    pending = enqueued()
    with (
        override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.record"}),
        pytest.raises(CommandError, match="--batch-size"),
    ):
        call_command("relay_outbox", "--once", "--batch-size", size, stdout=StringIO())
    assert OutboxMessage.objects.get(pk=pending).status == OutboxStatus.PENDING
    assert sends(pending) == 0


class QueueingSender(Handed):
    """A sender that is also a queue (``len()``: what it holds undelivered, as a Kafka
    producer answers): empty, it is false."""

    def __len__(self) -> int:
        return 0


def test_a_sender_that_is_false_is_the_sender_used_not_the_configured_one():
    first = enqueued("tests.no_such_celery_task")
    sender = QueueingSender()
    result = outbox.relay(once=True, sender=sender)
    assert sender.ids == [first]
    assert (result.sent, result.dead) == (1, 0)


# -- a batch larger than one statement's parameters ---------------------------------------------


@pytest.fixture
def sqlites_own_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The SQLite connection limited to the parameters Django's SQLite backend says a
    statement takes (``max_query_params``: 999, SQLite's limit before 3.32, and that of many
    builds still); its own limit again afterwards."""
    if connection.vendor != "sqlite" or not hasattr(sqlite3.Connection, "setlimit"):
        pytest.skip("SQLite's limit on a statement's parameters, set through Python 3.11+")
    connection.ensure_connection()
    raw = connection.connection
    # Django 6.1 reads the connection's own limit (250,000 in recent builds): 999, as before.
    limit = min(connection.features.max_query_params or 999, 999)
    monkeypatch.setattr(type(connection.features), "max_query_params", limit)
    own = raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, limit)
    try:
        yield limit
    finally:
        raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, own)


def due_messages(count: int, using: str = "default") -> None:
    now = timezone.now()
    OutboxMessage.objects.using(using).bulk_create(
        [
            OutboxMessage(task="tests.a", args=[n], kwargs={}, available_at=now, created_at=now)
            for n in range(count)
        ],
        batch_size=5000,
    )


def due_messages_copied_by_postgresql(count: int) -> None:
    """As ``due_messages(count)`` on PostgreSQL: the first written by the ORM, the others
    copies of it that the server makes (args ``[1]`` ... ``[count - 1]``, ids of their own).
    Building 65,536 messages in Python took most of the time of the test that needs them
    (12.7 of its 29.6 s under cProfile), and none of what it shows."""
    due_messages(1)
    quote = connection.ops.quote_name
    made = {"id": "gen_random_uuid()", "args": "jsonb_build_array(n)"}
    columns = [field.column for field in OutboxMessage._meta.concrete_fields]
    table = quote(OutboxMessage._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({', '.join(quote(column) for column in columns)})"
            f" SELECT {', '.join(made.get(column, quote(column)) for column in columns)}"
            f" FROM {table}, generate_series(1, %s) AS n",
            [count - 1],
        )


def relayed_twice(**arguments: Any) -> None:
    """Two relay runs, whatever either raises: a batch that rolled back is taken again."""
    for _ in range(2):
        with contextlib.suppress(DatabaseError):
            outbox.relay(once=True, **arguments)


def test_a_batch_of_more_messages_than_sqlite_takes_parameters_is_marked_sent_once(
    sqlites_own_limit,
):
    """Marking a batch sent was one UPDATE ... WHERE id IN (one parameter per message): past
    the database's limit it failed after every message had been handed over, the batch
    rolled back, and every run handed the whole batch over again, for ever."""
    count = sqlites_own_limit + 1
    due_messages(count)
    handed = Handed()
    relayed_twice(batch_size=count, sender=handed)
    assert (len(handed.ids), len(set(handed.ids))) == (count, count)  # each once
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == count


@pytest.mark.skipif(not settings.HAS_DJANGO_TASKS, reason="needs Django's Tasks framework")
def test_a_batch_of_tasks_whose_deliveries_exceed_sqlites_parameters_is_handed_over_once(
    sqlites_own_limit,
):
    """Each task's message is marked with its delivery too: three parameters a message."""
    from django_tasks_db.models import DBTaskResult

    from tests.testapp.tasks_framework import record_plain

    count = sqlites_own_limit // 3 + 1
    with transaction.atomic():
        for n in range(count):
            record_plain.enqueue(f"many-{n}")
    relayed_twice(batch_size=count)
    assert DBTaskResult.objects.count() == count
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == count


@pytest.mark.skipif(not settings.HAS_DJANGO_TASKS, reason="needs Django's Tasks framework")
def test_a_batch_of_reported_tasks_past_sqlites_parameters_writes_every_run_id_once(
    sqlites_own_limit,
):
    """The run ids of a batch's reported messages (``enqueue_once`` of a task not under
    ``@idempotent_task()``) go on their keys in one statement per part that one
    statement's parameters hold: three a message."""
    from django_idempotency import tasks_backend
    from django_idempotency.models import OutboxUniqueKey
    from tests.testapp.tasks_framework import count_plain

    count = sqlites_own_limit // 3 + 1
    with transaction.atomic():
        for n in range(count):
            tasks_backend.enqueue_once(f"many-{n}", count_plain, f"many-{n}")
    assert outbox.relay(once=True, batch_size=count).sent == count
    result_ids = {m.id: m.delivery["result_id"] for m in OutboxMessage.objects.all()}
    run_ids = dict(OutboxUniqueKey.objects.values_list("message_id", "run_id"))
    assert run_ids == result_ids


@pytest.mark.skipif("server_binding" not in settings.DATABASES, reason="TEST_DB=postgres")
def test_a_batch_past_postgresqls_65535_parameters_is_marked_sent_once():
    """Through server-side binding a statement carries at most 65535 parameters."""
    count = 65536
    due_messages_copied_by_postgresql(count)
    assert OutboxMessage.objects.values("args").distinct().count() == count
    handed = Handed()
    relayed_twice(using="server_binding", batch_size=count, sender=handed)
    assert (len(handed.ids), len(set(handed.ids))) == (count, count)  # each once
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == count


# -- a hand-over together that leaves the batch's transaction unusable ----------------------


def users(*names: str) -> list[int]:
    return [User.objects.filter(username=name).count() for name in names]


@pytest.mark.usefixtures("eager_celery")
def test_an_eager_celery_body_whose_insert_fails_fails_its_own_message_alone():
    """Under task_always_eager the default sender's batch runs each body in the relay's
    batch transaction, without the savepoint a send on its own gets. A body whose INSERT
    failed (Celery keeps the error in the eager result) left that transaction unusable:
    marking the batch failed, the batch rolled back, and every run ran every body again
    without ever marking one sent."""
    from tests.testapp.tasks import register_user

    User.objects.create(username="taken")
    with transaction.atomic():
        first = outbox.enqueue(register_user, "ada")
        clash = outbox.enqueue(register_user, "taken")
        last = outbox.enqueue(register_user, "grace")
    for _ in range(3):
        with contextlib.suppress(DatabaseError, TransactionManagementError):
            outbox.relay(once=True)
        OutboxMessage.objects.filter(pk=clash).update(available_at=timezone.now())
    assert users("ada", "taken", "grace") == [1, 1, 1]
    states = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert (states[first], states[last]) == (OutboxStatus.SENT, OutboxStatus.SENT)
    clashed = OutboxMessage.objects.get(pk=clash)
    assert (clashed.status, clashed.attempts) == (OutboxStatus.PENDING, 3)


def swallows_its_failed_insert(sender: Any, task_result: Any, **kwargs: Any) -> None:
    """A receiver of task_enqueued that catches its own failed INSERT and returns."""
    if task_result.args[:1] == ["clashes"]:
        with contextlib.suppress(IntegrityError):
            User.objects.create(username="taken")


@pytest.mark.skipif(not settings.HAS_DJANGO_TASKS, reason="needs Django's Tasks framework")
def test_a_task_enqueued_receiver_that_swallows_its_failed_insert_fails_its_message_alone():
    """The batch's INSERT into django-tasks-db and its task_enqueued receivers run in the
    batch's transaction without a savepoint: a receiver that caught its own failed statement
    left the transaction unusable, and no run ever marked anything sent."""
    from django_tasks_db.compat import task_enqueued
    from django_tasks_db.models import DBTaskResult

    from tests.testapp.tasks_framework import record_plain

    User.objects.create(username="taken")
    with transaction.atomic():
        ids = [record_plain.enqueue(tag).id for tag in ("before", "clashes", "after")]
    task_enqueued.connect(swallows_its_failed_insert, dispatch_uid="test-swallows")
    try:
        for _ in range(2):
            with contextlib.suppress(DatabaseError, TransactionManagementError):
                outbox.relay(once=True)
    finally:
        task_enqueued.disconnect(dispatch_uid="test-swallows")
    delivered = sorted(row.args_kwargs["args"][0] for row in DBTaskResult.objects.all())
    assert delivered == ["after", "before"]
    states = [OutboxMessage.objects.get(pk=pk) for pk in ids]
    assert [(m.status, m.attempts) for m in states] == [
        (OutboxStatus.SENT, 0),
        (OutboxStatus.PENDING, 1),
        (OutboxStatus.SENT, 0),
    ]


# -- a hand-over into another database than the outbox's -------------------------------------


class TasksOnProvider:
    """django-tasks-db's rows through the ``provider`` connection: another database as far
    as transactions go (on PostgreSQL and MariaDB the same one, through a second session)."""

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return "provider" if model._meta.app_label == "django_tasks_database" else None

    db_for_read = db_for_write


on_another_database = [
    pytest.mark.skipif(not settings.HAS_DJANGO_TASKS, reason="needs Django's Tasks framework"),
    postgres_only,
    override_settings(DATABASE_ROUTERS=["tests.test_outbox_batches.TasksOnProvider"]),
]


def tasks_delivered() -> dict[str, int]:
    """How many rows django-tasks-db holds for each tag: how often it was delivered."""
    from django_tasks_db.models import DBTaskResult

    rows = DBTaskResult.objects.using("provider").all()
    return dict(Counter(row.args_kwargs["args"][0] for row in rows))


@contextmanager
def task_enqueued_raises(when: Callable[[str], bool]) -> Iterator[None]:
    """A receiver of task_enqueued that raises for the tasks whose tag ``when`` picks."""
    from django_tasks_db.compat import task_enqueued

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if when(task_result.args[0]):
            raise ConnectionError("the receiver's own service is down")

    task_enqueued.connect(receiver, dispatch_uid="test-raises")
    try:
        yield
    finally:
        task_enqueued.disconnect(dispatch_uid="test-raises")


def apply(marks: list[Any]) -> Callable[[Any], Any]:
    def decorated(test: Any) -> Any:
        for mark in reversed(marks):
            test = mark(test)
        return test

    return decorated


@apply(on_another_database)
def test_a_batch_that_rolls_back_takes_its_hand_over_into_another_database_back_with_it():
    """The docs: a batch whose hand-over raises rolls back with the batch's transaction and
    is handed over again one by one. Into another database the first hand-over had already
    committed on its own: every message of the batch was delivered twice, with no crash."""
    from tests.testapp.tasks_framework import record_plain

    tags = [f"other-{n}" for n in range(5)]
    with transaction.atomic():
        for tag in tags:
            record_plain.enqueue(tag)
    failures = iter([True])  # the first task_enqueued only: a passing fault
    with task_enqueued_raises(lambda tag: next(failures, False)):
        result = outbox.relay(once=True)
    assert (result.sent, result.failed) == (5, 0)
    assert tasks_delivered() == dict.fromkeys(tags, 1)


@apply(on_another_database)
def test_a_message_whose_hand_over_into_another_database_fails_is_not_delivered_meanwhile():
    """Handed over one by one, a message whose hand-over raised after its row was written is
    recorded as failed and retried; into another database its row had committed anyway, and
    every retry delivered it once more."""
    from tests.testapp.tasks_framework import record_plain

    with transaction.atomic():
        ids = {tag: record_plain.enqueue(tag).id for tag in ("first", "refused", "last")}
    with task_enqueued_raises(lambda tag: tag == "refused"):
        for _ in range(3):
            outbox.relay(once=True)
            OutboxMessage.objects.filter(pk=ids["refused"]).update(available_at=timezone.now())
    assert tasks_delivered() == {"first": 1, "last": 1}
    refused = OutboxMessage.objects.get(pk=ids["refused"])
    assert (refused.status, refused.attempts) == (OutboxStatus.PENDING, 3)


def swallows_its_failed_insert_on_provider(sender: Any, task_result: Any, **kwargs: Any) -> None:
    """A receiver of task_enqueued that catches its own failed INSERT into the database the
    rows go to (which PostgreSQL then refuses to go on with, until rolled back)."""
    if task_result.args[:1] == ["clashes"]:
        with contextlib.suppress(IntegrityError):
            User.objects.using("provider").create(username="taken")


@apply(on_another_database)
def test_a_hand_over_into_another_database_that_cannot_commit_is_never_marked_sent():
    """The transaction held on the other database must not roll back silently (as an atomic
    block marked for rollback does when it ends) while the batch marks its messages sent."""
    from django_tasks_db.compat import task_enqueued

    from tests.testapp.tasks_framework import record_plain

    User.objects.using("provider").create(username="taken")
    with transaction.atomic():
        ids = [record_plain.enqueue(tag).id for tag in ("before", "clashes", "after")]
    task_enqueued.connect(swallows_its_failed_insert_on_provider, dispatch_uid="test-swallows")
    try:
        for _ in range(2):
            outbox.relay(once=True)
    finally:
        task_enqueued.disconnect(dispatch_uid="test-swallows")
    delivered = tasks_delivered()
    assert delivered.keys() >= {"before", "after"}
    assert set(delivered.values()) == {1}
    sent = OutboxMessage.objects.filter(pk__in=ids, status=OutboxStatus.SENT)
    assert {message.args[0] for message in sent} == set(delivered)  # sent: delivered, once


# -- the backoff of a failure late in a slow batch ----------------------------------------------


class SlowAndFailing(Handed):
    """A sender that takes 0.6 s a message and fails ``tests.failing``; keeps when each send of
    that task began."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: list[float] = []

    def __call__(self, message: OutboxMessage) -> None:
        if message.task == "tests.failing":
            self.failing.append(time.monotonic())
        time.sleep(0.6)
        if message.task == "tests.failing":
            raise ConnectionError("the endpoint timed out")
        super().__call__(message)


@override_settings(IDEMPOTENCY={"OUTBOX_BACKOFF": 1, "OUTBOX_BACKOFF_MAX": 60})
def test_a_failure_late_in_a_slow_batch_still_waits_its_whole_backoff():
    """The docs: a failed send moves available_at later by the backoff (1 s here). It was
    counted from the batch's start, not from the failure: the last message of a batch that
    took 1.8 s was due again at once, and the same drain sent it again 0.6 s after its
    failure."""
    with transaction.atomic():
        for task in ("tests.a", "tests.b", "tests.failing", "tests.c"):
            outbox.enqueue(task)
    sender = SlowAndFailing()
    outbox.drain(batch_size=3, sender=sender)
    assert len(sender.ids) == 3  # a, b, c
    failing = OutboxMessage.objects.get(task="tests.failing")
    assert len(sender.failing) == failing.attempts == 1, sender.failing


@apply(on_another_database)
def test_a_relay_inside_a_transaction_on_the_other_database_is_refused_and_loses_nothing():
    """The hand-over into another database commits with the caller's transaction there, if
    the relay runs inside one: the batch committed as sent, and the caller's rollback took
    the rows away - messages marked sent that no worker will ever see."""
    from tests.testapp.tasks_framework import record_plain

    with transaction.atomic():
        ids = [record_plain.enqueue(f"inside-{n}").id for n in range(3)]
    refused: list[Exception] = []

    def callers_work() -> None:
        with transaction.atomic(using="provider"):
            try:
                outbox.relay(once=True)
            except TransactionManagementError as exc:
                refused.append(exc)
            raise CallersWorkFailed

    with pytest.raises(CallersWorkFailed):
        callers_work()
    assert len(refused) == 1
    states = set(OutboxMessage.objects.filter(pk__in=ids).values_list("status", flat=True))
    assert states == {OutboxStatus.PENDING}  # none marked sent without its row
    assert outbox.relay(once=True).sent == 3
    assert tasks_delivered() == {f"inside-{n}": 1 for n in range(3)}


# -- a send that fails in the middle of a batch (held) --------------------------------------


@override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.batch_record"})
def test_a_send_that_fails_third_in_a_batch_of_ten_fails_alone_and_is_sent_once_later():
    """A sender's batch whose 3rd send fails: the two before it and the seven after it are
    handed over once and marked sent; the 3rd is retried after its backoff, once, and so
    comes after the others (order is not a promise)."""
    ids = [enqueued("tests.broken" if n == 2 else "tests.a", n) for n in range(10)]
    result = outbox.relay(once=True, batch_size=10)
    assert (result.sent, result.failed, result.dead) == (9, 1, 0)
    assert [sends(i) for i in ids] == [1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    states = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert [states[i] for i in ids].count(OutboxStatus.SENT) == 9
    assert outbox.relay(once=True, batch_size=10).failed == 0  # not before its backoff
    OutboxMessage.objects.filter(pk=ids[2]).update(task="tests.a", available_at=timezone.now())
    assert outbox.relay(once=True, batch_size=10).sent == 1
    assert [sends(i) for i in ids] == [1] * 10


# -- a batch larger than one statement MariaDB takes (held) ------------------------------------


@pytest.mark.skipif(not settings.HAS_DJANGO_TASKS, reason="needs Django's Tasks framework")
@pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB's max_allowed_packet")
def test_a_batch_of_tasks_larger_than_max_allowed_packet_is_handed_over_one_by_one():
    """Each message fits one statement (enqueue checks it), their batch does not: the
    multi-row INSERT makes MariaDB drop the connection, the batch rolls back, and the relay
    hands the messages over one by one on a new connection; 4-byte text arrives intact."""
    from django_tasks_db.models import DBTaskResult

    from tests.testapp.tasks_framework import record_plain

    with connection.cursor() as cursor:
        cursor.execute("SELECT @@max_allowed_packet")
        (packet,) = cursor.fetchone()
    large = "x" * int(packet / 2.5)
    texts = [f"a{large}", f"b{large}", f"c{large}", "\U0001f600 \U00020000"]
    with transaction.atomic():
        ids = [record_plain.enqueue(text).id for text in texts]
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (4, 0, 0)
    delivered = [row.args_kwargs["args"][0] for row in DBTaskResult.objects.all()]
    assert sorted(delivered) == sorted(texts)  # each once, intact
    assert OutboxMessage.objects.filter(pk__in=ids, status=OutboxStatus.SENT).count() == 4


# -- a poll interval out of the setting's range -------------------------------------------------


@pytest.mark.parametrize("interval", [0, -1, True, "1", math.nan, math.inf, 10**12], ids=repr)
def test_a_poll_interval_out_of_the_settings_range_is_refused_before_anything_is_sent(interval):
    """OUTBOX_POLL_INTERVAL admits more than zero seconds, at most MAX_DURATION (check
    E036); the poll_interval argument of a long-running relay took anything: 0 or -1 drained
    in a loop without a pause, hammering the database, and "1" or NaN failed inside the
    relay's error loop, retried for ever instead of raised."""
    pending = enqueued()
    handed = Handed()
    deadline = time.monotonic() + 2
    with pytest.raises(ValueError, match="poll_interval must be"):
        outbox.relay(
            sender=handed,
            listen=False,
            poll_interval=interval,  # type: ignore[arg-type]
            stop=lambda: time.monotonic() > deadline,
        )
    assert handed.ids == []
    assert OutboxMessage.objects.get(pk=pending).status == OutboxStatus.PENDING


# -- a stored delivery that cannot be read back ---------------------------------------------


# The delivery column as another program could write it: not an object, or JSON that Python
# cannot decode. The stored arguments are checked message by message (Unreadable: dead at
# once, the rest sent); the delivery was decoded by the model field for the whole batch.
UNREADABLE_DELIVERIES = {
    "a-list": "[1, 2]",
    "a-string": '"worker"',
    "a-5000-digit-number": '{"backend": ' + "9" * 5000 + "}",
    "nested-1500-deep": '{"a": ' + "[" * 1500 + "]" * 1500 + "}",
}


@pytest.mark.parametrize("text", UNREADABLE_DELIVERIES.values(), ids=UNREADABLE_DELIVERIES.keys())
def test_a_message_whose_stored_delivery_cannot_be_read_is_dead_and_holds_back_no_other(text):
    """The spec: no message holds back the other messages of its batch. One whose delivery
    was not a JSON object made every batch that took it fail, before anything was sent: the
    relay raised on every run, and none of the batch's messages was ever sent."""
    if connection.vendor == "mysql" and "[" * 32 in text:
        pytest.skip("MariaDB's JSON columns refuse more than 31 levels of nesting")
    before, unreadable, after = enqueued("tests.a", 1), enqueued("tests.c"), enqueued("tests.b")
    store_raw_json(OutboxMessage, unreadable, "delivery", text)
    handed = Handed()
    for _ in range(2):
        with contextlib.suppress(Exception):
            outbox.relay(once=True, sender=handed)
    assert sorted(map(str, handed.ids)) == sorted([str(before), str(after)])
    row = OutboxMessage.objects.defer("delivery").get(pk=unreadable)
    assert row.status == OutboxStatus.DEAD
    assert row.last_error.startswith("Unreadable: the stored delivery ")
