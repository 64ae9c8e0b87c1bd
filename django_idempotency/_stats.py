"""Read-only figures about the records table, for ``idempotency_stats``, the admin and metrics.

Every query here is meant to stay quick on a table of millions of rows: each one is served
by an index of :class:`~django_idempotency.models.IdempotencyRecord` (status, expiry,
``(operation, status)``), and nothing counts the whole table row by row more than once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from django.db import connections
from django.db.models import Count, Min, QuerySet
from django.db.models.functions import Coalesce
from django.utils import timezone

from django_idempotency import crypto
from django_idempotency._policies import names_where
from django_idempotency._vendors import of
from django_idempotency.conf import app_settings
from django_idempotency.models import (
    IdempotencyRecord,
    OutboxMessage,
    OutboxStatus,
    RecordStatus,
    expired_q,
)


@dataclass(frozen=True)
class TableStats:
    """A snapshot of the records table on one database."""

    database: str
    rows: int
    by_status: dict[str, int]
    # ``pg_total_relation_size`` (table, indexes and TOAST) on PostgreSQL; ``None`` elsewhere.
    table_bytes: int | None
    oldest_in_progress_seconds: float | None
    # In progress with a lease that ran out (taken over by the next retry or the recovery job).
    stale_leases: int
    # What the purge would delete now: past the TTL and not held by a live lease.
    expired: int
    # Records under the recovery policy "resume", by status, and those of them in progress
    # with a stale lease: left by the recovery job to their operation's next attempt.
    resumable: dict[str, int]
    resumable_stale: int
    # Completed and failed records sealed with a key ENCRYPTION_KEYS does not hold, by the
    # id of that key: their retries are refused until it is configured again. (Found by
    # reading every stored header set: the one figure here that costs a pass over the table.)
    unreadable_by_key: dict[str, int]
    # Recorded step results sealed with such a key, by its id (another pass, over the steps):
    # a resumable operation's next attempt that reaches one is refused.
    unreadable_steps_by_key: dict[str, int]
    taken_at: datetime = field(repr=False)

    @property
    def unreadable(self) -> int:
        """How many records' outcomes no configured key opens."""
        return sum(self.unreadable_by_key.values())

    @property
    def unreadable_steps(self) -> int:
        """How many recorded step results no configured key opens."""
        return sum(self.unreadable_steps_by_key.values())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form: the timestamp as ISO 8601."""
        data = asdict(self)
        data["taken_at"] = self.taken_at.isoformat()
        data["unreadable"] = self.unreadable
        data["unreadable_steps"] = self.unreadable_steps
        return data


def _alias(using: str | None) -> str:
    return using or app_settings.DATABASE


def records(using: str | None = None) -> Any:
    """The records manager's queryset on the idempotency database (or ``using``)."""
    return IdempotencyRecord.objects.using(_alias(using))


def count_by_status(using: str | None = None) -> dict[str, int]:
    """Rows per status, every status present (zero when none).

    Grouping by ``status`` reads the ``(status, lease_expires_at)`` index only.
    """
    return _by_status(records(using))


def _by_status(queryset: QuerySet[IdempotencyRecord]) -> dict[str, int]:
    counts = dict.fromkeys(RecordStatus.values, 0)
    for status, n in queryset.order_by().values_list("status").annotate(n=Count("*")):
        counts[status] = n
    return counts


def resumable_records(using: str | None = None) -> QuerySet[IdempotencyRecord]:
    """The records of resumable operations (recovery policy ``"resume"``), read through
    their partial index."""
    resumable: QuerySet[IdempotencyRecord] = records(using).filter(
        recovery_policy__in=names_where("resumable")
    )
    return resumable


def resumable_by_status(using: str | None = None) -> dict[str, int]:
    """Resumable records per status, every status present (zero when none)."""
    return _by_status(resumable_records(using))


def oldest_in_progress_seconds(
    using: str | None = None, now: datetime | None = None
) -> float | None:
    """How long ago the oldest ``in_progress`` record was claimed; ``None`` when there is none.

    A record taken over after a stale lease counts from the takeover, which is when its
    current attempt began.
    """
    # MIN(created_at) alone lets PostgreSQL walk the created_at index from the oldest row
    # until it meets an in-progress one: nearly the whole table, as in-progress records are
    # the newest. Wrapping the column hides that index, so the (status, ...) index picks the
    # in-progress rows, usually few, and only those are read.
    oldest: datetime | None = (
        records(using)
        .filter(status=RecordStatus.IN_PROGRESS)
        .aggregate(oldest=Min(Coalesce("created_at", "created_at")))["oldest"]
    )
    if oldest is None:
        return None
    return max(0.0, ((now or timezone.now()) - oldest).total_seconds())


def table_bytes(using: str | None = None) -> int | None:
    """The table's size on disk with its indexes, on PostgreSQL; ``None`` on other databases."""
    alias = _alias(using)
    sql = of(alias).table_bytes_sql
    if sql is None:
        return None
    connection = connections[alias]
    with connection.cursor() as cursor:
        cursor.execute(sql, [connection.ops.quote_name(IdempotencyRecord._meta.db_table)])
        (size,) = cursor.fetchone()
    return int(size)


