"""Real processes for the tests of one live task per key (tests/test_unique_tasks_servers.py,
tests/test_unique_tasks_kill.py): a worker and a relay of each framework, and what reads
the runs back.

For each framework (Celery with the tests' Redis broker; Django's Tasks framework through
``OutboxBackend`` with django-tasks-db's ``db_worker``), a relay process runs
``relay_outbox`` and a worker runs what it hands over. Runs are read from the
``@idempotent_task`` records the workers write (one per message: when it started, when it
finished) and counted by the tasks' effects (``effect:<tag>`` rows commit with the run).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction

from django_idempotency import _unique, outbox
from django_idempotency.models import IdempotencyRecord, OutboxMessage
from tests.helpers import stop_process
from tests.live import ROOT, server_env, starting_a_server
from tests.testapp.models import ProviderCall

TIMEOUT = 30  # seconds: a bound on every wait for a process
RUN = 2.0  # seconds each run of the beat's task takes
BEAT = 0.1  # seconds between two enqueues of the beat
BEATING = 3.5  # seconds the beat goes on
# Clocks of two processes on one machine, and the database's: a little room.
SKEW = timedelta(milliseconds=50)


@dataclass
class Framework:
    """What a test needs of one task framework: its tasks, a worker and a relay."""

    name: str
    task: Any  # runs RUN seconds; lease longer than that
    killed_task: Any  # lease shorter than the run a test kills
    plain_task: Any  # as ``task``, not under @idempotent_task(): its run is reported
    worker: Callable[[], AbstractContextManager[subprocess.Popen[Any]]]
    relay: Callable[[], subprocess.Popen[str]]

    #: The module of its tasks, for a process that imports one by its dotted path.
    module: str = ""

    def task_name(self, task: Any) -> str:
        return outbox.target_of(task).name


def _celery() -> Framework:
    from tests import celery_app
    from tests.helpers import celery_worker
    from tests.testapp.tasks import hold_plain, hold_unique, hold_unique_short_lease

    def relay() -> subprocess.Popen[str]:
        starting_a_server("a relay process")
        return subprocess.Popen(
            [sys.executable, "-m", "tests.outbox_proc", "relay", "{}"],
            cwd=ROOT,
            env=server_env({"TEST_CELERY_QUEUE": celery_app.QUEUE}),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    return Framework(
        "celery",
        hold_unique,
        hold_unique_short_lease,
        hold_plain,
        lambda: celery_worker(concurrency=1),
        relay,
        "tests.testapp.tasks",
    )


def _tasks() -> Framework:
    from tests.test_tasks_worker import db_worker
    from tests.testapp.tasks_framework import hold_plain, hold_unique, hold_unique_short_lease

    def relay() -> subprocess.Popen[str]:
        starting_a_server("a relay process")
        return subprocess.Popen(
            [sys.executable, "-m", "tests.tasks_proc", "relay"],
            cwd=ROOT,
            env=server_env(None),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    return Framework(
        "tasks",
        hold_unique,
        hold_unique_short_lease,
        hold_plain,
        lambda: db_worker(f"unique-{uuid.uuid4().hex[:6]}"),
        relay,
        "tests.testapp.tasks_framework",
    )


FRAMEWORKS = ["celery", "tasks"]


def framework_named(name: str) -> Framework:
    """The framework ``name`` (skipped where it is not installed), its queue emptied."""
    if name == "tasks" and not settings.HAS_DJANGO_TASKS:
        pytest.skip("Django's Tasks framework with django-tasks-db is not installed")
    if name == "celery":
        from tests import celery_app
        from tests.helpers import broker

        broker().delete(celery_app.QUEUE)
        return _celery()
    return _tasks()


@contextmanager
def running(framework: Framework) -> Iterator[ExitStack]:
    """A worker and a relay, stopped at the end."""
    with ExitStack() as stack:
        stack.enter_context(framework.worker())
        relay = framework.relay()
        stack.callback(stop_process, relay)
        yield stack


def enqueue_once(key: str, task: Any, tag: str, hold: float, **options: Any) -> uuid.UUID:
    with transaction.atomic():
        return outbox.enqueue_once(key, task, tag, hold, **options)


def effects(tag: str) -> int:
    """Runs with ``tag`` that committed their effect."""
    return ProviderCall.objects.filter(key=f"effect:{tag}").count()


def starts(tag: str) -> int:
    """Runs with ``tag`` that started (a killed one's included)."""
    return ProviderCall.objects.filter(key__startswith=f"start:{tag}:").count()


@dataclass
class Run:
    enqueued: Any
    started: Any
    finished: Any


def runs(framework: Framework, task: Any, tag: str = "") -> list[Run]:
    """Every message of ``task`` with its run, in the order they were enqueued: from the
    run's ``@idempotent_task`` record, or for ``framework.plain_task`` from the times its
    run of ``tag`` wrote (``run:<tag>:<run id>:start:<time>``, ``...:end:<time>``)."""
    name = framework.task_name(task)
    found = []
    messages = OutboxMessage.objects.filter(task=name).order_by("created_at")
    if task is framework.plain_task:
        for message in messages:
            run_id = message.delivery.get("result_id") or str(message.pk)
            marks = dict(
                key.rsplit(":", 2)[1:]
                for key in ProviderCall.objects.filter(
                    key__startswith=f"run:{tag}:{run_id}:"
                ).values_list("key", flat=True)
            )
            assert "end" in marks, f"message {message.pk} never ran to its end"
            found.append(Run(message.created_at, *(_moment(marks[m]) for m in ("start", "end"))))
        return found
    for message in messages:
        account, operation, key = _unique.record_identity(name, message.pk)
        record = IdempotencyRecord.objects.filter(
            account=account, operation=operation, key=key
        ).first()
        assert record is not None, f"message {message.pk} never ran"
        found.append(Run(message.created_at, record.created_at, record.completed_at))
    return found


def _moment(seconds: str) -> datetime:
    return datetime.fromtimestamp(float(seconds), tz=dt_timezone.utc)
