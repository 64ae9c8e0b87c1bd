"""One live task per key for a Celery task not under ``@idempotent_task()``, with a real
worker: what Celery does to a run (a retry, a ``Reject`` that requeues the message, a
replacement) and a pool that enforces no time limit. The run is reported on the key
(``task_prerun``/``task_postrun``); the key holds until the message's last run ended.
Each test starts its own worker and relay; tests/test_unique_tasks_servers.py has the rest.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import pytest
from django.utils import timezone

from django_idempotency import _unique
from django_idempotency.models import OutboxMessage, OutboxUniqueKey
from tests.helpers import celery_worker, node_name, postgres_only, stop_process, wait_until
from tests.testapp.models import ProviderCall

pytest.importorskip("celery", reason="Celery is an optional dependency")

from tests.testapp.tasks import (
    GATED_TIME_LIMIT_SECONDS,
    gated_plain,
    gated_plain_retried_on_failure,
    gated_plain_time_limited,
)
from tests.unique_servers import SKEW, effects, enqueue_once, framework_named, starts

pytestmark = [
    pytest.mark.servers,
    pytest.mark.django_db(transaction=True, databases="__all__"),
    postgres_only,
    pytest.mark.usefixtures("run_queue"),
]

TIMEOUT = 30  # seconds: a bound on every wait for a process


@contextmanager
def worker_and_relay(pool: str = "prefork") -> Iterator[None]:
    from tests.helpers import celery_worker

    framework = framework_named("celery")
    with ExitStack() as stack:
        stack.enter_context(celery_worker(pool=pool, concurrency=1))
        stack.callback(stop_process, framework.relay())
        yield


def open_gate(tag: str) -> None:
    ProviderCall.objects.using("provider").create(key=f"gate:{tag}")


def held() -> bool:
    return _unique.holds("default", OutboxUniqueKey.objects.get(), timezone.now())


def a_later_message_runs(task: object, first: uuid.UUID) -> None:
    """Once the key is free, the next enqueue writes a message of its own, which runs."""
    wait_until(lambda: not held(), "the key to be free", timeout=TIMEOUT)
    later = f"later-{uuid.uuid4().hex[:6]}"
    open_gate(later)
    second = enqueue_once("k", task, later, "wait")
    assert second != first
    wait_until(lambda: effects(later) == 1, "the later message's run", timeout=TIMEOUT)
    assert OutboxUniqueKey.objects.get().message_id == second


def the_key_holds_until_the_run_ended(task: object, tag: str, first: uuid.UUID) -> None:
    """The run of ``first`` waits for its gate: its key holds; once it ended, a later
    message runs."""
    assert enqueue_once("k", task, tag, "wait") == first
    assert OutboxUniqueKey.objects.get().finished_at is None
    open_gate(tag)
    wait_until(lambda: effects(tag) == 1, "the run's end", timeout=TIMEOUT)
    a_later_message_runs(task, first)


@pytest.mark.parametrize(
    ("first_run", "runs"),
    [
        ("retry", 2),
        ("retry-no-throw", 2),
        ("reject", 2),
        ("replace", 2),
        ("replace-by-chain", 2),
        ("replace-then-retry-no-throw", 3),
    ],
)
def test_the_key_holds_until_the_messages_last_run_ended(first_run: str, runs: int):
    """The first run retries (``self.retry()``, or ``self.retry(throw=False)`` and returns,
    which Celery records as a success), is rejected with ``requeue=True`` under
    ``acks_late``, or replaces itself (``self.replace()``, by one run or by a chain whose
    last task runs under the same task id; or by a run that then retries with
    ``throw=False``, its retry published at the replacement's own nesting): the message
    runs again, and its key holds until its last run ended."""
    tag = f"{first_run}-{uuid.uuid4().hex[:6]}"
    with worker_and_relay():
        first = enqueue_once("k", gated_plain, tag, first_run)
        wait_until(lambda: starts(tag) == runs, "the message's last run", timeout=TIMEOUT)
        # The last run waits for its gate: the message is live.
        assert enqueue_once("k", gated_plain, tag, "wait") == first
        row = OutboxUniqueKey.objects.get()
        assert (row.message_id, row.finished_at) == (first, None)
        assert row.started_at is not None
        open_gate(tag)
        wait_until(lambda: effects(tag) == 1, "the last run's end", timeout=TIMEOUT)
        a_later_message_runs(gated_plain, first)
    assert (starts(tag), effects(tag)) == (runs, 1)
    assert OutboxMessage.objects.count() == 2


def test_a_failed_run_that_on_failure_retries_holds_the_key_until_the_retry_ended():
    """The run fails, and the task's ``on_failure`` retries it (``self.retry(throw=False)``,
    in the run): the retry is published under the run's task id, and the key holds until
    the retry ended."""
    tag = f"on-failure-{uuid.uuid4().hex[:6]}"
    task = gated_plain_retried_on_failure
    with worker_and_relay():
        first = enqueue_once("k", task, tag, "fail")
        wait_until(lambda: starts(tag) == 2, "the retry's run", timeout=TIMEOUT)
        the_key_holds_until_the_run_ended(task, tag, first)
    assert (starts(tag), effects(tag)) == (2, 1)
    assert OutboxMessage.objects.count() == 2


@pytest.mark.parametrize("first_run", ["retry-unpublishable", "replace-unpublishable"])
def test_a_run_whose_retry_or_replacement_was_not_published_frees_the_key_when_it_ends(
    first_run: str,
):
    """The run's retry (``throw=False``), or its replacement, could not be published (here
    its arguments cannot be serialized; a broker that refuses it does the same): Celery
    rejects the run, or it fails, and the message never runs again. Its end frees the key
    at once, not when the run's lease (``LEASE``, 60 s) runs out."""
    tag = f"{first_run}-{uuid.uuid4().hex[:6]}"
    with worker_and_relay():
        first = enqueue_once("k", gated_plain, tag, first_run)
        wait_until(lambda: starts(tag) == 1, "the run to start", timeout=TIMEOUT)
        wait_until(
            lambda: OutboxUniqueKey.objects.get().finished_at is not None,
            "the run's end to free the key",
            timeout=TIMEOUT,
        )
        a_later_message_runs(gated_plain, first)
    assert (starts(tag), effects(tag)) == (1, 0)
    assert OutboxMessage.objects.count() == 2


