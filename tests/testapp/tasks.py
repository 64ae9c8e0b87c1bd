"""Celery tasks that the worker tests run: a deduplicated body whose runs are counted.

Counters are ``ProviderCall`` rows with distinctive keys:

- ``effect:<tag>`` is written on the default connection inside the task's transaction, so
  it exists once per run that *completed* (committed with the idempotency record);
- ``start:<tag>:<pid>`` is written through the ``provider`` connection (autocommit), so it
  survives a crash: one per run that *started*.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

from celery import Task, shared_task

from django_idempotency.tasks import idempotent_task
from tests.testapp.effects import count_effect
from tests.testapp.models import ProviderCall

LEASE_SECONDS = 3
# Longer than a killed run takes to be redelivered, so the redelivery meets a live lease.
LONG_LEASE_SECONDS = 10
# Longer than a duplicate delivered at the same time takes to reach a run's claim, so that it
# meets the live lease; and shorter than the broker's visibility timeout (tests/celery_app.py),
# which the countdown of its retry after the lease must stay under: past it Redis hands the
# retried message out once more while the worker holds it for its countdown, and the test
# waits for that delivery too.
MEDIUM_LEASE_SECONDS = 6


def _body(tag: str, hold: float) -> dict[str, Any]:
    starts = ProviderCall.objects.using("provider").filter(key__startswith=f"start:{tag}:")
    first = not starts.exists()
    ProviderCall.objects.using("provider").create(key=f"start:{tag}:{os.getpid()}")
    ProviderCall.objects.create(key=f"effect:{tag}")
    if first and hold:
        # Only the first run lingers: the tests kill its worker meanwhile, or send a
        # duplicate that must find the lease held.
        time.sleep(hold)
    return {"tag": tag, "pid": os.getpid()}


@shared_task(name="tests.record_effect", acks_late=True, reject_on_worker_lost=True)
@idempotent_task(lease=LEASE_SECONDS)
def record_effect(tag: str, hold: float = 0.0) -> dict[str, Any]:
    """Deduplicated by the task id."""
    return _body(tag, hold)


@shared_task(name="tests.record_effect_long_lease", acks_late=True, reject_on_worker_lost=True)
@idempotent_task(lease=LONG_LEASE_SECONDS)
def record_effect_long_lease(tag: str, hold: float = 0.0) -> dict[str, Any]:
    """Deduplicated by the task id, with a lease that outlives a quick redelivery."""
    return _body(tag, hold)


@shared_task(name="tests.record_effect_medium_lease", acks_late=True, reject_on_worker_lost=True)
@idempotent_task(lease=MEDIUM_LEASE_SECONDS)
def record_effect_medium_lease(tag: str, hold: float = 0.0) -> dict[str, Any]:
    """Deduplicated by the task id, with a lease that a duplicate delivered at the same time
    meets live, and that its retry waits out within the broker's visibility timeout."""
    return _body(tag, hold)


@shared_task(name="tests.record_effect_fail", acks_late=True, reject_on_worker_lost=True)
@idempotent_task(lease=LEASE_SECONDS, recovery="fail")
def record_effect_fail(tag: str, hold: float = 0.0) -> dict[str, Any]:
    """Deduplicated by the task id; a run that stopped midway is never run again."""
    return _body(tag, hold)


@shared_task(name="tests.record_effect_by_tag", acks_late=True, reject_on_worker_lost=True)
@idempotent_task(key=lambda tag, hold=0.0: f"tag:{tag}", lease=LEASE_SECONDS)
def record_effect_by_tag(tag: str, hold: float = 0.0) -> dict[str, Any]:
    """Deduplicated by the tag, whatever the task id."""
    return _body(tag, hold)


@shared_task(name="tests.fail_once")
@idempotent_task()
def fail_once(tag: str) -> str:
    """Raises on its first run (after writing its effect, which is rolled back)."""
    first = not ProviderCall.objects.using("provider").filter(key=f"failed:{tag}").exists()
    if first:
        ProviderCall.objects.using("provider").create(key=f"failed:{tag}")
    ProviderCall.objects.create(key=f"effect:{tag}")
    if first:
        raise RuntimeError("first run fails")
    return "ok"


# -- one live task per key (tests/test_unique_tasks_servers.py) ---------------------------------

#: Far longer than a held run (2 s), so that a live run holds its key for all of it: a run
#: that outlives its lease frees its key (the lease decides), and a loaded machine (CI's
#: parallel suites) once stretched a 2-s run past 5 s.
UNIQUE_LEASE_SECONDS = 30
#: Shorter than the run a test kills, so that the dead run's key frees soon.
KILLED_LEASE_SECONDS = 2


