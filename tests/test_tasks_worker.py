"""Django's Tasks framework through the outbox, with real processes killed for real.

Real ``manage.py db_worker`` processes (django-tasks-db) run what real relay processes
(``python -m tests.tasks_proc relay``: ``relay_outbox``, its hand-overs counted) deliver to
the database backend ``worker``. Every process has its own connections to the test database.
Effects are counted by the tasks of ``tests.testapp.tasks_framework``: ``start:`` rows survive
a killed worker, ``effect:`` rows commit with the run; ``handed:`` rows count hand-overs.

What redelivers after a worker died: not django-tasks-db. A worker killed inside a task
leaves its row ``RUNNING`` for good (no visibility timeout, no heartbeat; ``prune_db_task_results``
deletes finished rows only), and the relay had marked the message sent once the hand-over
committed. The message is handed over again once it is made pending again (the admin's
"requeue" for a dead one; here an ``UPDATE``): that second hand-over is the redelivery.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from django.conf import settings

if not settings.HAS_DJANGO_TASKS:  # tests/settings.py: django-tasks-db and a Tasks framework
    pytest.skip(
        "Django's Tasks framework (Django 6, or the django-tasks backport) with django-tasks-db "
        "is not installed",
        allow_module_level=True,
    )

from django.db import transaction
from django.utils import timezone
from django_tasks_db.models import DBTaskResult

from django_idempotency.models import IdempotencyRecord, OutboxMessage, OutboxStatus
from tests.helpers import postgres_only, stop_process, wait_until
from tests.live import ROOT, finished, server_env, starting_a_server
from tests.ready import release, wait_ready
from tests.testapp.models import ProviderCall
from tests.testapp.tasks_framework import (
    LEASE_SECONDS,
    TaskResultStatus,
    effects,
    record_async,
    record_effect,
    starts,
)

pytestmark = [
    pytest.mark.servers,
    pytest.mark.django_db(transaction=True, databases="__all__"),
    postgres_only,
]

TIMEOUT = 60  # seconds: a bound on every wait for a process


def hand_overs(tag: str) -> int:
    """How many times a relay handed the task with ``tag`` to the database backend."""
    return ProviderCall.objects.filter(key__startswith=f"handed:{tag}:").count()


@contextmanager
def db_worker(
    worker_id: str, ready: Path | None = None, idempotency: str | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``manage.py db_worker`` on the ``worker`` backend, every queue; stopped at the end.
    ``ready``: a file it writes when it first connects, about to look for its first task.
    ``idempotency``: its ``IDEMPOTENCY`` setting, a Python literal (tests/settings_from_env.py)."""
    starting_a_server("a db_worker")
    process = subprocess.Popen(
        [
            # django-admin's db_worker on the tests' settings (server_env): no manage.py
            # where the tests run from a copy (tox).
            *(sys.executable, "-m", "tests.tasks_proc", "db-worker", "--backend", "worker"),
            *("--queue-name", "*", "--interval", "0.05", "--no-startup-delay", "--no-reload"),
            *("--worker-id", worker_id, "-v", "0"),
        ],
        cwd=ROOT,
        env=server_env(
            {
                **({"TEST_READY_FILE": str(ready)} if ready else {}),
                **(
                    {
                        "DJANGO_SETTINGS_MODULE": "tests.settings_from_env",
                        "TEST_IDEMPOTENCY": idempotency,
                    }
                    if idempotency
                    else {}
                ),
            }
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        stop_process(process)


def relay_process(*arguments: str, **extra_env: str) -> subprocess.Popen[str]:
    starting_a_server("a relay process")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.tasks_proc", "relay", *arguments],
        cwd=ROOT,
        env=server_env(extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def summary(out: str) -> tuple[int, int, int]:
    found = re.search(
        r"Sent (\d+) outbox messages; (\d+) failed \(to be retried\), (\d+) dead", out
    )
    assert found, out
    sent, failed, dead = found.groups()
    return int(sent), int(failed), int(dead)


def relay_once(*arguments: str) -> tuple[int, int, int]:
    return summary(finished(relay_process("--once", *arguments), timeout=TIMEOUT))


def settled(seconds: float = 1.5) -> None:
    """Give the workers time to run anything they still might (for counts that must stay 0)."""
    time.sleep(seconds)


def enqueue_then_fail(tag: str) -> None:
    """Enqueue in a transaction that then rolls back."""
    with transaction.atomic():
        record_effect.enqueue(tag)
        raise ZeroDivisionError


def test_a_rolled_back_enqueue_runs_nothing_and_a_committed_one_runs_once():
    with pytest.raises(ZeroDivisionError):
        enqueue_then_fail("rolled-back")
    with transaction.atomic():
        record_effect.enqueue("committed")
    with db_worker("w-commit"):
        relay = relay_process()  # the long-running relay: LISTEN/NOTIFY, then polling
        try:
            wait_until(lambda: effects("committed") == 1, "the worker", timeout=TIMEOUT)
            settled()
        finally:
            relay.send_signal(signal.SIGTERM)
            out = finished(relay, timeout=TIMEOUT)
    assert summary(out) == (1, 0, 0)
    assert (hand_overs("committed"), starts("committed"), effects("committed")) == (1, 1, 1)
    assert (hand_overs("rolled-back"), starts("rolled-back"), effects("rolled-back")) == (0, 0, 0)
    assert OutboxMessage.objects.get().status == OutboxStatus.SENT
    assert DBTaskResult.objects.get().status == TaskResultStatus.SUCCESSFUL


def test_a_relay_killed_between_the_hand_over_and_marking_it_sent_runs_the_body_once():
    with transaction.atomic():
        result = record_effect.enqueue("relay-killed")
    with db_worker("w-relay-killed"):
        dying = relay_process("--once", TASKS_RELAY_DIE="1")
        dying.communicate(timeout=TIMEOUT)
        assert dying.returncode == -signal.SIGKILL
        message = OutboxMessage.objects.get(pk=result.id)
        assert (message.status, hand_overs("relay-killed")) == (OutboxStatus.PENDING, 1)
        # The database backend's row was written in the relay's batch transaction, which
        # died with it: the first hand-over never reached a worker (same database).
        settled()
        assert DBTaskResult.objects.count() == 0
        assert relay_once() == (1, 0, 0)
        wait_until(lambda: effects("relay-killed") == 1, "the worker", timeout=TIMEOUT)
        settled()
    assert hand_overs("relay-killed") == 2
    assert (starts("relay-killed"), effects("relay-killed")) == (1, 1)
    assert OutboxMessage.objects.get(pk=result.id).status == OutboxStatus.SENT


def enqueue_batch(prefix: str, count: int) -> list[str]:
    with transaction.atomic():
        return [record_effect.enqueue(f"{prefix}-{n}").id for n in range(count)]


def test_a_relay_killed_after_a_batch_insert_and_before_its_mark_hands_the_batch_over_again():
    tags = [f"batch-killed-{n}" for n in range(5)]
    ids = enqueue_batch("batch-killed", 5)
    with db_worker("w-batch-killed"):
        # Killed at the first task_enqueued: after the batch's one INSERT, before the mark.
        dying = relay_process("--once", "--batch-size", "10", TASKS_RELAY_DIE="1")
        dying.communicate(timeout=TIMEOUT)
        assert dying.returncode == -signal.SIGKILL
        assert set(OutboxMessage.objects.values_list("status", flat=True)) == {OutboxStatus.PENDING}
        assert [hand_overs(tag) for tag in tags] == [1, 0, 0, 0, 0]
        # The INSERT was in the relay's batch transaction: it died with it.
        settled()
        assert DBTaskResult.objects.count() == 0
        assert relay_once("--batch-size", "10") == (5, 0, 0)
        wait_until(lambda: sum(map(effects, tags)) == 5, "the worker", timeout=TIMEOUT)
        settled()
    assert [hand_overs(tag) for tag in tags] == [2, 1, 1, 1, 1]
    assert [(starts(tag), effects(tag)) for tag in tags] == [(1, 1)] * 5
    assert DBTaskResult.objects.count() == 5
    assert OutboxMessage.objects.filter(pk__in=ids, status=OutboxStatus.SENT).count() == 5


def test_a_batch_handed_over_for_good_by_a_relay_killed_before_its_mark_runs_each_body_once():
    tags = [f"batch-twice-{n}" for n in range(5)]
    ids = enqueue_batch("batch-twice", 5)
    with db_worker("w-batch-twice"):
        # The rows commit on a connection of their own, as into a backend on another
        # database, just before the batch commits: the relay dies between the two.
        dying = relay_process(
            "--once",
            "--batch-size",
            "10",
            TASKS_RELAY_DIE="after-commit",
            TASKS_RELAY_TARGET_DATABASE="provider",
        )
        dying.communicate(timeout=TIMEOUT)
        assert dying.returncode == -signal.SIGKILL
        assert DBTaskResult.objects.count() == 5
        assert OutboxMessage.objects.filter(status=OutboxStatus.PENDING).count() == 5
        assert relay_once("--batch-size", "10") == (5, 0, 0)
        wait_until(
            lambda: DBTaskResult.objects.filter(status=TaskResultStatus.SUCCESSFUL).count() == 10,
            "the worker to run both deliveries of every message",
            timeout=TIMEOUT,
        )
        settled()
    assert DBTaskResult.objects.count() == 10
    assert [effects(tag) for tag in tags] == [1] * 5
    assert all(1 <= starts(tag) <= 2 for tag in tags)
    assert IdempotencyRecord.objects.filter(account="task", key__in=ids).count() == 5
    assert OutboxMessage.objects.filter(pk__in=ids, status=OutboxStatus.SENT).count() == 5


def test_a_relay_killed_inside_its_hand_over_into_another_database_leaves_nothing_there():
    """The hand-over into another database commits only just before the batch: a relay
    killed inside it (at the first task_enqueued, after the INSERT) leaves no row there."""
    tags = [f"other-killed-{n}" for n in range(5)]
    ids = enqueue_batch("other-killed", 5)
    with db_worker("w-other-killed"):
        dying = relay_process(
            "--once",
            "--batch-size",
            "10",
            TASKS_RELAY_DIE="1",
            TASKS_RELAY_TARGET_DATABASE="provider",
        )
        dying.communicate(timeout=TIMEOUT)
        # Killed in its first task_enqueued (whose count, written through the same
        # connection as the rows, died with them): after the batch's INSERT.
        assert dying.returncode == -signal.SIGKILL
        settled()
        assert DBTaskResult.objects.count() == 0
        assert OutboxMessage.objects.filter(status=OutboxStatus.PENDING).count() == 5
        assert relay_once("--batch-size", "10") == (5, 0, 0)
        wait_until(lambda: sum(map(effects, tags)) == 5, "the worker", timeout=TIMEOUT)
        settled()
    assert DBTaskResult.objects.count() == 5
    assert [(starts(tag), effects(tag)) for tag in tags] == [(1, 1)] * 5
    assert OutboxMessage.objects.filter(pk__in=ids, status=OutboxStatus.SENT).count() == 5


def _killed_in_the_task(tag: str) -> str:
    """A message whose first run is killed (SIGKILL) inside the task, after its effect."""
    with transaction.atomic():
        result = record_effect.enqueue(tag, hold=30.0)
    with db_worker(f"w-{tag}-1") as doomed:
        assert relay_once() == (1, 0, 0)
        wait_until(lambda: starts(tag) == 1, "the first run to start", timeout=TIMEOUT)
        stop_process(doomed, signal.SIGKILL)
    # The run's effect died with its transaction; its row stays RUNNING: nothing in
    # django-tasks-db runs it again, and the message was marked sent.
    assert (starts(tag), effects(tag)) == (1, 0)
    (row,) = DBTaskResult.objects.all()
    assert row.status == TaskResultStatus.RUNNING
    assert OutboxMessage.objects.get(pk=result.id).status == OutboxStatus.SENT
    return result.id


def test_a_worker_killed_inside_the_task_runs_it_once_after_the_redelivery():
    message_id = _killed_in_the_task("worker-killed")
    time.sleep(LEASE_SECONDS + 0.5)  # the dead run's lease has run out
    OutboxMessage.objects.filter(pk=message_id).update(
        status=OutboxStatus.PENDING, available_at=timezone.now()
    )
    with db_worker("w-worker-killed-2"):
        assert relay_once() == (1, 0, 0)
        wait_until(lambda: effects("worker-killed") == 1, "the redelivery", timeout=TIMEOUT)
        settled()
    assert (starts("worker-killed"), effects("worker-killed")) == (2, 1)
    assert hand_overs("worker-killed") == 2
    record = IdempotencyRecord.objects.get(account="task", key=message_id)
    assert record.status == "completed"


def test_a_redelivery_that_meets_the_dead_runs_live_lease_is_not_lost():
    message_id = _killed_in_the_task("early-redelivery")
    # At once, within the dead run's lease: this delivery must not be dropped, or the
    # message's body never runs at all.
    OutboxMessage.objects.filter(pk=message_id).update(
        status=OutboxStatus.PENDING, available_at=timezone.now()
    )
    with db_worker("w-early-redelivery-2"):
        relay = relay_process("--batch-size", "10")
        try:
            wait_until(
                lambda: effects("early-redelivery") == 1,
                "the body to run once the dead run's lease is over",
                timeout=TIMEOUT,
            )
        finally:
            relay.send_signal(signal.SIGTERM)
            finished(relay, timeout=TIMEOUT)
    assert effects("early-redelivery") == 1


def test_an_async_task_handed_over_twice_to_two_real_workers_runs_its_body_once():
    """An ``async def`` task under ``@idempotent_task()``, run by ``manage.py db_worker``
    processes: both hand-overs of one message, taken by two workers at once, give one run."""
    with transaction.atomic():
        result = record_async.enqueue("async-real")
    assert relay_once() == (1, 0, 0)
    OutboxMessage.objects.filter(pk=result.id).update(
        status=OutboxStatus.PENDING, available_at=timezone.now()
    )
    assert relay_once() == (1, 0, 0)
    assert DBTaskResult.objects.count() == 2  # two deliveries of one message, both ready
    with db_worker("w-async-1"), db_worker("w-async-2"):
        wait_until(
            lambda: DBTaskResult.objects.filter(status=TaskResultStatus.SUCCESSFUL).count() == 2,
            "both deliveries to end",
            timeout=TIMEOUT,
        )
        settled()
    assert effects("async-real") == 1
    record = IdempotencyRecord.objects.get(account="task", key=result.id)
    assert record.status == "completed"


def test_four_hundred_messages_through_two_relays_and_two_workers_run_each_body_once(
    tmp_path: Path,
):
    # 20 batches of 20 for two relays started at the same instant, as in
    # tests/test_outbox_relay.py, and 400 runs the two workers race for (1,000 messages in
    # batches of 50 took 43 s of the suite under coverage, mostly the workers' runs).
    count = 400
    with transaction.atomic():
        ids = [record_effect.enqueue(f"bulk-{n}").id for n in range(count)]
    go = tmp_path / "go"
    with ExitStack() as stack:
        started = {
            tmp_path / name: stack.enter_context(db_worker(name, ready=tmp_path / name))
            for name in ("w-bulk-1", "w-bulk-2")
        }
        relays = [
            relay_process("--once", "--batch-size", "20", OUTBOX_GO_FILE=str(go)) for _ in range(2)
        ]
        # Both workers polling and both relays waiting for the go file (a loaded machine
        # starts a process in seconds): one that came late would leave its share to the
        # others, and the test would not run what it says.
        wait_ready(started, timeout=TIMEOUT)
        release(go, relays, timeout=TIMEOUT)
        figures = [summary(finished(relay, timeout=120)) for relay in relays]
        consumed = ProviderCall.objects.filter(key__startswith="effect:bulk-")
        wait_until(lambda: consumed.count() >= count, "the workers", timeout=180)
        settled()
    assert sum(sent for sent, _, _ in figures) == count
    assert all(sent > 0 for sent, _, _ in figures), figures
    assert not [f for f in figures if f[1] or f[2]], figures
    assert consumed.count() == consumed.values("key").distinct().count() == count
    assert ProviderCall.objects.filter(key__startswith="start:bulk-").count() == count
    assert ProviderCall.objects.filter(key__startswith="handed:bulk-").count() == count
    rows = DBTaskResult.objects.all()
    assert rows.count() == count
    assert set(rows.values_list("status", flat=True)) == {TaskResultStatus.SUCCESSFUL}
    workers = {worker for ids_ in rows.values_list("worker_ids", flat=True) for worker in ids_}
    assert workers == {"w-bulk-1", "w-bulk-2"}
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == count
    assert len(set(ids)) == count
