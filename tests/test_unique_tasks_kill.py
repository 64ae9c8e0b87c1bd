"""One live task per key: a worker SIGKILLed mid-task frees its key when its run's lease ran
out, and the next enqueue runs. Each test starts its own worker and relay (the worker is
killed); tests/test_unique_tasks_servers.py has the rest.
"""

from __future__ import annotations

import signal
import uuid
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_idempotency import _unique
from django_idempotency.models import IdempotencyRecord, OutboxUniqueKey
from tests.helpers import node_name, postgres_only, stop_process, wait_until
from tests.testapp.models import ProviderCall

pytest.importorskip("celery", reason="Celery is an optional dependency")

from tests.unique_servers import Framework, effects, enqueue_once, framework_named

pytestmark = [
    pytest.mark.servers,
    pytest.mark.django_db(transaction=True, databases="__all__"),
    postgres_only,
]

TIMEOUT = 30  # seconds: a bound on every wait for a process


def _recorded_run_is_live(framework: Framework, task: Any, first: uuid.UUID) -> None:
    account, operation, key = _unique.record_identity(framework.task_name(task), first)
    record = IdempotencyRecord.objects.get(account=account, operation=operation, key=key)
    assert record.status == "in_progress"


def _reported_run_is_live(framework: Framework, task: Any, first: uuid.UUID) -> None:
    from tests.testapp.tasks import PLAIN_TIME_LIMIT_SECONDS

    row = OutboxUniqueKey.objects.get()
    assert row.started_at is not None
    assert row.finished_at is None
    # The task's hard time limit, and a second: no run outlives it.
    assert row.lease_expires_at == row.started_at + timedelta(seconds=PLAIN_TIME_LIMIT_SECONDS + 1)


@pytest.mark.usefixtures("run_queue")
@pytest.mark.parametrize(
    ("name", "reported"),
    [("celery", False), ("tasks", False), ("celery", True)],
    ids=["celery", "tasks", "celery-reported"],
)
def test_a_worker_killed_mid_task_frees_the_key_after_its_lease(name: str, reported: bool):
    """Under ``@idempotent_task()`` the run's record holds the key for its lease; a task
    not under it (``reported``) has its run reported on the key, held for the task's hard
    time limit."""
    framework = framework_named(name)
    if reported:
        from tests.testapp.tasks import hold_plain_time_limited

        task, tag, live = hold_plain_time_limited, "killed-reported", _reported_run_is_live
    else:
        task, tag, live = framework.killed_task, f"killed-{framework.name}", _recorded_run_is_live
    with ExitStack() as stack:
        stack.callback(stop_process, framework.relay())
        worker = stack.enter_context(framework.worker())
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
        wait_until(
            lambda: not _unique.holds("default", OutboxUniqueKey.objects.get(), timezone.now()),
            "the dead run's lease to run out",
            timeout=TIMEOUT,
        )
        second = enqueue_once("k", task, tag, 0.1)
        assert second != first
        stack.enter_context(framework.worker())
        wait_until(lambda: effects(tag) == 1, "the next run", timeout=TIMEOUT)
    assert effects(tag) == 1  # the killed run wrote no effect
    assert OutboxUniqueKey.objects.get().message_id == second


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
        wait_until(
            lambda: not _unique.holds("default", OutboxUniqueKey.objects.get(), timezone.now()),
            "the revoked message to free its key",
            timeout=TIMEOUT,
        )
        assert worker.poll() is None
        assert ProviderCall.objects.filter(key__startswith=f"start:{tag}:").count() == 0
        second = enqueue_once("k", task, tag, 0.1)
        assert second != first
        wait_until(lambda: effects(tag) == 1, "the next run", timeout=TIMEOUT)
    assert effects(tag) == 1
    assert OutboxUniqueKey.objects.get().message_id == second