@contextmanager
def a_run_told_to_stop(
    task: object, tag: str, first_run: str, pool: str = "prefork", sig: str = "SIGTERM"
) -> Iterator[uuid.UUID]:
    """A worker (of ``pool``) and a relay; a message of ``task`` whose run started and
    reported it, then ``revoke(terminate=True, signal=sig)``: the message's id."""
    from tests import celery_app

    with ExitStack() as stack:
        worker = stack.enter_context(celery_worker(pool=pool, concurrency=1))
        stack.callback(stop_process, framework_named("celery").relay())
        first = enqueue_once("k", task, tag, first_run)
        wait_until(lambda: starts(tag) == 1, "the run to start", timeout=TIMEOUT)
        wait_until(lambda: held_since_started(), "the run's report", timeout=TIMEOUT)
        replies = celery_app.app.control.revoke(
            str(first),
            destination=[node_name(worker)],
            terminate=True,
            signal=sig,
            reply=True,
            timeout=5,
        )
        assert replies, "the worker did not answer the revoke"
        yield first


def test_a_run_told_to_stop_holds_the_key_until_it_ended_or_its_lease_ran_out():
    """``revoke(terminate=True)`` signals the run's process and reports the message revoked
    at once, while the run may go on (it handles ``SIGTERM``, or is still finishing): a
    stopped run is a crash, and its lease decides. The key frees when the run ends."""
    tag = f"terminated-{uuid.uuid4().hex[:6]}"
    with a_run_told_to_stop(gated_plain, tag, "outlive-sigterm") as first:
        marks = ProviderCall.objects.using("provider")
        wait_until(lambda: marks.filter(key=f"sigterm:{tag}").exists(), "the run to be signalled")
        assert effects(tag) == 0  # it runs still
        assert enqueue_once("k", gated_plain, tag, "wait") == first
        open_gate(tag)
        wait_until(lambda: effects(tag) == 1, "the run's end", timeout=TIMEOUT)
        a_later_message_runs(gated_plain, first)
    assert (starts(tag), effects(tag)) == (1, 1)
    assert OutboxMessage.objects.count() == 2


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_run_told_to_stop_that_dies_frees_the_key_by_its_end_or_its_lease(sig: str):
    """``revoke(terminate=True)`` of a run that dies of it. ``SIGTERM`` (the default) ends
    the pool process by unwinding the run: its end is reported, and frees the key at once.
    ``SIGKILL`` leaves nothing to report: the key holds until the run's lease ran out (its
    hard time limit and a second, under the prefork pool). The next enqueue then writes a
    message of its own; the stopped run wrote no effect."""
    tag = f"terminated-{sig}-{uuid.uuid4().hex[:6]}"
    task = gated_plain_time_limited
    with a_run_told_to_stop(task, tag, "wait", sig=sig) as first:
        row = OutboxUniqueKey.objects.get()
        assert row.lease_expires_at is not None
        if sig == "SIGTERM":  # the run's end frees it, not its lease
            wait_until(
                lambda: OutboxUniqueKey.objects.get().finished_at is not None,
                "the run's end to free the key",
                timeout=TIMEOUT,
            )
        elif timezone.now() < row.lease_expires_at - SKEW:
            assert enqueue_once("k", task, tag, "wait") == first
        a_later_message_runs(task, first)
        if sig == "SIGKILL":
            assert timezone.now() >= row.lease_expires_at
    assert (starts(tag), effects(tag)) == (1, 0)
    assert OutboxMessage.objects.count() == 2


