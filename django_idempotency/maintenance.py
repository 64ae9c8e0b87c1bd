"""Purge and recovery: the one implementation behind the commands, the Celery tasks and the admin.

Everything here is bounded: the purge deletes in batches, each in a short transaction of its
own, and recovery handles one record per short transaction. Nothing holds a lock while it
waits on anything else, so both run beside live traffic and beside each other.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import OperationalError, connections, models, transaction
from django.db.models import F, QuerySet
from django.http import HttpResponse
from django.utils import timezone

from django_idempotency import conf, engine, signals, store
from django_idempotency.models import (
    PURGED,
    IdempotencyAuditRecord,
    IdempotencyRecord,
    IdempotencyRecordQuerySet,
    column,
    expired_q,
    stale_q,
)

logger = logging.getLogger("django_idempotency")

Progress = Callable[[int, int], None]


@dataclass
class PurgeResult:
    """What one purge run did (or, with ``dry_run``, would do)."""

    deleted: int = 0
    batches: int = 0
    archived: int = 0
    audit_deleted: int = 0
    audit_batches: int = 0
    longest_batch_seconds: float = 0.0
    dry_run: bool = False
    # False when ``max_batches`` stopped a table before it was done: more may remain.
    complete: bool = True


@dataclass
class RecoveryResult:
    """What one recovery run did to stale leases (or, with ``dry_run``, found)."""

    found: int = 0
    released: int = 0
    failed: int = 0
    completed: int = 0
    # The record changed meanwhile (completed, released or taken over by a retry).
    skipped: int = 0
    # The policy raised, could not be imported, or answered a response that cannot be kept;
    # the attempt is counted on the record and the next run tries again.
    errors: int = 0
    dry_run: bool = False
    policies: dict[str, int] = field(default_factory=dict)


# -- purge ------------------------------------------------------------------------------------


def purge_expired(
    *,
    using: str | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
    progress: Progress | None = None,
) -> PurgeResult:
    """Delete expired records, then audit records past their retention, in bounded batches.

    Each batch is one short transaction; on PostgreSQL one ``DELETE ... WHERE id IN (SELECT
    ... LIMIT n FOR UPDATE SKIP LOCKED)``, so concurrent purgers and live claims never wait
    on each other for more than one batch. An in-progress record with a live lease is never
    deleted. With ``IDEMPOTENCY["AUDIT"]`` on, each batch first copies its records to the
    audit trail, in the same transaction. ``max_batches`` bounds each table separately
    (default ``PURGE_MAX_BATCHES``). ``progress(batches, rows)`` is called after every batch
    with the run's running totals. Sends ``records_purged`` unless ``dry_run``.
    """
    alias = using or conf.database()
    size = batch_size if batch_size is not None else conf.purge_batch_size()
    limit = max_batches if max_batches is not None else conf.purge_max_batches()
    if size <= 0 or (limit is not None and limit <= 0):
        raise ValueError("batch_size and max_batches must be positive")
    now = now or timezone.now()
    records = IdempotencyRecord.objects.using(alias).filter(expired_q(now))
    audits = IdempotencyAuditRecord.objects.using(alias).filter(
        archived_at__lte=now - conf.audit_retention()
    )
    result = PurgeResult(dry_run=dry_run)
    if dry_run:
        result.deleted, result.batches, result.complete = _count(records, size, limit)
        result.audit_deleted, result.audit_batches, audit_complete = _count(audits, size, limit)
        result.complete = result.complete and audit_complete
        return result
    archive_at = now if conf.audit() else None
    for rows, seconds in _batches(records, "expires_at", size, limit, archive_at):
        result.batches += 1
        result.deleted += rows
        _batch_done(result, seconds, progress)
    result.archived = result.deleted if archive_at else 0
    for rows, seconds in _batches(audits, "archived_at", size, limit, None):
        result.audit_batches += 1
        result.audit_deleted += rows
        _batch_done(result, seconds, progress)
    result.complete = limit is None or (result.batches < limit and result.audit_batches < limit)
    signals.records_purged.send(
        sender=IdempotencyRecord, count=result.deleted, audit=result.audit_deleted
    )
    return result


def _batch_done(result: PurgeResult, seconds: float, progress: Progress | None) -> None:
    result.longest_batch_seconds = max(result.longest_batch_seconds, seconds)
    if progress is not None:
        progress(result.batches + result.audit_batches, result.deleted + result.audit_deleted)


def _count(candidates: QuerySet[Any], size: int, limit: int | None) -> tuple[int, int, bool]:
    total = candidates.count()
    batches = math.ceil(total / size)
    if limit is not None and batches > limit:
        return limit * size, limit, False
    return total, batches, True


def _batches(
    candidates: QuerySet[Any],
    order: str,
    size: int,
    limit: int | None,
    archive_at: datetime | None,
) -> Iterator[tuple[int, float]]:
    """Delete ``candidates`` batch by batch; yields each batch's rows and duration.

    ``size`` is a ceiling. A batch slower than ``_BATCH_BUDGET`` halves the next one (never
    below ``_MIN_BATCH``) and a batch well inside it doubles the next one back, so batches
    stay short on a busy server, where a fixed size cannot hold a bound on their duration.
    """
    taken, current = 0, size
    while limit is None or taken < limit:
        started = time.monotonic()
        rows = _retrying(functools.partial(_delete_batch, candidates, order, current, archive_at))
        if rows == 0:
            return
        taken += 1
        seconds = time.monotonic() - started
        yield rows, seconds
        # A short batch means the rest is gone, or locked by a concurrent purger that will
        # delete it: either way this run is done.
        if rows < current:
            return
        if seconds > _BATCH_BUDGET:
            current = max(min(size, _MIN_BATCH), current // 2)
        elif seconds < _BATCH_BUDGET / 4:
            current = min(size, current * 2)


# What one purge batch aims to take, and the smallest batch it shrinks to meanwhile.
_BATCH_BUDGET = 0.05
_MIN_BATCH = 100


_BATCH_ATTEMPTS = 5


def _retrying(batch: Callable[[], int]) -> int:
    # InnoDB can choose one of two concurrent purgers as a deadlock victim (their index
    # locks can cross even with SKIP LOCKED); a batch is one short transaction that picks
    # its rows afresh, so running it again is safe.
    for attempt in range(_BATCH_ATTEMPTS):
        try:
            return batch()
        except OperationalError as exc:
            if not store._retryable(exc) or attempt == _BATCH_ATTEMPTS - 1:
                raise
            time.sleep(random.uniform(0.001, 0.01) * (attempt + 1))
    raise AssertionError("unreachable")


def _delete_batch(
    candidates: QuerySet[Any], order: str, size: int, archive_at: datetime | None
) -> int:
    alias = candidates.db
    connection = connections[alias]
    features = connection.features
    with transaction.atomic(using=alias):
        pick = candidates.select_for_update(
            skip_locked=features.has_select_for_update_skip_locked
        ).order_by(order)
        if connection.vendor == "postgresql":
            return _postgres_batch(candidates.model, pick, size, archive_at)
        ids = list(pick.values_list("pk", flat=True)[:size])
        if not ids:
            return 0
        if features.has_select_for_update:
            # The rows are locked and ours: the statements go by primary key alone.
            batch = candidates.model._default_manager.using(alias).filter(pk__in=ids)
        else:
            # Without row locks (SQLite) a row may have been replaced by a new claim since it
            # was picked: the predicate is applied again.
            batch = candidates.filter(pk__in=ids)
        if archive_at is not None:
            assert isinstance(batch, IdempotencyRecordQuerySet)
            batch.archive(PURGED, now=archive_at)
        if connection.vendor == "mysql":
            return _mysql_delete(candidates.model, alias, ids)
        deleted, _ = batch.delete()
        return int(deleted)


def _mysql_delete(model: type[models.Model], alias: str, ids: list[Any]) -> int:
    # One primary-key lookup per row. A single DELETE ... IN (...) is planned by cost:
    # InnoDB may scan the whole primary key, locking every row it meets, and so wait for
    # rows that live claims (or the other purger) hold; a lookup touches only its own row.
    connection = connections[alias]
    quote = connection.ops.quote_name
    table, pk = quote(model._meta.db_table), quote(column(model, model._meta.pk.name))
    deleted = 0
    with connection.cursor() as cursor:
        for pk_value in ids:
            cursor.execute(f"DELETE FROM {table} WHERE {pk} = %s", [pk_value])
            deleted += max(int(cursor.rowcount), 0)
    return deleted


def _postgres_batch(
    model: type[models.Model], pick: QuerySet[Any], size: int, archive_at: datetime | None
) -> int:
    # One statement: pick (skipping rows another transaction holds), delete, and with the
    # audit trail on, copy what was deleted from the DELETE's RETURNING rows.
    connection = connections[pick.db]
    quote = connection.ops.quote_name
    ids_sql, params = pick.values("pk")[:size].query.get_compiler(pick.db).as_sql()
    params = tuple(params)
    table = quote(model._meta.db_table)
    pk = quote(column(model, model._meta.pk.name))
    delete = f"DELETE FROM {table} WHERE {pk} IN ({ids_sql})"
    if archive_at is not None:
        columns = ", ".join(
            quote(column(IdempotencyRecord, source))
            for _target, source in IdempotencyAuditRecord.copied_columns()
        )
        delete = (
            f"WITH gone AS ({delete} RETURNING {columns})"
            f" {IdempotencyAuditRecord.insert_sql(connection)}"
            f" SELECT {columns}, %s, %s FROM gone"
        )
        params += (archive_at, PURGED)
    with connection.cursor() as cursor:
        cursor.execute(delete, params)
        return max(int(cursor.rowcount), 0)


# -- recovery ---------------------------------------------------------------------------------

RELEASED = "released"
FAILED = "failed"
COMPLETED = "completed"


@dataclass(frozen=True)
class _Stale:
    id: int
    token: uuid.UUID | None
    account: str
    operation: str
    key: str
    policy: str


_STALE_FIELDS = ("pk", "lease_token", "account", "operation", "key", "recovery_policy")


class _Unstorable(Exception):
    """A recovery callable answered with a response that cannot be kept and replayed."""


def recover_stale_leases(
    *,
    using: str | None = None,
    limit: int | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
) -> RecoveryResult:
    """Apply each stale lease's stored recovery policy, without waiting for a retry.

    ``"retry"``: the record is released (deleted), so the next retry runs afresh.
    ``"fail"``: the record becomes ``failed`` with the "outcome unknown" problem, replayed to
    every retry. A callable gets the record: a response completes it, ``None`` releases it.
    Every step is fenced by the stale owner's lease token, so a record that completed or was
    taken over meanwhile is left alone. Attempts are counted on the record
    (``recovery_attempts``) and ``lease_recovered`` is sent for each record handled.
    """
    alias = using or conf.database()
    now = now or timezone.now()
    result = RecoveryResult(dry_run=dry_run)
    policies: Counter[str] = Counter()
    stale = IdempotencyRecord.objects.using(alias).filter(stale_q(now))
    for row in _stale_rows(stale, limit):
        result.found += 1
        policies[row.policy] += 1
        if dry_run:
            continue
        try:
            outcome = _apply(alias, row, engine.resolve_recovery(row.policy), now)
        except Exception:
            # The record is named by its id: the client's key does not belong in logs.
            logger.exception(
                "recovery policy %s failed for record %s (%s)", row.policy, row.id, row.operation
            )
            _count_attempt(alias, row)
            result.errors += 1
            continue
        if outcome is None:
            result.skipped += 1
            continue
        setattr(result, outcome, getattr(result, outcome) + 1)
        _recovered(row, row.policy, outcome)
    result.policies = dict(policies)
    return result


def release_stale(queryset: QuerySet[IdempotencyRecord]) -> int:
    """Release the in-progress records of ``queryset`` whose lease ran out (the admin action).

    Fenced like the recovery job: a record that completed or was taken over is untouched.
    Returns how many were released.
    """
    return _force(queryset, engine.RETRY)


def mark_failed(queryset: QuerySet[IdempotencyRecord]) -> int:
    """Close the in-progress records of ``queryset`` whose lease ran out as ``failed``.

    Every retry then gets the "outcome unknown" problem and the side effect never runs
    again. Fenced by the lease token. Returns how many were marked.
    """
    return _force(queryset, engine.FAIL)


def _force(queryset: QuerySet[IdempotencyRecord], policy: str) -> int:
    now = timezone.now()
    stale = queryset.filter(status=store.IN_PROGRESS, lease_expires_at__lte=now)
    done = 0
    for row in _stale_rows(stale, None):
        outcome = _apply(queryset.db, row, policy, now)
        if outcome is not None:
            done += 1
            _recovered(row, policy, outcome)
    return done


def _stale_rows(stale: QuerySet[IdempotencyRecord], limit: int | None) -> Iterator[_Stale]:
    # Pages keyed by id: a record left in place (an error) is never met twice in one run,
    # and no page is larger than a purge batch.
    page = conf.purge_batch_size()
    last, taken = 0, 0
    while limit is None or taken < limit:
        size = page if limit is None else min(page, limit - taken)
        rows = list(stale.filter(pk__gt=last).order_by("pk").values_list(*_STALE_FIELDS)[:size])
        for row in rows:
            yield _Stale(*row)
        if len(rows) < size:
            return
        taken += len(rows)
        last = rows[-1][0]


def _owned(alias: str, row: _Stale) -> QuerySet[IdempotencyRecord]:
    return IdempotencyRecord.objects.using(alias).filter(
        pk=row.id, lease_token=row.token, status=store.IN_PROGRESS
    )


def _apply(alias: str, row: _Stale, policy: engine.Recovery, now: datetime) -> str | None:
    """Apply one policy; the outcome, or ``None`` when the record changed meanwhile."""
    if policy == engine.RETRY:
        return RELEASED if _release(alias, row) else None
    if policy == engine.FAIL:
        response = engine.outcome_unknown_response(row.key, row.operation)
        return FAILED if _close(alias, row, response, store.FAILED, now) else None
    assert callable(policy)
    record = _owned(alias, row).first()
    if record is None:
        return None
    # Called outside any transaction: it may ask a provider what happened, and no lock may
    # be held while it waits.
    answer = policy(record)
    if answer is None:
        return RELEASED if _release(alias, row) else None
    answer = engine._rendered(answer)
    if not isinstance(answer, HttpResponse) or not engine.is_storable(answer):
        raise _Unstorable(f"recovery answered {answer.status_code}, which cannot be replayed")
    return COMPLETED if _close(alias, row, answer, store.COMPLETED, now) else None


def _release(alias: str, row: _Stale) -> bool:
    return row.token is not None and store.release(alias, row.id, row.token)


def _close(alias: str, row: _Stale, response: HttpResponse, status: str, now: datetime) -> bool:
    # The attempt is counted and the outcome stored in one transaction, both fenced.
    if row.token is None:
        return False
    with transaction.atomic(using=alias):
        if not _count_attempt(alias, row):
            return False
        return store.finish(
            alias,
            row.id,
            row.token,
            status=status,
            response_status=response.status_code,
            response_headers=engine.stored_headers(response),
            response_body=response.content,
            now=now,
        )


def _count_attempt(alias: str, row: _Stale) -> bool:
    return bool(_owned(alias, row).update(recovery_attempts=F("recovery_attempts") + 1))


def _recovered(row: _Stale, policy: str, outcome: str) -> None:
    signals.lease_recovered.send(
        sender=IdempotencyRecord,
        account=row.account,
        operation=row.operation,
        key=row.key,
        policy=policy,
        outcome=outcome,
    )
