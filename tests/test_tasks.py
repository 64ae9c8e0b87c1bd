"""Celery: the beat tasks and deduplicated consumers; then a real worker."""

from __future__ import annotations

import os
import random
import signal
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("celery", reason="Celery is an optional dependency")

from django.utils import timezone

from django_idempotency import tasks
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests import celery_app
from tests.helpers import (
    celery_worker,
    completed,
    in_progress,
    postgres_only,
    stop_process,
    task_effects,
    task_starts,
    wait_drained,
    wait_until,
)
from tests.testapp.models import ProviderCall
from tests.testapp.tasks import (
    LONG_LEASE_SECONDS,
    fail_once,
    record_effect,
    record_effect_by_tag,
    record_effect_fail,
    record_effect_long_lease,
)

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


# Where the records of tests.record_effect live.
A_TASK = {"account": "task", "operation": "task:tests.record_effect"}


def task_record(name: str) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(account="task", operation=f"task:{name}")


# -- the decorator, run eagerly in this process -----------------------------------------------


def test_same_task_id_runs_the_body_once_and_replays_its_result():
    task_id = str(uuid.uuid4())
    first = record_effect.apply(("eager",), task_id=task_id).get()
    second = record_effect.apply(("eager",), task_id=task_id).get()
    assert first == second == {"tag": "eager", "pid": os.getpid()}
    assert (task_effects("eager"), task_starts("eager")) == (1, 1)
    record = task_record("tests.record_effect")
    assert (record.key, record.status) == (task_id, RecordStatus.COMPLETED)


def test_another_task_id_is_another_delivery():
    record_effect.apply(("two",), task_id=str(uuid.uuid4()))
    record_effect.apply(("two",), task_id=str(uuid.uuid4()))
    assert task_effects("two") == 2


def test_a_key_callable_dedupes_across_task_ids():
    record_effect_by_tag.apply(("tagged",), task_id=str(uuid.uuid4()))
    record_effect_by_tag.apply(("tagged",), task_id=str(uuid.uuid4()))
    assert task_effects("tagged") == 1
    assert task_record("tests.record_effect_by_tag").key == "tag:tagged"


def test_a_plain_call_is_not_a_delivery():
    record_effect("plain")
    record_effect("plain")
    assert task_effects("plain") == 2
    assert not IdempotencyRecord.objects.exists()


def test_an_exception_rolls_the_body_back_and_releases_the_claim():
    task_id = str(uuid.uuid4())
    failed = fail_once.apply(("flaky",), task_id=task_id)
    assert isinstance(failed.result, RuntimeError)
    assert task_effects("flaky") == 0
    assert not IdempotencyRecord.objects.exists()
    assert fail_once.apply(("flaky",), task_id=task_id).get() == "ok"
    assert task_effects("flaky") == 1


def test_a_live_lease_held_elsewhere_is_refused_outside_a_worker():
    task_id = str(uuid.uuid4())
    in_progress(lease_in=timedelta(seconds=30), now=timezone.now(), key=task_id, **A_TASK)
    outcome = record_effect.apply(("held",), task_id=task_id)
    assert isinstance(outcome.result, tasks.DeliveryInProgress)
    assert task_effects("held") == 0