def test_a_run_told_to_stop_by_a_pool_that_cannot_stop_it_holds_the_key_until_it_ended():
    """The threads pool cannot stop a run (``revoke(terminate=True)`` is refused there):
    the run goes on, and holds its key until it ended."""
    tag = f"terminated-threads-{uuid.uuid4().hex[:6]}"
    with a_run_told_to_stop(gated_plain, tag, "wait", pool="threads") as first:
        the_key_holds_until_the_run_ended(gated_plain, tag, first)
    assert (starts(tag), effects(tag)) == (1, 1)
    assert OutboxMessage.objects.count() == 2


def held_since_started() -> bool:
    return OutboxUniqueKey.objects.filter(started_at__isnull=False).exists()


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_a_pool_that_enforces_no_time_limit_holds_the_key_while_the_run_goes_on(pool: str):
    """Only the prefork pool kills a run at its hard time limit: under the others a run goes
    on past it, and holds its key (for ``LEASE``) until it ended."""
    tag = f"{pool}-{uuid.uuid4().hex[:6]}"
    with worker_and_relay(pool):
        first = enqueue_once("k", gated_plain_time_limited, tag, "wait")
        wait_until(lambda: starts(tag) == 1, "the run to start", timeout=TIMEOUT)
        row = OutboxUniqueKey.objects.get()
        assert row.started_at is not None
        beyond = row.started_at + timedelta(seconds=GATED_TIME_LIMIT_SECONDS + 1) + SKEW
        wait_until(lambda: timezone.now() > beyond, "the run to outlive its time limit")
        assert effects(tag) == 0  # it runs still
        assert enqueue_once("k", gated_plain_time_limited, tag, "wait") == first
        open_gate(tag)
        wait_until(lambda: effects(tag) == 1, "the run's end", timeout=TIMEOUT)
        a_later_message_runs(gated_plain_time_limited, first)
    assert (starts(tag), effects(tag)) == (1, 1)
    assert OutboxMessage.objects.count() == 2
