"""The transactional outbox on every database: enqueue, the relay's bookkeeping, the command.

Sends are counted by the senders of ``tests.testapp.outbox``; the Celery sender runs with
the tests' app in eager mode here (a real broker and worker: ``test_outbox_relay``).
"""

from __future__ import annotations

import math
import uuid
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.db import transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.utils import timezone

from django_idempotency import checks, maintenance, outbox, signals
from django_idempotency.models import OutboxMessage, OutboxStatus
from tests.helpers import postgres_only
from tests.testapp.models import ProviderCall
from tests.testapp.outbox import BREAKS_THE_BATCH, BROKEN, UNDELIVERABLE, sends

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

RECORD = {"OUTBOX_SENDER": "tests.testapp.outbox.record"}
uses_record = override_settings(IDEMPOTENCY=RECORD)


def enqueued(task: object = "tests.record_effect", *args: Any, **kwargs: Any) -> uuid.UUID:
    with transaction.atomic():
        return outbox.enqueue(task, *args, **kwargs)


def message(message_id: uuid.UUID) -> OutboxMessage:
    return OutboxMessage.objects.get(pk=message_id)


# -- enqueue ----------------------------------------------------------------------------------


def test_enqueue_writes_one_pending_message_in_the_transaction():
    before = timezone.now()
    message_id = enqueued("tests.record_effect", "receipt", hold=0)
    row = message(message_id)
    assert isinstance(message_id, uuid.UUID)
    assert (row.task, row.args, row.kwargs) == ("tests.record_effect", ["receipt"], {"hold": 0})
    assert (row.status, row.attempts, row.sent_at, row.last_error) == ("pending", 0, None, "")
    assert before <= row.created_at == row.available_at <= timezone.now()


def test_enqueue_takes_a_celery_task_by_its_name():
    celery = pytest.importorskip("celery")
    assert celery
    from tests.testapp.tasks import record_effect

    assert message(enqueued(record_effect, "x")).task == "tests.record_effect"


def test_a_rollback_leaves_no_message():
    def work_that_fails() -> None:
        with transaction.atomic():
            outbox.enqueue("tests.record_effect", "rolled back")
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        work_that_fails()
    assert not OutboxMessage.objects.exists()
    with uses_record:
        assert outbox.relay(once=True).sent == 0


def test_outside_a_transaction_enqueue_refuses_and_writes_nothing():
    with pytest.raises(TransactionManagementError, match=r"transaction\.atomic"):
        outbox.enqueue("tests.record_effect", "autocommit")
    assert not OutboxMessage.objects.exists()


def test_a_transaction_on_another_database_is_not_enough():
    with transaction.atomic(using="provider"), pytest.raises(TransactionManagementError):
        outbox.enqueue("tests.record_effect")
    assert not OutboxMessage.objects.exists()


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((object(),), {}), ((), {"when": timezone.now()}), ((math.nan,), {}), (({1, 2},), {})],
    ids=["object", "datetime", "nan", "set"],
)
def test_arguments_that_are_not_json_raise_type_error_and_write_nothing(args, kwargs):
    with transaction.atomic():
        with pytest.raises(TypeError, match="JSON"):
            outbox.enqueue("tests.record_effect", *args, **kwargs)
        assert not OutboxMessage.objects.exists()


@pytest.mark.parametrize("task", [None, 42, "", "  ", object()])
def test_something_that_is_not_a_task_raises_type_error(task):
    with transaction.atomic(), pytest.raises(TypeError, match="task"):
        outbox.enqueue(task)
    assert not OutboxMessage.objects.exists()


def test_a_celery_signature_is_refused_rather_than_sent_without_its_arguments():
    """A signature names its task (``.name``) but carries its own arguments and options,
    which a message would not send: the task would run without them."""
    pytest.importorskip("celery")
    from celery import chain

    from django_idempotency.models import OutboxUniqueKey
    from tests.testapp.tasks import record_effect

    signatures = [
        record_effect.s("receipt"),
        record_effect.si("receipt").set(countdown=5),
        chain(record_effect.s("a"), record_effect.si("b")),
    ]
    with transaction.atomic():
        for signature in signatures:
            with pytest.raises(TypeError, match="signature"):
                outbox.enqueue(signature)
            with pytest.raises(TypeError, match="signature"):
                outbox.enqueue_once("k", signature)
        outbox.enqueue(record_effect, "receipt")
    assert list(OutboxMessage.objects.values_list("task", "args")) == [
        ("tests.record_effect", ["receipt"])
    ]
    assert not OutboxUniqueKey.objects.exists()


