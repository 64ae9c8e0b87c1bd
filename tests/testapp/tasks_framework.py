"""Tasks of Django's Tasks framework for tests/test_tasks_backend.py and tests/test_tasks_worker.py.

``task`` is ``django.tasks.task`` on Django 6, the django-tasks backport's otherwise; the
default backend of tests/settings.py is the outbox, which hands them to the database backend
``worker``. Their runs are counted as ``ProviderCall`` rows, as the Celery tasks' are:

- ``effect:<tag>`` on the default connection, inside the body (under ``@idempotent_task()``
  it commits with the idempotency record): one per run that *completed*;
- ``start:<tag>:<pid>`` through the ``provider`` connection (autocommit), which survives a
  killed worker: one per run that *started*. On SQLite, whose test database is one
  in-memory connection, it is written on the default connection instead.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.db import connections

from django_idempotency.tasks import idempotent_task
from tests.testapp.effects import count_effect
from tests.testapp.models import ProviderCall

if TYPE_CHECKING or importlib.util.find_spec("django.tasks") is None:
    from django_tasks import TaskContext, TaskResultStatus, task
    from django_tasks.backends.dummy import DummyBackend
    from django_tasks.backends.immediate import ImmediateBackend
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist
else:  # Django 6
    from django.tasks import TaskContext, TaskResultStatus, task
    from django.tasks.backends.dummy import DummyBackend
    from django.tasks.backends.immediate import ImmediateBackend
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist

__all__ = [
    "LEASE_SECONDS",
    "BrokerLikeBackend",
    "InvalidTask",
    "NoFrillsBackend",
    "RefusingImmediateBackend",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "effects",
    "record_async",
    "record_effect",
    "record_plain",
    "record_with_context",
    "starts",
]


class NoFrillsBackend(DummyBackend):
    """A backend that cannot defer a task, order by priority or run a coroutine."""

    supports_defer = False
    supports_priority = False
    supports_async_task = False


class RefusingImmediateBackend(ImmediateBackend):
    """Runs a task inside its ``enqueue``, as ``ImmediateBackend`` does; then fails the
    enqueue of a task whose first argument begins with ``refused`` (a backend whose own
    write failed after the run)."""

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        result = super().enqueue(task, args, kwargs)
        if args and str(args[0]).startswith("refused"):
            raise RuntimeError("the backend refused the task after its run")
        return result


#: Per tag: set once a run of ``gated_plain`` started; the gate it then waits for (30 s
#: at most).
STARTED: dict[str, threading.Event] = {}
GATES: dict[str, threading.Event] = {}


def _event(events: dict[str, threading.Event], tag: str) -> threading.Event:
    return events.setdefault(tag, threading.Event())


class BrokerLikeBackend(ImmediateBackend):
    """Keeps its tasks outside any database, as a broker's backend does, and its worker
    takes each one up at once: the task runs in a thread of its own (with its own
    connection), and ``enqueue`` returns once a ``gated_plain`` run has started there.
    ``RUNS``: the threads, for the tests to join."""

    RUNS: list[threading.Thread] = []

    def _execute_task(self, task_result: Any) -> None:
        run = threading.Thread(target=self._work, args=(task_result,))
        run.start()
        self.RUNS.append(run)
        if task_result.args:
            _event(STARTED, str(task_result.args[0])).wait(30)

    def _work(self, task_result: Any) -> None:
        try:
            ImmediateBackend._execute_task(self, task_result)
        finally:
            connections.close_all()


# Short, so that a delivery after a killed worker takes the dead run's lease over soon.
LEASE_SECONDS = 2


def _counting_alias() -> str:
    return "default" if connections["default"].vendor == "sqlite" else "provider"


def starts(tag: str) -> int:
    """Runs of a body with ``tag`` that started (a killed worker's run included)."""
    return ProviderCall.objects.filter(key__startswith=f"start:{tag}:").count()


def effects(tag: str) -> int:
    """Runs of a body with ``tag`` that committed their effect."""
    return ProviderCall.objects.filter(key=f"effect:{tag}").count()


def _body(tag: str, hold: float) -> dict[str, Any]:
    first = (
        not ProviderCall.objects.using(_counting_alias())
        .filter(key__startswith=f"start:{tag}:")
        .exists()
    )
    ProviderCall.objects.using(_counting_alias()).create(key=f"start:{tag}:{os.getpid()}")
    ProviderCall.objects.create(key=f"effect:{tag}")
    if first and hold:
        # Only the first run lingers, after its effect: the tests kill its worker meanwhile.
        time.sleep(hold)
    return {"tag": tag, "pid": os.getpid()}


@task()
@idempotent_task(lease=LEASE_SECONDS)
def record_effect(tag: str, hold: float = 0.0) -> dict[str, Any]:
    """Runs its body once per outbox message, however often it is delivered."""
    return _body(tag, hold)


@task()
@idempotent_task(lease=LEASE_SECONDS)
async def record_async(tag: str) -> dict[str, Any]:
    """An ``async def`` task, deduplicated: its ORM calls come back to the engine's thread."""
    await sync_to_async(ProviderCall.objects.create)(key=f"effect:{tag}")
    return {"tag": tag}


@task()
def record_plain(tag: str) -> dict[str, Any]:
    """Not deduplicated: runs as often as it is delivered (at least once)."""
    return _body(tag, 0.0)


@task(takes_context=True)
@idempotent_task(lease=LEASE_SECONDS)
def record_with_context(context: TaskContext, tag: str) -> dict[str, Any]:
    """Deduplicated, and handed the task's context first, as ``takes_context`` asks."""
    result = _body(tag, 0.0)
    result["attempt"] = context.attempt
    return result


# -- one live task per key (tests/test_unique_tasks_servers.py) ---------------------------------

#: Far longer than a held run (2 s), so that a live run holds its key for all of it: a run
#: that outlives its lease frees its key (the lease decides), and a loaded machine (CI's
#: parallel suites) once stretched a 2-s run past 5 s.
UNIQUE_LEASE_SECONDS = 30
#: Shorter than the run a test kills, so that the dead run's key frees soon.
KILLED_LEASE_SECONDS = 2


def _held(tag: str, hold: float) -> dict[str, Any]:
    ProviderCall.objects.using(_counting_alias()).create(key=f"start:{tag}:{os.getpid()}")
    time.sleep(hold)
    ProviderCall.objects.create(key=f"effect:{tag}")
    return {"tag": tag}


@task()
@idempotent_task(lease=UNIQUE_LEASE_SECONDS)
def hold_unique(tag: str, hold: float) -> dict[str, Any]:
    """Runs ``hold`` seconds, every time; its record tells enqueue_once when it ran."""
    return _held(tag, hold)


@task()
@idempotent_task(lease=KILLED_LEASE_SECONDS)
def hold_unique_short_lease(tag: str, hold: float) -> dict[str, Any]:
    """As ``hold_unique``, with a lease shorter than a run that is killed."""
    return _held(tag, hold)


@task(takes_context=True)
def hold_plain(context: TaskContext, tag: str, hold: float) -> dict[str, Any]:
    """As ``hold_unique``, not under ``@idempotent_task()``: its worker reports its run on
    its enqueue_once key; ``run:<tag>:<result id>:start:<time>`` and ``...:end:<time>``
    tell when it ran."""
    marks = ProviderCall.objects.using(_counting_alias())
    run_id = context.task_result.id
    marks.create(key=f"run:{tag}:{run_id}:start:{time.time():.6f}")
    result = _held(tag, hold)
    marks.create(key=f"run:{tag}:{run_id}:end:{time.time():.6f}")
    return result


@task()
def count_plain(tag: str, fail: bool = False) -> str:
    """Not under ``@idempotent_task()``: one ``effect:<tag>`` per run, on the default
    connection; raises after it with ``fail``."""
    return count_effect(tag, fail)


@task()
async def count_plain_async(tag: str, fail: bool = False) -> str:
    """As ``count_plain``, an ``async def`` task."""
    return await sync_to_async(count_effect)(tag, fail)


@task(takes_context=True)
def count_plain_with_context(context: TaskContext, tag: str, fail: bool = False) -> str:
    """As ``count_plain``, given the run's context."""
    return count_effect(tag, fail)


# -- a task enqueued on the real backend, not through the outbox (tests/test_task_deliveries.py) --


@task(backend="worker")
@idempotent_task(lease=LEASE_SECONDS)
def record_direct(tag: str) -> dict[str, Any]:
    """Under ``@idempotent_task()``, declared on the database backend: no outbox message."""
    return _body(tag, 0.0)


@task()
@idempotent_task(lease=LEASE_SECONDS)
def record_called(tag: str) -> dict[str, Any]:
    """Deduplicated per message; the tests call its function from a Celery task."""
    ProviderCall.objects.create(key=f"effect:{tag}")
    return {"tag": tag}


@task()
def count_plain_nesting(tag: str, key: str) -> str:
    """As ``count_plain``, and first runs ``count_plain`` inside itself, on the
    ``immediate`` backend (Django's ``ImmediateBackend``, which runs a task inside its
    ``enqueue``); then writes ``held:<tag>`` if its own ``enqueue_once`` key ``key`` is
    still held by a run not ended, else ``freed:<tag>``."""
    from django_idempotency.models import OutboxUniqueKey

    count_plain.using(backend="immediate").enqueue(f"{tag}:inner")
    row = OutboxUniqueKey.objects.get(key=key)
    ended = row.started_at is None or row.finished_at is not None
    ProviderCall.objects.create(key=f"{'freed' if ended else 'held'}:{tag}")
    return count_effect(tag, False)


@task()
def gated_plain(tag: str) -> str:
    """Not under ``@idempotent_task()``: says it started (``STARTED``), waits for its gate
    (``GATES``), then counts its effect."""
    _event(STARTED, tag).set()
    _event(GATES, tag).wait(30)
    return count_effect(tag, False)
