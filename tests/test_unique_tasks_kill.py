"""One live task per key: a worker SIGKILLed mid-task frees its key when its run's lease ran
out, and the next enqueue runs. Each test starts its own worker and relay (the worker is
killed); tests/test_unique_tasks_servers.py has the rest.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_idempotency import _unique
from django_idempotency.models import (
    IdempotencyRecord,
    OutboxMessage,
    OutboxStatus,
    OutboxUniqueKey,
)
from tests.helpers import node_name, postgres_only, stop_process, wait_until
from tests.testapp.models import ProviderCall

pytest.importorskip("celery", reason="Celery is an optional dependency")

from tests.unique_servers import Framework, effects, enqueue_once, framework_named, starts

pytestmark = [
    pytest.mark.servers,
    pytest.mark.django_db(transaction=True, databases="__all__"),
    postgres_only,
]

TIMEOUT = 30  # seconds: a bound on every wait for a process


def _key_freed(awaited: str) -> None:
    """Wait for the one key to be free (``awaited``: what frees it)."""
    wait_until(
        lambda: not _unique.holds("default", OutboxUniqueKey.objects.get(), timezone.now()),
        awaited,
        timeout=TIMEOUT,
    )


def _recorded_run_is_live(framework: Framework, task: Any, first: uuid.UUID) -> None:
    account, operation, key = _unique.record_identity(framework.task_name(task), first)
    record = IdempotencyRecord.objects.get(account=account, operation=operation, key=key)
    assert record.status == "in_progress"


def _reported_run_is_live(framework: Framework, task: Any, first: uuid.UUID) -> None:
    row = OutboxUniqueKey.objects.get()
    assert row.started_at is not None
    assert row.finished_at is None
    if framework.name == "celery":
        from tests.testapp.tasks import PLAIN_TIME_LIMIT_SECONDS

        # The task's hard time limit, and a second: no run outlives it.
        lease = timedelta(seconds=PLAIN_TIME_LIMIT_SECONDS + 1)
    else:
        lease = timedelta(seconds=WORKER_LEASE_SECONDS)  # the worker's LEASE setting
    assert row.lease_expires_at == row.started_at + lease


#: The ``LEASE`` setting of a ``db_worker`` whose reported run is killed: a Django task's
#: reported run holds its key that long after it started.
WORKER_LEASE_SECONDS = 2


def _killable(framework: Framework, reported: bool) -> tuple[Any, Callable[[], Any]]:
    """The task a test kills the worker of, and that worker."""
    if not reported:
        return framework.killed_task, framework.worker
    if framework.name == "celery":
        from tests.testapp.tasks import hold_plain_time_limited

        return hold_plain_time_limited, framework.worker
    from tests.test_tasks_worker import db_worker

    return framework.plain_task, lambda: db_worker(
        f"killed-{uuid.uuid4().hex[:6]}", idempotency=f"{{'LEASE': {WORKER_LEASE_SECONDS}}}"
    )


@pytest.mark.usefixtures("run_queue")
@pytest.mark.parametrize(
    ("name", "reported"),
    [("celery", False), ("tasks", False), ("celery", True), ("tasks", True)],
    ids=["celery", "tasks", "celery-reported", "tasks-reported"],
)
def test_a_worker_killed_mid_task_frees_the_key_after_its_lease(name: str, reported: bool):
    """Under ``@idempotent_task()`` the run's record holds the key for its lease; a task
    not under it (``reported``) has its run reported on the key, held for the task's hard
    time limit (Celery's prefork pool), or the worker's ``LEASE`` setting (``db_worker``)."""
    framework = framework_named(name)
    task, start_worker = _killable(framework, reported)
    tag = f"killed-{framework.name}{'-reported' if reported else ''}"
    live = _reported_run_is_live if reported else _recorded_run_is_live
    with ExitStack() as stack:
        stack.callback(stop_process, framework.relay())
        worker = stack.enter_context(start_worker())
        first = enqueue_once("k", task, tag, 60)
        wait_until(
            lambda: ProviderCall.objects.filter(key__startswith=f"start:{tag}:").exists(),
            "the run to start",
            timeout=TIMEOUT,
        )
        stop_process(worker, signal.SIGKILL)
        # The dead run's lease still runs: the key is held.
        assert enqueue_once("k", task, tag, 0.1) == first
        live(framework, task, first)
        _key_freed("the dead run's lease to run out")
        second = enqueue_once("k", task, tag, 0.1)
        assert second != first
        stack.enter_context(start_worker())
        wait_until(lambda: effects(tag) == 1, "the next run", timeout=TIMEOUT)
    assert effects(tag) == 1  # the killed run wrote no effect
    assert OutboxUniqueKey.objects.get().message_id == second


@pytest.mark.usefixtures("run_queue")
@pytest.mark.parametrize("reported", [False, True], ids=["recorded", "reported"])
def test_a_message_sent_again_after_its_worker_died_holds_its_key_until_its_run_ended(
    reported: bool,
):
    """django-tasks-db never redelivers a task whose worker died: the message is made
    pending again (the admin's requeue, or an ``UPDATE``), and the relay hands it over
    anew. That delivery waits for a worker, then runs: the key is held all along, though
    the dead run's lease ran out long before; an enqueue meanwhile writes no second
    message to run beside it."""
    framework = framework_named("tasks")
    task, start_worker = _killable(framework, reported)
    tag = f"sent-again-{'reported' if reported else 'recorded'}"
    hold = 4.0  # each run; the first is killed well within it
    with ExitStack() as stack:
        stack.callback(stop_process, framework.relay())
        with start_worker() as worker:
            first = enqueue_once("k", task, tag, hold)
            wait_until(lambda: starts(tag) == 1, "the run to start", timeout=TIMEOUT)
            stop_process(worker, signal.SIGKILL)
        _key_freed("the dead run's lease to run out")
        OutboxMessage.objects.filter(pk=first).update(
            status=OutboxStatus.PENDING, available_at=timezone.now()
        )
        wait_until(
            lambda: OutboxMessage.objects.get(pk=first).status == OutboxStatus.SENT,
            "the relay to send the message again",
            timeout=TIMEOUT,
        )
        # Handed over again, waiting for a worker.
        assert enqueue_once("k", task, tag, hold) == first
        stack.enter_context(start_worker())
        wait_until(lambda: starts(tag) == 2, "the run of the message sent again", timeout=TIMEOUT)
        assert enqueue_once("k", task, tag, hold) == first  # running
        wait_until(lambda: effects(tag) == 1, "that run's end", timeout=TIMEOUT)
        _key_freed("the key to be free once the run ended")
        second = enqueue_once("k", task, tag, 0.1)
        assert second != first
        wait_until(lambda: effects(tag) == 2, "the next message's run", timeout=TIMEOUT)
    assert OutboxMessage.objects.count() == 2
    assert (starts(tag), effects(tag)) == (3, 2)


@pytest.mark.usefixtures("run_queue")
def test_a_message_revoked_before_its_run_frees_the_key_when_the_worker_discards_it():
    """Celery's revoke is a terminal state: the worker discards the message without running
    it, and the key is free at once (not a whole TTL later)."""
    from tests import celery_app

    framework = framework_named("celery")
    task, tag = framework.task, "revoked"
    with ExitStack() as stack:
        worker = stack.enter_context(framework.worker())
        first = enqueue_once("k", task, tag, 0.1)
        replies = celery_app.app.control.revoke(
            str(first), destination=[node_name(worker)], reply=True, timeout=5
        )
        assert replies, "the worker did not acknowledge the revoke"
        stack.callback(stop_process, framework.relay())
        _key_freed("the revoked message to free its key")
        assert worker.poll() is None
        assert ProviderCall.objects.filter(key__startswith=f"start:{tag}:").count() == 0
        second = enqueue_once("k", task, tag, 0.1)
        assert second != first
        wait_until(lambda: effects(tag) == 1, "the next run", timeout=TIMEOUT)
    assert effects(tag) == 1
    assert OutboxUniqueKey.objects.get().message_id == second