def test_a_task_name_too_long_to_store_is_refused():
    with transaction.atomic(), pytest.raises(ValueError, match="255"):
        outbox.enqueue("t" * 256)
    assert not OutboxMessage.objects.exists()


# -- the relay's bookkeeping ------------------------------------------------------------------


@uses_record
def test_a_commit_is_sent_once_and_marked_sent():
    first, second = enqueued("tests.a", 1), enqueued("tests.b", 2)
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (2, 0, 0)
    assert (sends(first), sends(second)) == (1, 1)
    for message_id in (first, second):
        row = message(message_id)
        assert row.status == OutboxStatus.SENT
        assert row.sent_at is not None
    assert outbox.relay(once=True).sent == 0
    assert (sends(first), sends(second)) == (1, 1)


@uses_record
def test_the_relay_drains_in_batches_oldest_first():
    ids = [enqueued("tests.a", n) for n in range(7)]
    result = outbox.drain(batch_size=3)
    assert (result.sent, result.batches) == (7, 3)
    order = [row.key.split(":")[1] for row in ProviderCall.objects.filter(key__startswith="sent:")]
    assert order == [str(i) for i in ids]


@uses_record
def test_a_message_not_yet_due_waits():
    message_id = enqueued("tests.a")
    OutboxMessage.objects.update(available_at=timezone.now() + timedelta(minutes=1))
    assert outbox.relay(once=True).sent == 0
    assert sends(message_id) == 0


@override_settings(
    IDEMPOTENCY={**RECORD, "OUTBOX_BACKOFF": 2, "OUTBOX_BACKOFF_MAX": 5, "OUTBOX_MAX_ATTEMPTS": 3}
)
def test_a_failed_send_backs_off_then_the_message_is_dead_after_max_attempts():
    broken, fine = enqueued(BROKEN), enqueued("tests.a")
    started = timezone.now()
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (1, 1, 0)
    row = message(broken)
    assert (row.status, row.attempts) == (OutboxStatus.PENDING, 1)
    assert row.last_error == "ConnectionError: the broker is down"
    assert started + timedelta(seconds=2) <= row.available_at <= timezone.now() + timedelta(2)
    # Not due again during the same drain, nor the next one before its backoff.
    assert outbox.relay(once=True).failed == 0
    waits = []
    for attempt in (2, 3):
        OutboxMessage.objects.filter(pk=broken).update(available_at=timezone.now())
        before = timezone.now()
        outbox.relay(once=True)
        row = message(broken)
        assert row.attempts == attempt
        waits.append(row.available_at - before)
    assert row.status == OutboxStatus.DEAD
    # The second failure waited twice the first backoff (4 s); a dead message no longer moves.
    assert timedelta(seconds=4) <= waits[0] < timedelta(seconds=5)
    assert sends(fine) == 1
    assert outbox.relay(once=True).failed == 0


def test_backoff_doubles_up_to_its_ceiling():
    with override_settings(IDEMPOTENCY={"OUTBOX_BACKOFF": 1, "OUTBOX_BACKOFF_MAX": 60}):
        waits = [outbox.backoff(n).total_seconds() for n in (1, 2, 3, 4, 7, 8, 1000)]
    assert waits == [1, 2, 4, 8, 60, 60, 60]


@uses_record
def test_an_undeliverable_message_is_dead_at_once_and_the_relay_goes_on():
    dead, after = enqueued(UNDELIVERABLE), enqueued("tests.a")
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (1, 0, 1)
    row = message(dead)
    assert (row.status, row.attempts, row.last_error) == ("dead", 1, "Undeliverable: no such topic")
    assert sends(after) == 1


