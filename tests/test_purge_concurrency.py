"""Purges beside each other and beside live transactions, each on its own connection."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.backends.signals import connection_created
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency import StoreUnavailable, maintenance, run_once
from django_idempotency.models import IdempotencyAuditRecord, IdempotencyRecord
from tests.helpers import bulk_records, completed, in_thread, postgres_only

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

WAIT = 30  # seconds: a bound on every wait, far above what any step needs


def wait_for_a_blocked_backend() -> None:
    """Until another connection waits for a row lock, so that a race is really run."""
    deadline = time.monotonic() + WAIT
    waiting = {
        "postgresql": "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'",
        "mysql": "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'",
    }[connection.vendor]
    with connections["provider"].cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(waiting)
            if cursor.fetchone()[0]:
                return
            # InnoDB refreshes information_schema.innodb_trx only when it was last read
            # more than 0.1 s ago: polled faster, it never shows the lock wait.
            time.sleep(0.15 if connection.vendor == "mysql" else 0.01)
    raise AssertionError("no connection ever waited for the lock")


@override_settings(IDEMPOTENCY={"AUDIT": True})
def test_two_purgers_at_once_delete_each_row_once():
    total = 6000
    bulk_records(total, expires_at=timezone.now() - timedelta(minutes=1), prefix="expired")
    # Each purger, after its first batch, waits until the other has done one too: both are
    # then known to run at the same time, whatever the thread scheduling.
    first_batch = {name: threading.Event() for name in ("a", "b")}

    def purge(name: str) -> maintenance.PurgeResult:
        other = "b" if name == "a" else "a"

        def progress(batches: int, rows: int) -> None:
            if batches == 1:
                first_batch[name].set()
                first_batch[other].wait(WAIT)

        try:
            return maintenance.purge_expired(batch_size=100, progress=progress)
        finally:
            first_batch[name].set()  # a purger that stopped early keeps nobody waiting

    with ThreadPoolExecutor(max_workers=2) as pool:
        a, b = pool.map(in_thread(purge), ["a", "b"])

    if connection.vendor == "postgresql":
        # Both took part. (InnoDB may hand one purger an empty first pick while the other
        # holds rows; it then stops early, and the total below still has to hold.)
        assert a.deleted > 0
        assert b.deleted > 0
    assert a.deleted + b.deleted == total
    assert IdempotencyRecord.objects.count() == 0
    # Every row was copied to the audit trail by the purger that deleted it, exactly once.
    archived = IdempotencyAuditRecord.objects.values_list("record_id", flat=True)
    assert len(archived) == len(set(archived)) == total


def test_purge_skips_rows_a_live_transaction_holds_and_does_not_wait():
    bulk_records(500, expires_at=timezone.now() - timedelta(minutes=1), prefix="expired")
    held = list(IdempotencyRecord.objects.order_by("expires_at").values_list("pk", flat=True)[:10])
    locked, purged = threading.Event(), threading.Event()

    def hold() -> bool:
        with transaction.atomic():
            list(IdempotencyRecord.objects.select_for_update().filter(pk__in=held))
            locked.set()
            # Released only once the purge has returned: a purge that waited would wait
            # here for WAIT seconds and then delete these rows too.
            return purged.wait(WAIT)

    with ThreadPoolExecutor(max_workers=1) as pool:
        holder = pool.submit(in_thread(hold))
        assert locked.wait(WAIT)
        result = maintenance.purge_expired(batch_size=100)
        purged.set()
        assert holder.result(WAIT) is True

    assert result.deleted == 490
    assert set(IdempotencyRecord.objects.values_list("pk", flat=True)) == set(held)
    assert maintenance.purge_expired().deleted == 10


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="checks the PostgreSQL statement's own text"
)
@pytest.mark.parametrize("audit", [False, True])
def test_a_postgres_batch_is_one_statement_that_skips_locked_rows(audit):
    completed(expires_in=-timedelta(minutes=1), now=timezone.now())
    with override_settings(IDEMPOTENCY={"AUDIT": audit}), CaptureQueriesContext(connection) as q:
        assert maintenance.purge_expired(batch_size=10).deleted == 1
    deletes = [query["sql"] for query in q.captured_queries if "DELETE" in query["sql"]]
    # The batch, then the (empty) batches of the audit table and of the outbox.
    assert len(deletes) == 3
    batch = deletes[0]
    assert "FOR UPDATE SKIP LOCKED" in batch
    assert "LIMIT 10" in batch
    # The pick is run once, whatever the plan (tests/test_maintenance.py forces the plan
    # that would run a plain subquery again for every row).
    assert batch.startswith('WITH batch ("id") AS MATERIALIZED (SELECT')
    assert (', gone AS (DELETE FROM "django_idempotency_record"' in batch) is audit


def test_a_concurrent_claim_archives_a_replaced_record_once(settings):
    settings.IDEMPOTENCY = {"AUDIT": True}
    now = timezone.now()
    completed(expires_in=-timedelta(seconds=1), now=now, key="reused")
    first_copied = threading.Event()

    def claim(name: str) -> int:
        # What the claim does with the audit trail on: copy the expired row (locking it),
        # then replace it, in one transaction.
        if name == "second":
            assert first_copied.wait(WAIT)
        with transaction.atomic():
            copied = IdempotencyRecord.objects.archive_expired(
                "user:1", "charges.create", "reused", now=now
            )
            if name == "first":
                first_copied.set()
                wait_for_a_blocked_backend()
            IdempotencyRecord.objects.filter(key="reused").expired(now).update(
                expires_at=now + timedelta(hours=24)
            )
        return copied

    with ThreadPoolExecutor(max_workers=2) as pool:
        copies = list(pool.map(in_thread(claim), ["first", "second"]))

    assert copies == [1, 0]
    assert IdempotencyAuditRecord.objects.count() == 1


IDENTITY = {"account": "consumer:billing", "operation": "invoices.send"}
HELD_BOUND = override_settings(IDEMPOTENCY={"CLAIM_TIMEOUT": timedelta(seconds=1.5)})


def hold_expired_row(key: str, seconds: float, locked: threading.Event) -> None:
    """A maintenance batch (the rotation resealing, a purge skipping) holding an expired
    record's row for ``seconds`` and changing nothing."""
    try:
        with transaction.atomic(using="provider"):
            held = IdempotencyRecord.objects.using("provider").select_for_update()
            assert list(held.filter(key=key))
            locked.set()
            time.sleep(seconds)
    finally:
        connections["provider"].close()