def held(tag: str, hold: float) -> dict[str, Any]:
    """Every run lingers ``hold`` seconds after it started, then commits its effect."""
    ProviderCall.objects.using("provider").create(key=f"start:{tag}:{os.getpid()}")
    time.sleep(hold)
    ProviderCall.objects.create(key=f"effect:{tag}")
    return {"tag": tag}


@shared_task(name="tests.hold_unique")
@idempotent_task(lease=UNIQUE_LEASE_SECONDS)
def hold_unique(tag: str, hold: float) -> dict[str, Any]:
    """Runs ``hold`` seconds, every time; its record tells enqueue_once when it ran."""
    return held(tag, hold)


@shared_task(name="tests.hold_unique_short_lease")
@idempotent_task(lease=KILLED_LEASE_SECONDS)
def hold_unique_short_lease(tag: str, hold: float) -> dict[str, Any]:
    """As ``hold_unique``, with a lease shorter than a run that is killed."""
    return held(tag, hold)


def held_and_timed(tag: str, hold: float, run_id: str) -> dict[str, Any]:
    """``held``, with ``run:<tag>:<run id>:start:<time>`` and ``...:end:<time>`` around it
    (through the ``provider`` connection): a task with no record of its runs tells when
    each ran (tests/unique_servers.py reads them)."""
    marks = ProviderCall.objects.using("provider")
    marks.create(key=f"run:{tag}:{run_id}:start:{time.time():.6f}")
    result = held(tag, hold)
    marks.create(key=f"run:{tag}:{run_id}:end:{time.time():.6f}")
    return result


@shared_task(name="tests.hold_plain", bind=True)
def hold_plain(self: Task[Any, Any], tag: str, hold: float) -> dict[str, Any]:
    """As ``hold_unique``, not under ``@idempotent_task()``: its worker reports its run on
    its enqueue_once key."""
    return held_and_timed(tag, hold, str(self.request.id))


#: The hard time limit of ``hold_plain_time_limited``: its reported run holds its key
#: this long (and a second) at most.
PLAIN_TIME_LIMIT_SECONDS = 6


@shared_task(name="tests.hold_plain_time_limited", bind=True, time_limit=PLAIN_TIME_LIMIT_SECONDS)
def hold_plain_time_limited(self: Task[Any, Any], tag: str, hold: float) -> dict[str, Any]:
    """As ``hold_plain``, with a hard time limit: the lease of its reported run."""
    return held_and_timed(tag, hold, str(self.request.id))


@shared_task(name="tests.count_plain")
def count_plain(tag: str, fail: bool = False) -> str:
    """Not under ``@idempotent_task()``: one ``effect:<tag>`` per run, on the default
    connection; raises after it with ``fail``."""
    return count_effect(tag, fail)


#: The hard time limit of ``gated_plain_time_limited``: a pool that enforces none (threads,
#: solo) lets its run go on past it.
GATED_TIME_LIMIT_SECONDS = 2


