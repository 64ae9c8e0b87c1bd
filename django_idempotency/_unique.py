"""One live message per (task, key): the engine behind ``outbox.enqueue_once``.

The key is a row of :class:`~django_idempotency.models.OutboxUniqueKey`, unique over
``(task, key)``, written in the enqueue's transaction together with its message, inside a
savepoint: when the insert meets the unique constraint nothing of this enqueue is left.
The database's constraint picks the winner of two enqueues racing in two transactions (the
second waits for the first to commit or roll back), so a rolled-back enqueue never holds a
key. A key row whose message is no longer live is taken over (its row locked, pointed at
the new message) in the same transaction.

Whether a message is live is decided by its ``unique_until`` (the declared options of
:mod:`django_idempotency._policies`) from the message's state and, once it was sent, from
the ``@idempotent_task`` record of its run: a run whose worker died stops holding the key
when its lease runs out, as a claim's would. A task not under ``@idempotent_task()`` has
no such record: its message is written ``run_reported``, and the worker reports the run on
the key's row instead (:func:`run_started`, :func:`run_ended`, from the task frameworks'
signals), with a lease of its own.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db.models import Exists, OuterRef, QuerySet
from django.db.models.sql import InsertQuery
from django.utils import timezone

from django_idempotency import _policies, _storable, _validation, states
from django_idempotency._policies import UniqueUntil
from django_idempotency._store.records import later
from django_idempotency._vendors import of
from django_idempotency.exceptions import TaskAlreadyQueued
from django_idempotency.keys import validate_key
from django_idempotency.models import (
    TASK_ACCOUNT,
    IdempotencyRecord,
    OutboxMessage,
    OutboxStatus,
    OutboxUniqueKey,
)

__all__ = [
    "ON_CONFLICT",
    "TASK_ACCOUNT",
    "Unique",
    "describe_holder",
    "finished",
    "holds",
    "record_identity",
    "record_ttl",
    "records_by_message",
    "run_ended",
    "run_started",
    "runs_known_by",
    "sent_again",
    "task_operation",
    "unique",
    "write_once",
]

#: Set on a function under ``@idempotent_task()`` keyed by the message (tasks.py).
BY_MESSAGE = "idempotent_task_by_message"
#: Set on a function under ``@idempotent_task()``: its ``ttl`` (``None``: the ``TTL`` setting).
RECORD_TTL = "idempotent_task_ttl"
#: The Celery header a message whose run is reported on its key is sent with
#: (``OutboxMessage.run_reported``): the worker's signals report only such runs.
RUN_HEADER = "django_idempotency_run"
#: ``on_conflict``: what an enqueue that meets a live message does.
ON_CONFLICT = ("return", "raise")
# An enqueue that finds the key's row gone, or taken first by another, starts over; this
# bounds it.
_ATTEMPTS = 3


@dataclass(frozen=True)
class Unique:
    """A checked request for uniqueness: the key, when it frees, what a conflict does."""

    key: str
    until: UniqueUntil
    #: For a duration: how long the key is held after the enqueue.
    duration: timedelta | None
    raise_on_conflict: bool


def unique(key: object, unique_until: object, on_conflict: object) -> Unique:
    """Check ``enqueue_once``'s options; ``InvalidKey`` (a ``ValueError``) for a key that is
    not a valid key, ``ValueError`` for an unknown option or a duration of zero or less,
    ``TypeError`` for a value of the wrong type."""
    checked = validate_key(key)
    if isinstance(unique_until, timedelta | int | float) and not isinstance(unique_until, bool):
        # A duration, as ``ttl`` and ``lease`` take it: a timedelta or a number of seconds.
        try:
            duration: timedelta | None = _validation.duration(unique_until)
        except _validation.Invalid as exc:
            raise ValueError(f"enqueue_once(): unique_until {exc}") from None
        until = _policies.DURATION
    elif isinstance(unique_until, str):
        words = _policies.UNIQUE_UNTIL_WORDS
        if unique_until not in words:
            raise ValueError(
                "enqueue_once(): unique_until must be "
                + ", ".join(f'"{word}"' for word in words)
                + f" or a duration; got {unique_until!r}"
            )
        until, duration = _policies.UNIQUE_UNTIL[unique_until], None
    else:
        raise TypeError(
            "enqueue_once(): unique_until must be "
            + ", ".join(f'"{word}"' for word in _policies.UNIQUE_UNTIL_WORDS)
            + " or a duration (a timedelta or a number of seconds);"
            + f" got {_validation.describe(unique_until)}"
        )
    if not isinstance(on_conflict, str) or on_conflict not in ON_CONFLICT:
        raise ValueError(
            f'enqueue_once(): on_conflict must be "return" or "raise"; got {on_conflict!r}'
        )
    return Unique(checked, until, duration, raise_on_conflict=on_conflict == "raise")


def write_once(
    alias: str,
    task: str,
    wanted: Unique,
    build: Callable[[], OutboxMessage],
    run_ttl: timedelta | None = None,
) -> OutboxMessage | uuid.UUID:
    """Write the message ``build()`` makes (unsaved), holding ``(task, wanted.key)``, in the
    current transaction of ``alias``; or, when a live message holds the key, write nothing and
    return its id (``TaskAlreadyQueued`` with ``raise_on_conflict``)."""
    for _attempt in range(_ATTEMPTS):
        now = timezone.now()
        fields = {
            "unique_until": wanted.until.name,
            "held_until": later(now, wanted.duration) if wanted.duration is not None else None,
            "finished_at": None,
            # A takeover forgets the run the previous message reported.
            "started_at": None,
            "lease_expires_at": None,
            "run_id": "",
            "run_ttl": run_ttl if wanted.until.needs_task_record else None,
            "created_at": now,
        }
        # The periodic case first: a live message holds the key, found by one read that
        # takes no lock (a beat enqueuing every minute must not queue up behind another's
        # transaction). Only a takeover locks the row.
        holder = _holder(alias, task, wanted.key, _PLAIN)
        if holder is None:
            message = build()
            key = OutboxUniqueKey(task=task, key=wanted.key, message_id=message.id, **fields)
            if _insert_both(alias, message, key):
                return message
            # Another enqueue took the key first (the constraint waited for its commit).
            holder = _holder(alias, task, wanted.key, _FRESH)
            if holder is None:
                continue
        if holds(alias, holder, now):
            return _conflict(task, holder, wanted)
        holder = _holder(alias, task, wanted.key, _LOCKED)
        if holder is None:
            continue  # its message was deleted meanwhile: the key is free again
        # Taken over meanwhile by another enqueue; or its run, read in a snapshot older
        # than its redelivery's takeover of the run's stale lease, runs again.
        if holds(alias, holder, now, newest=True):
            return _conflict(task, holder, wanted)
        message = build()
        message.save(using=alias, force_insert=True)
        OutboxUniqueKey.objects.using(alias).filter(pk=holder.pk).update(message=message, **fields)
        return message
    raise RuntimeError(f"the key of {task} changed hands {_ATTEMPTS} times during one enqueue")


def _insert_both(alias: str, message: OutboxMessage, key: OutboxUniqueKey) -> bool:
    """Insert the key and its message, or neither when the key is taken: whether they were.

    On PostgreSQL one statement, ``WITH k AS (INSERT <key> ON CONFLICT DO NOTHING RETURNING
    1) INSERT <message> SELECT ... FROM k`` (the key's foreign key is checked at the end of
    the statement, when its message is there); elsewhere both inserts in a savepoint, rolled
    back when the unique constraint refuses the key.
    """
    if not of(alias).insert_on_conflict:
        try:
            with transaction.atomic(using=alias):
                message.save(using=alias, force_insert=True)
                key.save(using=alias, force_insert=True)
        except IntegrityError:
            return False
        return True
    connection = connections[alias]
    key_sql, key_params = _insert_sql(connection, key)
    message_sql, message_params = _insert_sql(connection, message)
    into, values = message_sql.split(" VALUES ", 1)
    unique = ", ".join(connection.ops.quote_name(c) for c in ("task", "key"))
    sql = (
        f"WITH k AS ({key_sql} ON CONFLICT ({unique}) DO NOTHING RETURNING 1) "
        f"{into} SELECT {values[1:-1]} FROM k"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*key_params, *message_params])
        inserted: bool = cursor.rowcount == 1
    if inserted:
        message._state.adding, message._state.db = False, alias
    return inserted


def _insert_sql(connection: Any, obj: Any) -> tuple[str, list[Any]]:
    # The ORM's own INSERT of ``obj`` (its values prepared as a save would), one row.
    fields = [
        f
        for f in type(obj)._meta.concrete_fields
        if not (f.primary_key and getattr(obj, f.attname) is None)
    ]
    query = InsertQuery(type(obj))
    query.insert_values(fields, [obj])
    ((sql, params),) = query.get_compiler(connection=connection).as_sql()
    return sql, list(params)


def _conflict(task: str, holder: OutboxUniqueKey, wanted: Unique) -> uuid.UUID:
    if wanted.raise_on_conflict:
        raise TaskAlreadyQueued(
            f"a live message of {task} holds this key: {holder.message_id}", holder.message_id
        )
    return holder.message_id


# How the key's row is read. PostgreSQL and SQLite read the newest committed row with a
# plain read (READ COMMITTED; one writer). MariaDB's REPEATABLE READ snapshot may be older:
# after the unique constraint refused an insert (the enqueue holds a shared lock on the
# row then), the row is read in share mode, which sees the newest and waits for no one
# else's shared lock; a first read locks nothing (a locking read of a missing row would
# lock the gap, and two enqueues inserting into it would deadlock).
_PLAIN, _FRESH, _LOCKED = "plain", "fresh", "locked"


def _holder(alias: str, task: str, key: str, read: str) -> OutboxUniqueKey | None:
    # ``_LOCKED``: two enqueues taking over one freed key take it one after the other.
    holders = OutboxUniqueKey.objects.using(alias).filter(task=task, key=key)
    if read == _LOCKED:
        return holders.select_for_update().first()
    fresh = of(alias).fresh_read if read == _FRESH else ""
    if fresh:
        found = list(_newest(holders, fresh))
        return found[0] if found else None
    return holders.first()


def _newest(queryset: Any, clause: str) -> Any:
    """``queryset`` read with ``clause`` (MariaDB's ``LOCK IN SHARE MODE``): the newest
    committed rows."""
    sql, params = queryset.query.get_compiler(queryset.db).as_sql()
    return queryset.model.objects.raw(f"{sql}{clause}", params, using=queryset.db)


def holds(alias: str, holder: OutboxUniqueKey, now: datetime, newest: bool = False) -> bool:
    """Whether ``holder``'s message still holds its key at ``now`` (is live). ``newest``:
    its message and its run read as last committed, whatever the caller's snapshot (a
    takeover's decision; the first look may see an older state, which a takeover
    reads again)."""
    until = _policies.unique_until_of(holder.unique_until)
    if until.by_time:
        return holder.held_until is not None and holder.held_until > now
    messages = OutboxMessage.objects.using(alias).filter(pk=holder.message_id)
    fresh = of(alias).newest_read if newest else of(alias).fresh_read
    state = ("status", "sent_at", "run_reported")
    if fresh:  # the newest state, not the snapshot's
        found = [
            (m.status, m.sent_at, m.run_reported) for m in _newest(messages.only(*state), fresh)
        ]
        status, sent_at, reported = found[0] if found else (None, None, False)
    else:
        status, sent_at, reported = messages.values_list(*state).first() or (None, None, False)
    if status == OutboxStatus.PENDING:
        # Not sent yet, or to be sent again: a run of it that ended before the relay's
        # batch rolled back (its process killed before the commit) does not free it.
        return True
    if holder.finished_at is not None:
        return False  # its run ended (with an error, or reported on the key)
    if status == OutboxStatus.DEAD:
        return not until.frees_at_finish
    if reported:
        # The worker reports the run on the key's row (read locked for a takeover, so as
        # last committed): started, then ended (``finished_at``, above) or its lease ran out.
        if holder.started_at is None or _ran_out_before_sent(holder.lease_expires_at, sent_at):
            return _not_started_yet(holder, sent_at, now)
        if until.frees_at_start:
            return False
        return holder.lease_expires_at is not None and holder.lease_expires_at > now
    account, operation, key = record_identity(holder.task, holder.message_id)
    runs = IdempotencyRecord.objects.using(alias).filter(
        account=account, operation=operation, key=key
    )
    run: Mapping[str, Any] | None
    if newest and fresh:
        rows = list(_newest(runs.only("status", "lease_expires_at"), fresh))
        run = (
            {"status": rows[0].status, "lease_expires_at": rows[0].lease_expires_at}
            if rows
            else None
        )
    else:
        run = runs.values("status", "lease_expires_at").first()
    if run is None or (sent_at is not None and states.STALE_LEASE.test(run, now=sent_at)):
        # Not started; or its run's lease had run out when the relay last sent it: the
        # run of an earlier sending, whose worker died (see _ran_out_before_sent).
        return _not_started_yet(holder, sent_at, now)
    if until.frees_at_start:
        return False
    # Started: live while it runs under a live lease; finished, or its worker died and
    # its lease ran out, it no longer holds the key.
    return states.LIVE_LEASE.test(run, now=now)


def _ran_out_before_sent(lease_expires_at: datetime | None, sent_at: datetime | None) -> bool:
    # A run whose lease had run out when the relay last sent its message is an earlier
    # sending's, whose worker died: the message was made pending again (a requeue) and sent
    # anew, and that delivery waits for a worker of its own.
    return lease_expires_at is not None and sent_at is not None and lease_expires_at <= sent_at


def _not_started_yet(holder: OutboxUniqueKey, sent_at: datetime | None, now: datetime) -> bool:
    # Sent, and no worker started it yet; unless that was longer ago than the worker keeps
    # its record of a run (the task's ttl; for a run reported on the key, the ``TTL``
    # setting): then its record was purged, or the broker lost the message. (A purged
    # message with a purged record: free.)
    return sent_at is not None and (holder.run_ttl is None or sent_at + holder.run_ttl > now)


def run_started(
    alias: str,
    lease: timedelta,
    *,
    message_id: object = None,
    run_id: str | None = None,
    reported_only: bool = False,
) -> bool:
    """A worker starts the run of a message whose run is reported on its key (found by the
    message's id, or by the ``run_id`` a task framework knows it by): the key's row says
    so, and holds the key until ``lease`` from now unless :func:`run_ended` says first.
    Whether such a key was there (one ``UPDATE``, in autocommit or in the caller's
    transaction). A key taken over by a newer message is not this run's any more.
    ``reported_only``: only if the message was written ``run_reported`` (a run that may be
    another message's, such as a Celery replacement under its id)."""
    keys = _reported_keys(alias, message_id, run_id, reported_only)
    if keys is None:
        return False
    now = timezone.now()
    return keys.update(started_at=now, lease_expires_at=later(now, lease)) > 0


def sent_again(alias: str, message_ids: Sequence[uuid.UUID]) -> None:
    """Messages the relay is about to send again (made pending after they were sent, by an
    ``UPDATE`` or the admin): what an earlier sending's run reported on their keys (its
    start, its lease, its end, its run id) is no news of the delivery to come, and is
    forgotten in the relay's transaction, before the hand-over (which a backend that runs
    the task at once reports into). A key a newer message took over is not theirs."""
    if message_ids:
        OutboxUniqueKey.objects.using(alias).filter(message_id__in=message_ids).update(
            started_at=None, lease_expires_at=None, finished_at=None, run_id=""
        )


def run_ended(
    alias: str,
    *,
    message_id: object = None,
    run_id: str | None = None,
    reported_only: bool = False,
) -> None:
    """The run :func:`run_started` reported has ended (succeeded or failed; not a retry
    to come): its key is free."""
    keys = _reported_keys(alias, message_id, run_id, reported_only)
    if keys is not None:
        keys.update(finished_at=timezone.now())


#: The most parameters one statement of :func:`runs_known_by` takes (PostgreSQL's limit; a
#: database's own lower one wins).
_MOST_PARAMETERS = 65535


def runs_known_by(alias: str, runs: Sequence[tuple[uuid.UUID, str]]) -> None:
    """For each ``(message id, run id)`` of a message whose run is reported on its key, the
    id its worker will know the run by, written on the key: one ``UPDATE`` for them all
    (or for each part of them one statement's parameters hold), in the caller's
    transaction. Written out rather than through ``Case(When(...))``, which the ORM
    resolves as a filter per message. An empty run id (a backend's that gave none) is
    no run's: its key is left without one, held until its ``TTL``."""
    runs = [(message_id, known) for message_id, known in runs if known]
    if not runs:
        return
    connection = connections[alias]
    meta = OutboxUniqueKey._meta
    quote = connection.ops.quote_name
    message, run_id = meta.get_field("message"), meta.get_field("run_id")
    assert message.column
    assert run_id.column
    table, by, column = quote(meta.db_table), quote(message.column), quote(run_id.column)
    most = min(connection.features.max_query_params or _MOST_PARAMETERS, _MOST_PARAMETERS)
    size = max(most // 3, 1)  # three a message: its id twice, its run id
    for start in range(0, len(runs), size):
        part = [
            (message.get_db_prep_value(message_id, connection), known)
            for message_id, known in runs[start : start + size]
        ]
        cases = " ".join(["WHEN %s THEN %s"] * len(part))
        placeholders = ", ".join(["%s"] * len(part))
        params: list[Any] = [value for pair in part for value in pair]
        params += [message_id for message_id, _ in part]
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET {column} = CASE {by} {cases} ELSE {column} END "
                f"WHERE {by} IN ({placeholders})",
                params,
            )


def _reported_keys(
    alias: str, message_id: object, run_id: str | None, reported_only: bool = False
) -> QuerySet[OutboxUniqueKey] | None:
    keys = OutboxUniqueKey.objects.using(alias).filter(finished_at=None)
    if run_id is not None:
        # An empty id (a backend's that gave none) is no run's: it reaches no key.
        return keys.filter(run_id=run_id) if run_id else None
    try:
        keys = keys.filter(message_id=uuid.UUID(str(message_id)))
    except ValueError:
        return None
    if reported_only:
        reported = OutboxMessage.objects.filter(pk=OuterRef("message_id"), run_reported=True)
        keys = keys.filter(Exists(reported))
    return keys


def records_by_message(func: object) -> bool:
    """Whether ``func`` is under ``@idempotent_task()`` keyed by the message (no ``key=``):
    its record then tells when a message's run started and finished."""
    return bool(getattr(func, BY_MESSAGE, False))


def record_ttl(func: object) -> timedelta | None:
    """How long the worker keeps its record of a run of ``func`` (under
    ``@idempotent_task()``): its ``ttl``, else the ``TTL`` setting; ``None`` for another."""
    from django_idempotency.conf import app_settings

    if not hasattr(func, RECORD_TTL):
        return None
    ttl: timedelta | None = getattr(func, RECORD_TTL)
    return ttl or app_settings.TTL


def record_identity(task: str, message_id: uuid.UUID) -> tuple[str, str, str]:
    """The ``(account, operation, key)`` of the ``@idempotent_task`` record of a message's
    run, as the worker stores it."""
    return TASK_ACCOUNT, _storable.storable_name(task_operation(task)), str(message_id)


def task_operation(task: str) -> str:
    """The operation of an ``@idempotent_task`` record: ``task:<task name>``."""
    return f"task:{task}"


def finished(alias: str, message_id: object, *, stopped: bool = False) -> None:
    """A worker's run of a message ended with an error: its key (if it has one) is free.

    Unless another delivery of the message holds its run's record under a live lease (it
    took this run's stale lease over, and runs still): that run holds the key now, and frees
    it when it ends. A success needs nothing: its record says so. ``stopped``: the run was
    told to stop and may still go on; a run reported on the key keeps it for its lease."""
    try:
        pk = uuid.UUID(str(message_id))
    except ValueError:
        return
    keys = OutboxUniqueKey.objects.using(alias).filter(message_id=pk, finished_at=None)
    holder = keys.only("task").first()
    if holder is None:
        return
    now = timezone.now()
    account, operation, key = record_identity(holder.task, pk)
    running = IdempotencyRecord.objects.using(alias).filter(
        states.live_lease_q(now), account=account, operation=operation, key=key
    )
    freed = keys.filter(pk=holder.pk).exclude(Exists(running))
    if stopped:
        freed = freed.exclude(started_at__isnull=False, lease_expires_at__gt=now)
    freed.update(finished_at=now)


def describe_holder(holder: OutboxUniqueKey, now: datetime | None = None) -> dict[str, Any]:
    """What the statistics and the audit say of a key: which message holds it, until when,
    and whether it is live."""
    alias = holder._state.db or DEFAULT_DB_ALIAS
    return {
        "task": holder.task,
        "key": holder.key,
        "message": str(holder.message_id),
        "unique_until": holder.unique_until,
        "held_until": holder.held_until.isoformat() if holder.held_until else None,
        "live": holds(alias, holder, now or timezone.now()),
    }