def called(calls: list[str], tag: str) -> str:
    calls.append(tag)
    return tag


@contextmanager
def held_after_a_first_run(
    effect: Callable[[str], str], key: str, seconds: float, **terms: Any
) -> Iterator[None]:
    """``effect("first")`` run once with ``key`` and its record expired; inside the block a
    batch holds that record's row for ``seconds``."""
    assert run_once(effect, "first", **IDENTITY, key=key, ttl=60, **terms) == "first"
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    locked = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        holder = pool.submit(in_thread(hold_expired_row), key, seconds, locked)
        assert locked.wait(WAIT)
        yield
        holder.result(WAIT)


@pytest.mark.parametrize(("held", "taken_over"), [(0.4, True), (3.0, False)])
def test_a_claim_waits_for_a_batch_holding_an_expired_record_within_claim_timeout(held, taken_over):
    """An expired record whose row a batch holds is neither replayed nor left: the claim
    looks again until the batch lets go, for at most CLAIM_TIMEOUT. Before, it gave up
    after three looks some 30 ms apart and answered StoreUnavailable to a retry that a
    short batch had only delayed."""
    calls: list[str] = []
    effect = functools.partial(called, calls)
    with held_after_a_first_run(effect, "held-1", held), HELD_BOUND:
        if taken_over:
            assert run_once(effect, "second", **IDENTITY, key="held-1", ttl=60) == "second"
        else:
            with pytest.raises(StoreUnavailable):
                run_once(effect, "second", **IDENTITY, key="held-1", ttl=60)
    record = IdempotencyRecord.objects.get()
    if taken_over:
        assert calls == ["first", "second"]
        assert record.status == "completed"
        assert record.expires_at > timezone.now()
    else:
        assert calls == ["first"]  # refused: nothing ran, the expired record as it was
        assert record.expires_at < timezone.now()
        assert run_once(effect, "third", **IDENTITY, key="held-1", ttl=60) == "third"
        assert calls == ["first", "third"]


def test_a_claim_that_waited_for_a_batch_gets_its_whole_lease():
    """The lease of a claim made after waiting for a batch is counted from when it was made:
    a lease counted from before the wait would end early, and a duplicate could take over
    an attempt that is still running."""
    lease = timedelta(seconds=10)
    leases: list[timedelta] = []

    def effect(tag: str) -> str:
        record = IdempotencyRecord.objects.get(key="held-2")
        leases.append(record.lease_expires_at - timezone.now())
        return tag

    with held_after_a_first_run(effect, "held-2", 1.0, lease=lease):
        assert run_once(effect, "second", **IDENTITY, key="held-2", ttl=60, lease=lease)
    # Read as the body began, right after the claim: all of the lease but that moment.
    assert leases[1] > lease - timedelta(seconds=0.5), leases


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the claim connection's watchdog")
def test_inside_a_transaction_the_wait_for_a_batch_ends_before_the_claim_connections_watchdog(
    caplog,
):
    """Inside a caller's transaction the claim runs on a connection whose statements a
    watchdog interrupts at CLAIM_TIMEOUT. The wait for a batch ends before it: the claim is
    refused on its own terms, no statement is cut off (a takeover cut off after it
    committed would leave a claim nobody runs), and the expired record stays as it was.

    The claim connection takes 0.6 s to connect (a pooler's queue): the bound counts from
    the claim's start, as the watchdog does, not from the first pause after the connect."""
    calls: list[str] = []
    effect = functools.partial(called, calls)
    claimer = threading.current_thread()

    def slow_connect(sender: Any, connection: Any, **kwargs: Any) -> None:
        if threading.current_thread() is claimer:
            time.sleep(0.6)

    warnings = caplog.at_level("WARNING", logger="django_idempotency")
    with held_after_a_first_run(effect, "held-3", 4.0), HELD_BOUND, warnings:
        connection_created.connect(slow_connect)
        try:
            with transaction.atomic(), pytest.raises(StoreUnavailable):
                run_once(effect, "second", **IDENTITY, key="held-3", ttl=60)
        finally:
            connection_created.disconnect(slow_connect)
        time.sleep(1.5)  # past the watchdog's close, a second after its bound
    assert calls == ["first"]
    assert "CLAIM_TIMEOUT" not in caplog.text, caplog.text
    assert IdempotencyRecord.objects.get().expires_at < timezone.now()