def test_a_stale_lease_is_taken_over():
    task_id = str(uuid.uuid4())
    record_effect.apply(("stale",), task_id=task_id)
    IdempotencyRecord.objects.update(
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    record_effect.apply(("stale",), task_id=task_id)
    assert task_effects("stale") == 2
    record = task_record("tests.record_effect")
    assert (record.status, record.recovery_attempts) == (RecordStatus.COMPLETED, 1)


def test_a_delivery_that_lost_its_lease_commits_nothing():
    create = ProviderCall.objects.create

    def write_then_lose_the_lease(**fields: Any) -> ProviderCall:
        written = create(**fields)
        # Another delivery takes the lease over while this one runs.
        IdempotencyRecord.objects.update(lease_token=uuid.uuid4())
        return written

    with mock.patch.object(ProviderCall.objects, "create", side_effect=write_then_lose_the_lease):
        outcome = record_effect.apply(("lost",), task_id=str(uuid.uuid4())).get()
    assert outcome is None
    assert task_effects("lost") == 0
    assert task_starts("lost") == 1
    assert task_record("tests.record_effect").status == RecordStatus.IN_PROGRESS


def test_a_record_marked_failed_is_never_run_again():
    task_id = str(uuid.uuid4())
    failed = RecordStatus.FAILED
    completed(
        expires_in=timedelta(hours=1), now=timezone.now(), key=task_id, status=failed, **A_TASK
    )
    assert record_effect.apply(("closed",), task_id=task_id).get() is None
    assert task_effects("closed") == 0


def test_maintenance_tasks_return_their_results():
    now = timezone.now()
    completed(expires_in=-timedelta(seconds=1), now=now)
    in_progress(lease_in=-timedelta(seconds=1), now=now)
    in_progress(lease_in=-timedelta(seconds=1), now=now, policy="resume")
    purged = tasks.purge_expired.apply(kwargs={"batch_size": 10}).get()
    assert (purged["deleted"], purged["batches"]) == (1, 1)
    recovered = tasks.recover_stale_leases.apply().get()
    assert (recovered["found"], recovered["released"], recovered["resumable"]) == (2, 1, 1)
    assert IdempotencyRecord.objects.get().recovery_policy == "resume"


# -- a real worker ----------------------------------------------------------------------------


def worker_test(test: Callable[..., None]) -> Callable[..., None]:
    """A test with real Celery workers: marked ``servers``, on an empty queue."""
    return pytest.mark.servers(pytest.mark.usefixtures("clean_queue")(test))


@postgres_only
@worker_test
def test_a_worker_runs_both_beat_tasks():
    now = timezone.now()
    for _ in range(3):
        completed(expires_in=-timedelta(seconds=1), now=now)
    completed(expires_in=timedelta(hours=1), now=now, key="young")
    in_progress(lease_in=-timedelta(seconds=1), now=now, key="stale", policy="fail")
    with celery_worker():
        tasks.purge_expired.delay(batch_size=2)
        wait_until(lambda: IdempotencyRecord.objects.count() == 2, "the purge")
        tasks.recover_stale_leases.delay()
        wait_until(
            lambda: IdempotencyRecord.objects.filter(status=RecordStatus.FAILED).exists(),
            "the recovery",
        )
    assert IdempotencyRecord.objects.get(key="stale").recovery_attempts == 1


@postgres_only
@worker_test
def test_the_same_task_id_sent_twice_runs_once():
    task_id = str(uuid.uuid4())
    with celery_worker():
        record_effect.apply_async(("twice",), task_id=task_id)
        record_effect.apply_async(("twice",), task_id=task_id)
        wait_drained()
    assert (task_effects("twice"), task_starts("twice")) == (1, 1)
    assert task_record("tests.record_effect").status == RecordStatus.COMPLETED


@postgres_only
@worker_test
def test_a_duplicate_delivered_during_the_run_waits_for_the_lease_and_is_skipped():
    task_id = str(uuid.uuid4())
    with celery_worker(concurrency=2):
        record_effect.apply_async(("overlap",), {"hold": 2}, task_id=task_id)
        wait_until(lambda: task_starts("overlap") == 1, "the first run to start")
        # The second delivery finds the lease held, is retried after it, finds the result.
        record_effect.apply_async(("overlap",), {"hold": 2}, task_id=task_id)
        wait_until(lambda: task_effects("overlap") == 1, "the first run to commit")
        wait_drained()
    assert (task_effects("overlap"), task_starts("overlap")) == (1, 1)


def pool_pid(tag: str) -> int:
    row = ProviderCall.objects.filter(key__startswith=f"start:{tag}:").get()
    return int(row.key.rsplit(":", 1)[1])


def assert_completed_after_the_dead_lease(dead_lease_end: Any) -> None:
    """One run committed, as a takeover, and never while the dead run's lease was live."""
    record = task_record("tests.record_effect_long_lease")
    assert (record.status, record.recovery_attempts) == (RecordStatus.COMPLETED, 1)
    assert record.completed_at >= dead_lease_end


@postgres_only
@worker_test
def test_a_pool_process_killed_mid_task_is_redelivered_and_runs_once():
    with celery_worker():
        record_effect_long_lease.apply_async(("child-killed",), {"hold": 60})
        wait_until(lambda: task_starts("child-killed") == 1, "the first run to start")
        dead_lease_end = task_record("tests.record_effect_long_lease").lease_expires_at
        os.kill(pool_pid("child-killed"), signal.SIGKILL)
        # reject_on_worker_lost puts the message back at once; the redelivery finds the dead
        # run's lease still live, comes back when it has run out, and takes it over.
        wait_until(lambda: task_effects("child-killed") == 1, "the redelivered run to commit")
        wait_drained()
    assert (task_effects("child-killed"), task_starts("child-killed")) == (1, 2)
    assert_completed_after_the_dead_lease(dead_lease_end)


@postgres_only
@worker_test
def test_a_pool_process_stopped_by_sigterm_mid_task_is_never_run_again_under_fail():
    """SIGTERM to a pool process (systemd stopping the worker's whole control group, a
    cold shutdown, ``revoke(terminate=True)``) raises ``SystemExit`` inside the body. That
    is a crash, not the body's error: the claim stays, and ``"fail"`` closes the record
    rather than let the redelivery run the body a second time."""
    with celery_worker():
        record_effect_fail.apply_async(("sigterm",), {"hold": 60})
        wait_until(lambda: task_starts("sigterm") == 1, "the first run to start")
        os.kill(pool_pid("sigterm"), signal.SIGTERM)
        # reject_on_worker_lost puts the message back at once.
        wait_until(
            lambda: (
                task_starts("sigterm") > 1
                or IdempotencyRecord.objects.filter(status=RecordStatus.FAILED).exists()
            ),
            "the redelivery to run the body again or close its record",
        )
        wait_drained()
    assert (task_effects("sigterm"), task_starts("sigterm")) == (0, 1)
    assert task_record("tests.record_effect_fail").status == RecordStatus.FAILED


@postgres_only
@worker_test
def test_a_worker_killed_mid_task_is_redelivered_by_a_new_worker_and_runs_once():
    assert celery_app.VISIBILITY_TIMEOUT < LONG_LEASE_SECONDS
    with celery_worker() as first:
        record_effect_long_lease.apply_async(("worker-killed",), {"hold": 60})
        wait_until(lambda: task_starts("worker-killed") == 1, "the first run to start")
        dead_lease_end = task_record("tests.record_effect_long_lease").lease_expires_at
        stop_process(first, signal.SIGKILL)
    assert task_effects("worker-killed") == 0
    # The message is still unacknowledged in Redis: after the visibility timeout the next
    # worker gets it again, while the dead run's lease is still live.
    with celery_worker():
        wait_until(lambda: task_effects("worker-killed") == 1, "the redelivered run to commit")
        wait_drained()
    assert (task_effects("worker-killed"), task_starts("worker-killed")) == (1, 2)
    assert_completed_after_the_dead_lease(dead_lease_end)


BODIES = 40
DELIVERIES = 3


@postgres_only
@worker_test
def test_two_workers_consuming_duplicated_deliveries_run_each_body_once():
    tags = [f"dup-{uuid.uuid4().hex[:10]}" for _ in range(BODIES)]
    # Every body sent DELIVERIES times under one task id, in a shuffled order, so the
    # copies of one body reach both workers, often at the same moment.
    messages = [(tag, str(uuid.uuid4())) for tag in tags] * DELIVERIES
    random.Random(16).shuffle(messages)
    with celery_worker(concurrency=2), celery_worker(concurrency=2):
        for tag, task_id in messages:
            record_effect.apply_async((tag,), task_id=task_id)
        wait_drained()
    assert [(task_effects(tag), task_starts(tag)) for tag in tags] == [(1, 1)] * BODIES