def gated(task: Task[Any, Any], tag: str, first: str) -> str:
    """Each run counts its start (``start:<tag>:<place>``, through the ``provider``
    connection); the first one then does what ``first`` says, every other (and the first
    with ``"wait"``) waits for ``gate:<tag>`` (30 s at most) and writes its effect
    (tests/test_unique_tasks_reported_workers.py):

    - ``"reject"``: raises ``Reject(requeue=True)``; ``"retry"``: ``self.retry()``;
      ``"retry-no-throw"``: ``self.retry(throw=False)``, then returns;
      ``"ignore"``: raises ``Ignore``; ``"outlive-sigterm"``: notes a SIGTERM and goes on;
      ``"fail"``: raises ``RuntimeError``;
      ``"retry-unpublishable"``, ``"replace-unpublishable"``: a retry, or a replacement,
      whose arguments cannot be serialized (its publish fails);
      ``"replace-then-retry-no-throw"``: replaces itself by a run that then retries with
      ``throw=False`` and returns;
    - ``"replace"``: replaces itself by another run of the task; ``"replace-by-chain"``: by
      a chain that ends with one.
    """
    from celery.exceptions import Ignore, Reject
    from django.db import connection

    # SQLite's test database is one in-memory connection: the default one (an eager run).
    marks = ProviderCall.objects.using("default" if connection.vendor == "sqlite" else "provider")
    place = marks.filter(key__startswith=f"start:{tag}:").count()
    marks.create(key=f"start:{tag}:{place}")
    if place == 0 and first == "reject":
        raise Reject("first delivery", requeue=True)
    if place == 0 and first == "retry":
        raise task.retry(countdown=0, max_retries=1)
    if place == 0 and first == "retry-no-throw":
        # The retry is published, and the run returns: it ends in SUCCESS.
        task.retry(countdown=0, max_retries=1, throw=False)
        return "retried"
    if place == 0 and first == "ignore":
        raise Ignore()
    if place == 0 and first == "fail":
        raise RuntimeError("first run")
    if place == 0 and first == "retry-unpublishable":
        # The retry's arguments cannot be serialized: its publish fails, and Celery rejects
        # the run (Reject(requeue=False)): the message never runs again.
        task.retry(args=(tag, object()), countdown=0, max_retries=1, throw=False)
    if place == 0 and first == "replace-unpublishable":
        return task.replace(task.si(tag, object()))  # its publish fails: the run fails
    if place == 0 and first == "replace-then-retry-no-throw":
        return task.replace(task.si(tag, "retry-no-throw-when-replaced"))
    if place == 1 and first == "retry-no-throw-when-replaced":
        task.retry(countdown=0, max_retries=1, throw=False)  # a replacement retries
        return "retried"
    signalled: list[int] = []
    restore: Any = None
    if place == 0 and first == "outlive-sigterm":
        # A run that finishes its work when told to stop (revoke(terminate=True)); noted
        # by the wait below, not in the handler, which may interrupt a query.
        import signal

        previous = signal.signal(signal.SIGTERM, lambda signum, _: signalled.append(signum))
        restore = functools.partial(signal.signal, signal.SIGTERM, previous)
    if place == 0 and first == "replace":
        return task.replace(task.si(tag, "wait"))
    if place == 0 and first == "replace-by-chain":
        from celery import chain

        # The chain's first task runs under a task id of its own, its last under this one.
        replacement = chain(record_plain_mark.si(f"chained:{tag}"), task.si(tag, "wait"))
        return task.replace(replacement)
    deadline = time.monotonic() + 30
    while not marks.filter(key=f"gate:{tag}").exists() and time.monotonic() < deadline:
        if signalled and signalled.pop():
            marks.create(key=f"sigterm:{tag}")
        time.sleep(0.05)
    if restore is not None:
        restore()  # the pool's process is told to stop as before by its next revoke
    ProviderCall.objects.create(key=f"effect:{tag}")
    return tag


@shared_task(name="tests.record_plain_mark")
def record_plain_mark(key: str) -> str:
    """Writes ``key`` (through the ``provider`` connection), not under
    ``@idempotent_task()``."""
    ProviderCall.objects.using("provider").create(key=key)
    return key


@shared_task(name="tests.gated_plain", bind=True, acks_late=True)
def gated_plain(self: Task[Any, Any], tag: str, first: str = "wait") -> str:
    """Not under ``@idempotent_task()``: its run is reported on its enqueue_once key."""
    return gated(self, tag, first)


@shared_task(name="tests.gated_plain_time_limited", bind=True, time_limit=GATED_TIME_LIMIT_SECONDS)
def gated_plain_time_limited(self: Task[Any, Any], tag: str, first: str = "wait") -> str:
    """As ``gated_plain``, with a hard time limit."""
    return gated(self, tag, first)