@uses_record
def test_the_relay_sends_the_outbox_relayed_signal():
    received: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        received.append({k: kwargs[k] for k in ("sent", "failed", "dead")})

    signals.outbox_relayed.connect(receiver, dispatch_uid="test-outbox")
    try:
        enqueued("tests.a"), enqueued(BROKEN), enqueued(UNDELIVERABLE)
        outbox.relay(once=True)
        outbox.relay(once=True)  # nothing due: no batch worth a signal
    finally:
        signals.outbox_relayed.disconnect(dispatch_uid="test-outbox")
    assert received == [{"sent": 1, "failed": 1, "dead": 1}]


# -- the Celery sender, eagerly ------------------------------------------------------------------


# The task's body writes through a second connection while the relay's batch holds SQLite's
# only write lock: PostgreSQL and MariaDB only.
@postgres_only
@pytest.mark.usefixtures("eager_celery")
def test_the_celery_sender_uses_the_message_id_as_the_task_id():
    from tests.testapp.tasks import record_effect

    message_id = enqueued(record_effect, "eager-outbox")
    assert outbox.relay(once=True).sent == 1
    assert ProviderCall.objects.filter(key="effect:eager-outbox").count() == 1
    from django_idempotency.models import IdempotencyRecord

    record = IdempotencyRecord.objects.get(account="task", operation="task:tests.record_effect")
    assert record.key == str(message_id)


@postgres_only
@pytest.mark.usefixtures("eager_celery")
def test_an_unknown_task_name_is_dead_with_the_error_and_the_relay_goes_on():
    from tests.testapp.tasks import record_effect

    unknown = enqueued("tests.no_such_task", 1)
    known = enqueued(record_effect, "after-unknown")
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (1, 0, 1)
    row = message(unknown)
    assert row.status == OutboxStatus.DEAD
    assert row.last_error == "UnknownTask: no task named 'tests.no_such_task' is registered"
    assert message(known).status == OutboxStatus.SENT
    assert ProviderCall.objects.filter(key="effect:after-unknown").count() == 1


@override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.batch_record"})
def test_a_sender_with_send_batch_gets_the_batch_at_once_and_a_failure_stays_on_its_message():
    first, broken, last = enqueued("tests.a"), enqueued(BROKEN), enqueued("tests.b")
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (2, 1, 0)
    assert ProviderCall.objects.filter(key__startswith="batch:").count() == 1
    assert (sends(first), sends(broken), sends(last)) == (1, 0, 1)
    assert (message(first).status, message(last).status) == (OutboxStatus.SENT,) * 2
    row = message(broken)
    assert (row.status, row.attempts) == (OutboxStatus.PENDING, 1)
    assert row.last_error == "ConnectionError: the broker is down"


@override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.batch_record"})
def test_a_send_batch_that_raises_rolls_the_batch_back_and_its_messages_go_one_by_one():
    ids = [enqueued("tests.a"), enqueued(BREAKS_THE_BATCH), enqueued("tests.b")]
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (3, 0, 0)
    assert ProviderCall.objects.filter(key__startswith="batch:").count() == 0
    assert [sends(i) for i in ids] == [1, 1, 1]
    assert {message(i).status for i in ids} == {OutboxStatus.SENT}


@pytest.mark.parametrize("sender", ["short_batch", "true_batch"])
def test_a_send_batch_whose_answer_cannot_be_told_is_rolled_back_and_sent_one_by_one(sender):
    """Too few outcomes (which messages they cover cannot be told), or something other than
    None or an exception for a message (True: not a failure of a message the sender handed
    over, which would be handed over again up to OUTBOX_MAX_ATTEMPTS times and then be
    dead): the batch rolls back and each message is handed over again on its own (what the
    broker took already, it keeps)."""
    with override_settings(IDEMPOTENCY={"OUTBOX_SENDER": f"tests.testapp.outbox.{sender}"}):
        ids = [enqueued("tests.a"), enqueued("tests.b"), enqueued("tests.c")]
        result = outbox.relay(once=True)
        assert (result.sent, result.failed, result.dead) == (3, 0, 0)
        handed = ProviderCall.objects.filter(key__startswith="batch:").count()
        assert [sends(i) for i in ids] == [1 + handed] * 3
        assert {message(i).status for i in ids} == {OutboxStatus.SENT}
        assert {message(i).attempts for i in ids} == {0}
        assert outbox.relay(once=True).taken == 0