def collect(using: str | None = None, now: datetime | None = None) -> TableStats:
    """Every figure of ``idempotency_stats`` in one snapshot."""
    now = now or timezone.now()
    qs = records(using)
    by_status = count_by_status(using)
    return TableStats(
        database=_alias(using),
        rows=sum(by_status.values()),
        by_status=by_status,
        table_bytes=table_bytes(using),
        oldest_in_progress_seconds=oldest_in_progress_seconds(using, now),
        stale_leases=qs.filter(status=RecordStatus.IN_PROGRESS, lease_expires_at__lte=now).count(),
        expired=qs.filter(expired_q(now)).count(),
        resumable=resumable_by_status(using),
        resumable_stale=resumable_records(using)
        .filter(status=RecordStatus.IN_PROGRESS, lease_expires_at__lte=now)
        .count(),
        unreadable_by_key=crypto.missing_key_ids(_alias(using)),
        unreadable_steps_by_key=crypto.missing_step_key_ids(_alias(using)),
        taken_at=now,
    )


def operations(using: str | None = None, limit: int = 100) -> list[str]:
    """The distinct operation names, sorted, at most ``limit`` of them.

    On PostgreSQL a recursive query hops through the ``(operation, status)`` index from one
    name to the next (a "loose index scan"), so the cost grows with the number of names, not
    of rows: a plain ``SELECT DISTINCT`` reads every index entry. Other databases get the
    plain query, bounded by ``limit``.
    """
    alias = _alias(using)
    if not of(alias).loose_index_scan:
        names = (
            records(alias)
            .order_by("operation")
            .values_list("operation", flat=True)
            .distinct()[:limit]
        )
        return list(names)
    connection = connections[alias]
    table = connection.ops.quote_name(IdempotencyRecord._meta.db_table)
    sql = f"""
        WITH RECURSIVE ops(operation) AS (
            (SELECT operation FROM {table} ORDER BY operation LIMIT 1)
            UNION ALL
            SELECT (SELECT t.operation FROM {table} t
                    WHERE t.operation > ops.operation ORDER BY t.operation LIMIT 1)
            FROM ops WHERE ops.operation IS NOT NULL
        )
        SELECT operation FROM ops WHERE operation IS NOT NULL LIMIT %s
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, [limit])
        return [row[0] for row in cursor.fetchall()]


# -- the outbox ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutboxStats:
    """A snapshot of the outbox on one database."""

    by_status: dict[str, int]
    # Pending messages already due (the rest are backing off after a failed send).
    due: int
    oldest_pending_seconds: float | None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return asdict(self)


def outbox(using: str | None = None, now: datetime | None = None) -> OutboxStats:
    """Messages by status, how many are due, and the age of the oldest pending one.

    Every figure is read through the ``(status, ...)`` indexes of the outbox.
    """
    from django_idempotency import outbox as relay

    now = now or timezone.now()
    messages = OutboxMessage.objects.using(_alias(using))
    counts = dict.fromkeys(OutboxStatus.values, 0)
    for status, n in messages.order_by().values_list("status").annotate(n=Count("*")):
        counts[status] = n
    return OutboxStats(
        by_status=counts,
        due=messages.filter(status=OutboxStatus.PENDING, available_at__lte=now).count(),
        oldest_pending_seconds=relay.oldest_pending_seconds(using, now),
    )


# -- the keys of enqueue_once -------------------------------------------------------------------


def unique_keys(
    using: str | None = None, limit: int | None = 20, now: datetime | None = None
) -> list[dict[str, Any]]:
    """Which message holds each key of ``outbox.enqueue_once``, newest first (at most
    ``limit``): task, key, message id, the message's status, ``unique_until``, until when
    (a duration), and whether it is live. ``idempotency_stats`` and ``idempotency_audit``
    print it; the admin shows the same per key and per message."""
    from django_idempotency import _unique
    from django_idempotency.models import OutboxUniqueKey

    now = now or timezone.now()
    holders = (
        OutboxUniqueKey.objects.using(_alias(using))
        .select_related("message")
        .order_by("-created_at")
    )
    if limit is not None:
        holders = holders[:limit]
    rows = []
    for holder in holders:
        row = _unique.describe_holder(holder, now)
        try:
            row["message_status"] = holder.message.status
        except OutboxMessage.DoesNotExist:  # a database without the cascade's constraint
            row["message_status"] = None
        rows.append(row)
    return rows


def unique_key_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The text form of :func:`unique_keys`: one aligned line per key."""
    header = ("TASK", "KEY", "MESSAGE", "STATUS", "UNTIL", "HELD")
    cells = [header] + [
        (
            row["task"],
            row["key"],
            row["message"],
            row["message_status"] or "-",
            row["held_until"] or row["unique_until"],
            "live" if row["live"] else "free",
        )
        for row in rows
    ]
    widths = [max(len(str(line[i])) for line in cells) for i in range(len(header))]
    return [
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in cells
    ]