class RetriedOnFailure(Task):  # type: ignore[misc]
    """A task whose ``on_failure`` retries its first run (``throw=False``)."""

    def on_failure(self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        if not self.request.retries:
            self.retry(countdown=0, max_retries=1, throw=False)


@shared_task(
    name="tests.gated_plain_retried_on_failure", bind=True, base=RetriedOnFailure, acks_late=True
)
def gated_plain_retried_on_failure(self: Task[Any, Any], tag: str, first: str = "wait") -> str:
    """As ``gated_plain``; a failed first run is retried by ``on_failure``."""
    return gated(self, tag, first)


#: A lease that the first run outlives (tests/test_unique_tasks_lease.py).
OUTLIVED_LEASE_SECONDS = 2
#: One gate per run of ``outlives_its_lease``, in the order the runs start: each run waits
#: for the test to open its gate.
OUTLIVED_GATES: list[threading.Event] = []


@shared_task(name="tests.outlives_its_lease")
@idempotent_task(lease=OUTLIVED_LEASE_SECONDS)
def outlives_its_lease(tag: str) -> str:
    """Each run counts its start, waits for its gate, and writes its effect; the first run
    then raises (its effect rolled back), every later one returns."""
    place = ProviderCall.objects.using("provider").filter(key__startswith=f"start:{tag}:").count()
    ProviderCall.objects.using("provider").create(key=f"start:{tag}:{place}")
    OUTLIVED_GATES[place].wait(timeout=30)
    ProviderCall.objects.create(key=f"effect:{tag}")
    if place == 0:
        raise RuntimeError("the first run fails, long after its lease ran out")
    return "ok"


@shared_task(name="tests.enqueues_a_follow_up")
@idempotent_task()
def enqueues_a_follow_up(tag: str) -> str:
    """Writes its effect, then enqueues a follow-up under the key ``follow-up``, which
    raises ``TaskAlreadyQueued`` (an ``IdempotencyError``) while another one is live: the
    run fails (tests/test_unique_tasks.py)."""
    from django_idempotency.outbox import enqueue_once

    ProviderCall.objects.create(key=f"effect:{tag}")
    enqueue_once(
        "follow-up", "tests.follow_up", unique_until=timedelta(hours=1), on_conflict="raise"
    )
    return "ok"


@shared_task(name="tests.calls_a_closed_operation")
@idempotent_task()
def calls_a_closed_operation(tag: str) -> str:
    """Writes its effect, then calls an operation under ``run_once`` whose record was
    closed as failed: ``OutcomeUnknown`` from the body fails the run
    (tests/test_unique_tasks.py)."""
    from django_idempotency import run_once

    ProviderCall.objects.create(key=f"effect:{tag}")
    return run_once(str, tag, account="consumer:tests", operation="closed", key=tag)


@shared_task(name="tests.refused_by_the_database")
@idempotent_task()
def refused_by_the_database(tag: str) -> str:
    """Writes its effect, then has its transaction refused by the server as a deadlock
    (PostgreSQL's SQLSTATE 40P01, MariaDB's error 1213): the engine answers
    ``StoreUnavailable``, and the run ended with an error (tests/test_unique_tasks.py)."""
    from django.db import connection

    ProviderCall.objects.create(key=f"effect:{tag}")
    with connection.cursor() as cursor:
        cursor.execute(
            "SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'refused'"
            if connection.vendor == "mysql"
            else "DO $$ BEGIN RAISE EXCEPTION 'refused' USING ERRCODE = '40P01'; END $$"
        )
    return "ok"


@shared_task(name="tests.large_result")
@idempotent_task()
def large_result(size: int) -> str:
    """Writes its effect and returns ``size`` characters (tests/test_outcome_size.py)."""
    ProviderCall.objects.create(key="effect:large")
    return "x" * size


@shared_task(name="tests.register_user")
def register_user(username: str) -> None:
    """Not deduplicated: it creates a user, and a username taken already fails its INSERT
    (tests/test_outbox_batches.py, eagerly: inside the relay's batch)."""
    from django.contrib.auth.models import User

    User.objects.create(username=username)


# -- functions under @idempotent_task() called inside a Celery task (test_task_deliveries.py) --


@idempotent_task(key=lambda tag: f"item:{tag}")
def ship_item(tag: str) -> str:
    """Not a task: a function under ``@idempotent_task(key=...)`` the tasks below call."""
    ProviderCall.objects.create(key=f"effect:ship:{tag}")
    return f"shipped {tag}"


@idempotent_task(key=lambda tag: f"item:{tag}")
def bill_item(tag: str) -> str:
    """Another function with the same key: another operation, which must run on its own."""
    ProviderCall.objects.create(key=f"effect:bill:{tag}")
    return f"billed {tag}"


@shared_task(name="tests.ship_and_bill")
def ship_and_bill(tag: str) -> list[str]:
    """Not deduplicated itself: ships and bills one item."""
    return [ship_item(tag), bill_item(tag)]


@shared_task(name="tests.ship_and_bill_once")
@idempotent_task()
def ship_and_bill_once(tag: str) -> list[str]:
    """Deduplicated by its task id, and calls the two keyed functions."""
    ProviderCall.objects.create(key=f"effect:outer:{tag}")
    return [ship_item(tag), bill_item(tag)]


def logged(func: Any) -> Any:
    """A project's own decorator between the task's and ours, made with functools.wraps."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


@shared_task(name="tests.bound_retry", bind=True)
@idempotent_task()
def bound_retry(self: Any, tag: str) -> int:
    """``bind=True``: retries itself once; the effect of the retried run commits."""
    ProviderCall.objects.create(key=f"effect:{tag}:{self.request.retries}")
    if self.request.retries == 0:
        raise self.retry(countdown=0, max_retries=1)
    retries: int = self.request.retries
    return retries


@shared_task(name="tests.wrapped_twice")
@logged
@idempotent_task()
def wrapped_twice(tag: str) -> str:
    """Another decorator between ``@shared_task`` and ``@idempotent_task()``."""
    ProviderCall.objects.create(key=f"effect:{tag}")
    return tag


def unwrapped(func: Any) -> Any:
    """A project's own decorator between the task's and ours, made without functools.wraps:
    only its closure holds the function it calls."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return call


@shared_task(name="tests.wrapped_bare")
@unwrapped
@idempotent_task()
def wrapped_bare(tag: str) -> str:
    """A decorator without functools.wraps between ``@shared_task`` and ours."""
    ProviderCall.objects.create(key=f"effect:{tag}")
    return tag


class ClassBased(Task):  # type: ignore[misc]
    """A class-based task whose ``run`` is under ``@idempotent_task()``."""

    name = "tests.class_based"

    @idempotent_task()
    def run(self, tag: str) -> str:
        ProviderCall.objects.create(key=f"effect:{tag}")
        return tag


@shared_task(
    name="tests.autoretried",
    autoretry_for=(RuntimeError,),
    retry_kwargs={"countdown": 0, "max_retries": 2},
)
@idempotent_task()
def autoretried(key: str, tag: str) -> str:
    """Fails its first run, which Celery's ``autoretry_for`` retries. The retried run asks
    ``enqueue_once`` for its own key (as a beat would while it runs) and returns the id."""
    from django_idempotency import outbox

    if not ProviderCall.objects.using("provider").filter(key=f"failed:{tag}").exists():
        ProviderCall.objects.using("provider").create(key=f"failed:{tag}")
        raise RuntimeError("first run fails")
    ProviderCall.objects.create(key=f"effect:{tag}")
    return str(outbox.enqueue_once(key, autoretried, key, tag))


@shared_task(name="tests.rejected_once", acks_late=True)
@idempotent_task()
def rejected_once(key: str, tag: str) -> str:
    """Its first run puts its message back (``Reject(requeue=True)``, with ``acks_late``),
    so the worker runs it again. The next run asks ``enqueue_once`` for its own key (as a
    beat would meanwhile) and returns the id."""
    from celery.exceptions import Reject

    from django_idempotency import outbox

    if not ProviderCall.objects.using("provider").filter(key=f"failed:{tag}").exists():
        ProviderCall.objects.using("provider").create(key=f"failed:{tag}")
        raise Reject("not now", requeue=True)
    ProviderCall.objects.create(key=f"effect:{tag}")
    return str(outbox.enqueue_once(key, rejected_once, key, tag))


@shared_task(
    name="tests.autoretried_in_vain",
    autoretry_for=(RuntimeError,),
    retry_kwargs={"countdown": 0, "max_retries": 2},
)
@idempotent_task()
def autoretried_in_vain(tag: str) -> None:
    """Fails every run: Celery's ``autoretry_for`` retries it twice, then it has failed."""
    ProviderCall.objects.using("provider").create(key=f"start:{tag}:{uuid.uuid4()}")
    raise RuntimeError("every run fails")


# -- Celery's canvas: a link callback (tests/test_task_deliveries.py) ---------------------------


@shared_task(name="tests.linked_parent")
@idempotent_task()
def linked_parent(tag: str) -> str:
    """Deduplicated by its task id; the tests send it with ``link=linked_callback.s(...)``."""
    ProviderCall.objects.create(key=f"effect:parent:{tag}")
    return tag


@shared_task(name="tests.linked_callback")
@idempotent_task()
def linked_callback(value: str, tag: str) -> str:
    """Deduplicated by its task id: Celery calls it with the parent's return value."""
    ProviderCall.objects.create(key=f"effect:callback:{tag}")
    return f"{value}+{tag}"


@shared_task(name="tests.paged", bind=True)
@idempotent_task()
def paged(self: Any, tag: str, page: int, last: int) -> int:
    """Imports one page, then replaces itself with the next (``self.replace``), as a
    paginated import does; the last page returns its number."""
    ProviderCall.objects.create(key=f"effect:{tag}:{page}")
    if page < last:
        return self.replace(paged.s(tag, page + 1, last))
    return page


@shared_task(name="tests.tree")
@idempotent_task(lease=LEASE_SECONDS)
def tree(tag: str, depth: int) -> int:
    """Walks a tree by calling itself directly (``tree(...)``: plain calls inside its own
    run), one level a call."""
    ProviderCall.objects.create(key=f"effect:{tag}:{depth}")
    if depth:
        tree(tag, depth - 1)
    return depth


@shared_task(name="tests.keyed_by_payload")
@idempotent_task(key=lambda payload: payload.get("id"))
def keyed_by_payload(payload: dict[str, Any]) -> str:
    """Keyed by the payload's ``id``; a payload may come without one."""
    ProviderCall.objects.create(key=f"effect:{payload['tag']}")
    return str(payload["tag"])