# -- requeue and purge --------------------------------------------------------------------------


@uses_record
def test_requeue_makes_dead_messages_pending_and_due_with_no_attempts():
    dead, sent = enqueued(UNDELIVERABLE), enqueued("tests.a")
    outbox.relay(once=True)
    assert outbox.requeue(OutboxMessage.objects.all()) == 1
    row = message(dead)
    assert (row.status, row.attempts) == (OutboxStatus.PENDING, 0)
    assert row.available_at <= timezone.now()
    assert message(sent).status == OutboxStatus.SENT
    assert outbox.requeue(OutboxMessage.objects.all()) == 0


@override_settings(IDEMPOTENCY={**RECORD, "OUTBOX_RETENTION": 3600})
def test_purge_deletes_sent_messages_past_their_retention_in_batches():
    ids = [enqueued("tests.a", n) for n in range(5)]
    waiting, dead = enqueued(BROKEN), enqueued(UNDELIVERABLE)
    outbox.relay(once=True)
    old = timezone.now() - timedelta(hours=2)
    OutboxMessage.objects.filter(pk__in=ids[:4]).update(sent_at=old)
    OutboxMessage.objects.filter(pk__in=[waiting, dead]).update(created_at=old)
    dry = maintenance.purge_expired(batch_size=3, dry_run=True)
    assert (dry.outbox_deleted, dry.outbox_batches) == (4, 2)
    assert OutboxMessage.objects.count() == 7
    result = maintenance.purge_expired(batch_size=3)
    assert (result.outbox_deleted, result.outbox_batches) == (4, 2)
    left = set(OutboxMessage.objects.values_list("pk", flat=True))
    assert left == {ids[4], waiting, dead}


@override_settings(IDEMPOTENCY={**RECORD, "OUTBOX_RETENTION": 60})
def test_purge_max_batches_bounds_the_outbox_too():
    for n in range(4):
        enqueued("tests.a", n)
    outbox.relay(once=True)
    OutboxMessage.objects.update(sent_at=timezone.now() - timedelta(hours=1))
    result = maintenance.purge_expired(batch_size=2, max_batches=1)
    assert (result.outbox_deleted, result.complete) == (2, False)
    out = StringIO()
    call_command("purge_idempotency", "--batch-size", "2", stdout=out)
    assert "2 sent outbox messages in 1 batches." in out.getvalue()
    assert not OutboxMessage.objects.exists()


# -- the command and the task -------------------------------------------------------------------


@uses_record
def test_relay_outbox_once_prints_sent_failed_and_dead_and_succeeds():
    enqueued("tests.a"), enqueued("tests.b"), enqueued(BROKEN), enqueued(UNDELIVERABLE)
    out = StringIO()
    call_command("relay_outbox", "--once", "--batch-size", "2", stdout=out)
    assert out.getvalue().strip() == ("Sent 2 outbox messages; 1 failed (to be retried), 1 dead.")
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 2


@uses_record
def test_relay_outbox_prints_a_line_per_message_at_verbosity_2():
    sent, failed, dead = enqueued("tests.a"), enqueued(BROKEN), enqueued(UNDELIVERABLE)
    out = StringIO()
    call_command("relay_outbox", "--once", "--batch-size", "2", "-v", "2", stdout=out)
    lines = out.getvalue().strip().splitlines()
    assert lines[-1] == "Sent 1 outbox messages; 1 failed (to be retried), 1 dead."
    by_id = {line.split()[1]: line for line in lines[:-1]}
    assert len(lines) == 4
    assert by_id[str(sent)] == f"sent {sent} tests.a"
    assert by_id[str(failed)].startswith(f"failed {failed} {BROKEN}: ")
    assert by_id[str(dead)].startswith(f"dead {dead} {UNDELIVERABLE}: ")
    # At the default verbosity, the summary alone.
    enqueued("tests.b")
    out = StringIO()
    call_command("relay_outbox", "--once", stdout=out)
    assert out.getvalue().strip() == "Sent 1 outbox messages; 0 failed (to be retried), 0 dead."


