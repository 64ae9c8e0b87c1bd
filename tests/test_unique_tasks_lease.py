"""One live task per key when a run outlives its lease: a slow first delivery of a message
beside a second delivery of it that took its stale lease over.

Two deliveries of one message (Celery's redelivery of an ``acks_late`` message, the relay's
at-least-once hand-over) run eagerly in two threads, each on its own connection to
PostgreSQL. Runs are counted by their ``start:`` rows (written through the ``provider``
connection, so they survive a rollback) and their ``effect:`` rows (committed with the
record); live messages by the outbox's rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.utils import timezone

from django_idempotency import _unique, outbox
from django_idempotency.models import (
    IdempotencyRecord,
    OutboxMessage,
    OutboxStatus,
    OutboxUniqueKey,
)
from tests.helpers import postgres_only, wait_until
from tests.testapp.models import ProviderCall

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

celery = pytest.importorskip("celery", reason="Celery is an optional dependency")

from tests.testapp import tasks  # noqa: E402

TIMEOUT = 15  # seconds: a bound on every wait


@pytest.fixture
def gates() -> Iterator[list[threading.Event]]:
    opened = [threading.Event() for _ in range(3)]
    tasks.OUTLIVED_GATES[:] = opened
    try:
        yield opened
    finally:
        for gate in opened:
            gate.set()
        tasks.OUTLIVED_GATES[:] = []


def deliver(message_id: Any, errors: list[BaseException]) -> threading.Thread:
    """A delivery of the message, eagerly, in a thread of its own."""

    def run() -> None:
        try:
            tasks.outlives_its_lease.apply(args=("t",), task_id=str(message_id), throw=True)
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def starts() -> int:
    return ProviderCall.objects.using("provider").filter(key__startswith="start:t:").count()


def once() -> Any:
    with transaction.atomic():
        return outbox.enqueue_once("k", tasks.outlives_its_lease, "t")


def lease_of(message_id: Any) -> Callable[[], bool]:
    account, operation, key = _unique.record_identity("tests.outlives_its_lease", message_id)

    def ran_out() -> bool:
        record = IdempotencyRecord.objects.get(account=account, operation=operation, key=key)
        return record.lease_expires_at <= timezone.now()

    return ran_out


@pytest.mark.usefixtures("eager_celery")
def test_a_run_that_fails_after_losing_its_lease_leaves_the_key_to_the_run_that_took_over(
    gates: list[threading.Event],
):
    first = once()
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.SENT, sent_at=timezone.now())
    slow: list[BaseException] = []
    taker: list[BaseException] = []
    original = deliver(first, slow)
    wait_until(lambda: starts() == 1, "the first delivery to start", TIMEOUT)
    wait_until(lease_of(first), "the first delivery's lease to run out", TIMEOUT)
    # A second delivery of the same message takes the stale lease over and runs.
    takeover = deliver(first, taker)
    wait_until(lambda: starts() == 2, "the second delivery to start", TIMEOUT)
    # The slow first delivery now fails: its work rolls back, and its record is no longer
    # its own to release.
    gates[0].set()
    original.join(TIMEOUT)
    assert [type(e) for e in slow] == [RuntimeError]
    assert takeover.is_alive()
    # The message's run (the second delivery) is still live: the key is held.
    assert once() == first
    assert OutboxMessage.objects.count() == 1
    gates[1].set()
    takeover.join(TIMEOUT)
    assert taker == []
    assert ProviderCall.objects.filter(key="effect:t").count() == 1
    # Once the run that holds it finished, the key is free.
    assert once() != first
    assert OutboxMessage.objects.count() == 2


def test_enqueues_of_an_attempt_that_lost_its_lease_roll_back_with_it():
    """``run_once`` whose lease a retry took over while its body ran: its ``enqueue_once``
    and ``enqueue`` roll back with its work; the retry's enqueue (waiting meanwhile on the
    key the late attempt inserted) holds the key."""
    from django_idempotency import run_once
    from django_idempotency._once import LeaseTakenOver

    identity = {"account": "a", "operation": "nightly.enqueue", "key": "once"}
    enqueued, gate = threading.Event(), threading.Event()
    late: list[BaseException] = []
    answers: list[Any] = []

    def slow() -> str:
        outbox.enqueue_once("k", tasks.record_effect, "late")
        outbox.enqueue(tasks.record_effect, "late-plain")
        enqueued.set()
        gate.wait(TIMEOUT)
        return "late"

    def retry() -> str:
        outbox.enqueue_once("k", tasks.record_effect, "retry")
        return "retry"

    def in_a_thread(body: Callable[[], str], lease: int, into: list[Any]) -> threading.Thread:
        def run() -> None:
            try:
                into.append(run_once(body, lease=lease, **identity))
            except BaseException as exc:  # reported by the test
                into.append(exc)
            finally:
                connections.close_all()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    original = in_a_thread(slow, 1, late)
    assert enqueued.wait(TIMEOUT)
    wait_until(
        lambda: IdempotencyRecord.objects.get().lease_expires_at <= timezone.now(),
        "the late attempt's lease to run out",
        TIMEOUT,
    )
    takeover = in_a_thread(retry, 30, answers)
    wait_until(
        lambda: IdempotencyRecord.objects.get().recovery_attempts == 1,
        "the retry to take the lease over",
        TIMEOUT,
    )
    gate.set()
    original.join(TIMEOUT)
    takeover.join(TIMEOUT)
    assert [type(e) for e in late] == [LeaseTakenOver]
    assert answers == ["retry"]
    (message,) = OutboxMessage.objects.all()
    assert message.args == ["retry"]
    assert OutboxUniqueKey.objects.get().message_id == message.pk
    assert IdempotencyRecord.objects.get().status == "completed"
