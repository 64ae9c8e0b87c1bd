"""The batched purge: expired records, old audit records and sent outbox messages.

One implementation behind ``IdempotencyRecord.objects.delete_expired()``, which the
``purge_idempotency`` command, the Celery task and the admin action all reach through
:func:`django_idempotency.maintenance.purge_expired`. It is given the querysets to purge and
imports no model, so the models can offer it as a manager method without an import cycle.

Everything is bounded: each batch is one short transaction, its size follows a time budget
under the configured ceiling, and a run stops after ``max_batches`` batches per table.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from django.db import connections, models, transaction
from django.db.models import QuerySet

from django_idempotency import _retry, _validation, signals
from django_idempotency._vendors import of
from django_idempotency.conf import app_settings

Progress = Callable[[int, int], None]

#: Why a record left the deduplication window, stored on its audit copy.
PURGED = "purged"

# What one batch aims to take, and the smallest batch it shrinks to meanwhile: on a busy
# server a fixed size cannot hold a bound on how long a batch holds its row locks.
BATCH_BUDGET_SECONDS = 0.05
MIN_BATCH = 100


@dataclass
class PurgeResult:
    """What one purge run did (or, with ``dry_run``, would do)."""

    deleted: int = 0
    batches: int = 0
    archived: int = 0
    audit_deleted: int = 0
    audit_batches: int = 0
    # Sent outbox messages past OUTBOX_RETENTION.
    outbox_deleted: int = 0
    outbox_batches: int = 0
    longest_batch_seconds: float = 0.0
    dry_run: bool = False
    # False when ``max_batches`` stopped a table before it was done: more may remain.
    complete: bool = True


@dataclass(frozen=True)
class Archive:
    """How a batch of records is copied to the audit trail before it is deleted."""

    #: Copies the records of a queryset (the portable path: ``INSERT ... SELECT``).
    copy: Callable[[QuerySet[Any]], Any]
    #: ``INSERT INTO <audit> (<columns>, archived_at, reason)`` for a connection.
    insert_sql: Callable[[Any], str]
    #: The record table's columns the copy takes, in the order of ``insert_sql``.
    columns: tuple[str, ...]
    #: The archive time and the reason, after the columns.
    params: tuple[Any, ...]


@dataclass(frozen=True)
class _Table:
    """One table's part of a run: what to delete, in which order, and where its figures go.

    ``select`` gives the rows to delete; it is called again in every batch's transaction, so
    a selection that reads the live state (the outbox's running runs) reads it fresh."""

    select: Callable[[], QuerySet[Any]]
    order: str
    rows_field: str
    batches_field: str
    archive: Archive | None = None


def purge(
    *,
    records: QuerySet[Any],
    audits: QuerySet[Any],
    outbox: Callable[[], QuerySet[Any]],
    archive: Archive | None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> PurgeResult:
    """Delete ``records`` (copying each batch with ``archive`` first, in the same
    transaction, when it is given), then ``audits``, then what ``outbox()`` selects (called
    in each of its batches' transactions), in bounded batches.

    Each batch is one short transaction; on PostgreSQL one ``DELETE ... WHERE id IN (SELECT
    ... LIMIT n FOR UPDATE SKIP LOCKED)``, so concurrent purgers and live claims never wait on
    each other for more than one batch. ``batch_size`` (default ``PURGE_BATCH_SIZE``) is a
    ceiling: a batch slower than 50 ms halves the next one (down to 100 rows), a batch well
    inside it doubles the next one back. ``max_batches`` (default ``PURGE_MAX_BATCHES``)
    bounds each table separately. ``progress(batches, rows)`` is called after every batch
    with the run's running totals. Sends ``records_purged`` unless ``dry_run``.
    """
    size = _validation.counted_argument("batch_size", batch_size) or app_settings.PURGE_BATCH_SIZE
    limit = _validation.counted_argument("max_batches", max_batches)
    limit = limit if limit is not None else app_settings.PURGE_MAX_BATCHES
    tables = (
        _Table(lambda: records, "expires_at", "deleted", "batches", archive),
        _Table(lambda: audits, "archived_at", "audit_deleted", "audit_batches"),
        _Table(outbox, "sent_at", "outbox_deleted", "outbox_batches"),
    )
    result = PurgeResult(dry_run=dry_run)
    for table in tables:
        if dry_run:
            rows, batches, complete = _count(table.select(), size, limit)
        else:
            rows = batches = 0
            run = functools.partial(_delete_batch, records.db, table)
            for deleted, seconds in budgeted_batches(run, size, limit):
                rows, batches = rows + deleted, batches + 1
                setattr(result, table.rows_field, rows)
                setattr(result, table.batches_field, batches)
                result.longest_batch_seconds = max(result.longest_batch_seconds, seconds)
                if progress is not None:
                    progress(_total(result, "batches"), _total(result, "deleted"))
            complete = limit is None or batches < limit
        setattr(result, table.rows_field, rows)
        setattr(result, table.batches_field, batches)
        result.complete = result.complete and complete
    if dry_run:
        return result
    result.archived = result.deleted if archive is not None else 0
    if signals.records_purged.has_listeners(records.model):
        signals.records_purged.send(
            sender=records.model,
            count=result.deleted,
            audit=result.audit_deleted,
            outbox=result.outbox_deleted,
        )
    return result


def _total(result: PurgeResult, figure: str) -> int:
    if figure == "batches":
        return result.batches + result.audit_batches + result.outbox_batches
    return result.deleted + result.audit_deleted + result.outbox_deleted


def _count(candidates: QuerySet[Any], size: int, limit: int | None) -> tuple[int, int, bool]:
    total = candidates.count()
    batches = math.ceil(total / size)
    if limit is not None and batches > limit:
        return limit * size, limit, False
    return total, batches, True


def budgeted_batches(
    run: Callable[[int], int], size: int, limit: int | None
) -> Iterator[tuple[int, float]]:
    """Call ``run(n)`` batch after batch; yields each batch's rows and duration.

    ``run(n)`` handles at most ``n`` rows in one short transaction and returns how many it
    handled; a short batch is the last one. It is run again on a deadlock or serialization
    failure (:func:`_retry.retrying`), so it must change nothing outside its transaction
    before that commits. ``size`` is a ceiling: a batch slower than ``BATCH_BUDGET_SECONDS``
    halves the next one (down to ``MIN_BATCH``), one well inside it doubles the next one
    back. ``limit``: at most that many batches. The purge and the key rotation
    (:func:`django_idempotency.crypto.rotate`) batch with this.
    """
    taken, current = 0, size
    while limit is None or taken < limit:
        started = time.monotonic()
        rows = _retry.retrying(functools.partial(run, current))
        if rows == 0:
            return
        taken += 1
        seconds = time.monotonic() - started
        yield rows, seconds
        # A short batch means the rest is gone, or locked by a concurrent transaction that
        # will change it (for the purge: another purger that deletes it): this run is done.
        if rows < current:
            return
        if seconds > BATCH_BUDGET_SECONDS:
            current = max(min(size, MIN_BATCH), current // 2)
        elif seconds < BATCH_BUDGET_SECONDS / 4:
            current = min(size, current * 2)


def _delete_batch(alias: str, table: _Table, size: int) -> int:
    features = connections[alias].features
    shape = of(alias).purge_batch
    with transaction.atomic(using=alias):
        candidates = table.select()  # read in this batch's transaction
        pick = candidates.select_for_update(
            skip_locked=features.has_select_for_update_skip_locked
        ).order_by(table.order)
        if shape == "statement":
            return _postgres_batch(candidates.model, pick, size, table.archive)
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
        if table.archive is not None:
            table.archive.copy(batch)
        if shape == "by key":
            return _mysql_delete(candidates.model, alias, ids)
        # The model's own rows: the ORM's total counts the rows it cascaded to (steps) too.
        _, by_model = batch.delete()
        return int(by_model.get(candidates.model._meta.label, 0))


def _mysql_delete(model: type[models.Model], alias: str, ids: list[Any]) -> int:
    # One primary-key lookup per row. A single DELETE ... IN (...) is planned by cost:
    # InnoDB may scan the whole primary key, locking every row it meets, and so wait for
    # rows that live claims (or the other purger) hold; a lookup touches only its own row.
    connection = connections[alias]
    quote = connection.ops.quote_name
    table, pk = quote(model._meta.db_table), quote(str(model._meta.pk.column))
    deleted = 0
    with connection.cursor() as cursor:
        for pk_value in ids:
            cursor.execute(f"DELETE FROM {table} WHERE {pk} = %s", [pk_value])
            deleted += max(int(cursor.rowcount), 0)
    return deleted


def _postgres_batch(
    model: type[models.Model], pick: QuerySet[Any], size: int, archive: Archive | None
) -> int:
    # One statement: pick (skipping rows another transaction holds), delete, and with the
    # audit trail on, copy what was deleted from the DELETE's RETURNING rows.
    #
    # The pick is a MATERIALIZED CTE, run once. Written as ``pk IN (SELECT ... LIMIT n FOR
    # UPDATE SKIP LOCKED)``, PostgreSQL may plan a nested loop that runs the subquery again
    # for every row of the table; each run skips the rows this statement has already deleted
    # and locks the next n, and the one statement deletes every expired row at once.
    connection = connections[pick.db]
    quote = connection.ops.quote_name
    ids_sql, params = pick.values("pk")[:size].query.get_compiler(pick.db).as_sql()
    params = tuple(params)
    table = quote(model._meta.db_table)
    pk = quote(str(model._meta.pk.column))
    batch = f"batch ({pk}) AS MATERIALIZED ({ids_sql})"
    delete = f"DELETE FROM {table} WHERE {pk} IN (SELECT {pk} FROM batch)"
    if archive is None:
        delete = f"WITH {batch} {delete}"
    else:
        columns = ", ".join(quote(c) for c in archive.columns)
        delete = (
            f"WITH {batch}, gone AS ({delete} RETURNING {columns})"
            f" {archive.insert_sql(connection)} SELECT {columns}, %s, %s FROM gone"
        )
        params += archive.params
    with connection.cursor() as cursor:
        cursor.execute(delete, params)
        return max(int(cursor.rowcount), 0)