@postgres_only  # the sender writes through "default" while the batch holds SQLite's lock
@uses_record
def test_relay_outbox_database_option():
    # "provider" mirrors "default" in the tests: the same table, reached by another alias.
    enqueued("tests.a")
    out = StringIO()
    call_command("relay_outbox", "--once", "--database", "provider", stdout=out)
    assert out.getvalue().startswith("Sent 1 outbox messages")


@override_settings(IDEMPOTENCY=RECORD)  # a sender that imports without Celery (tox 'core')
def test_relay_outbox_refuses_bad_arguments_and_sends_nothing():
    enqueued("tests.a")
    with pytest.raises(CommandError, match="Unknown database"):
        call_command("relay_outbox", "--once", "--database", "nope")
    with pytest.raises(CommandError, match="positive integer"):
        call_command("relay_outbox", "--once", "--batch-size", "0")
    bad_sender = override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.no_such.sender"})
    with bad_sender, pytest.raises(CommandError, match="OUTBOX_SENDER"):
        call_command("relay_outbox", "--once")
    assert OutboxMessage.objects.get().status == OutboxStatus.PENDING


@uses_record
def test_the_celery_task_drains_once():
    pytest.importorskip("celery", reason="the beat task is Celery's")
    from django_idempotency import tasks

    enqueued("tests.a"), enqueued(BROKEN)
    result = tasks.relay_outbox.apply().get()
    assert (result["sent"], result["failed"], result["dead"]) == (1, 1, 0)


# -- system checks ------------------------------------------------------------------------------


def outbox_check_ids(**entries: Any) -> list[str]:
    with override_settings(IDEMPOTENCY=entries):
        return [str(m.id) for m in checks.check_settings()]


def test_outbox_defaults_pass():
    assert outbox_check_ids() == []
    assert outbox_check_ids(OUTBOX_SENDER=outbox.relay_batch, OUTBOX_BACKOFF=0.5) == []


@pytest.mark.parametrize("sender", ["tests.no_such.sender", "django_idempotency.conf.DEFAULTS", 7])
def test_e030_sender(sender):
    assert outbox_check_ids(OUTBOX_SENDER=sender) == ["django_idempotency.E030"]


@pytest.mark.parametrize("value", [0, -1, "20", None, True, 2.5])
def test_e031_max_attempts(value):
    assert outbox_check_ids(OUTBOX_MAX_ATTEMPTS=value) == ["django_idempotency.E031"]


@pytest.mark.parametrize("value", [0, -1, "7d", None, True])
def test_e032_retention(value):
    assert outbox_check_ids(OUTBOX_RETENTION=value) == ["django_idempotency.E032"]


@pytest.mark.parametrize("value", [0, -1, "100", None, False])
def test_e033_batch_size(value):
    assert outbox_check_ids(OUTBOX_BATCH_SIZE=value) == ["django_idempotency.E033"]


@pytest.mark.parametrize("value", [0, -1, "1s", None])
def test_e034_backoff(value):
    assert outbox_check_ids(OUTBOX_BACKOFF=value) == ["django_idempotency.E034"]


@pytest.mark.parametrize("value", [0, "5m", None, 0.5])
def test_e035_backoff_max(value):
    # 0.5 s is shorter than the default first backoff of 1 s.
    assert outbox_check_ids(OUTBOX_BACKOFF_MAX=value) == ["django_idempotency.E035"]


@pytest.mark.parametrize("value", [0, -1, "1s", None])
def test_e036_poll_interval(value):
    assert outbox_check_ids(OUTBOX_POLL_INTERVAL=value) == ["django_idempotency.E036"]


def test_check_command_reports_outbox_errors():
    invalid = override_settings(IDEMPOTENCY={"OUTBOX_MAX_ATTEMPTS": 0})
    with invalid, pytest.raises(SystemCheckError, match="E031"):
        call_command("check", stdout=StringIO(), stderr=StringIO())
