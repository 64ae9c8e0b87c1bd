"""The transactional outbox: a message commits with the business state, a relay sends it.

``transaction.on_commit`` loses a message when the process dies between the commit and the
send. :func:`enqueue` instead writes an :class:`~django_idempotency.models.OutboxMessage`
in the caller's transaction, and :func:`relay` (``manage.py relay_outbox``, the Celery task
``django_idempotency.relay_outbox``) sends it afterwards: at least once, never before the
commit, never lost after it.

The relay takes due messages in batches with ``SELECT ... FOR UPDATE SKIP LOCKED``, so
several relays share the work without waiting on each other, sends each one with the
sender (``OUTBOX_SENDER``), and records every outcome in the batch's transaction. A relay
killed after a send and before that transaction commits sends the message again: the
message id is the task id, so a consumer under ``@idempotent_task()`` runs once.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models import QuerySet
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency import _storable, _unique
from django_idempotency._relay import (
    MAX_ERROR_CHARS,
    RelayResult,
    backoff,
    drain,
    error_text,
    relay,
    relay_batch,
)
from django_idempotency._senders import (
    Report,
    Sender,
    Undeliverable,
    UnknownTask,
    Unreadable,
    configured_sender,
)
from django_idempotency._validation import MAX_DURATION
from django_idempotency._vendors import of
from django_idempotency._wakeup import CHANNEL
from django_idempotency.conf import app_settings, sender_reports_runs
from django_idempotency.models import OutboxMessage, OutboxStatus

logger = logging.getLogger("django_idempotency")

__all__ = [
    "MAX_ERROR_CHARS",
    "RelayResult",
    "Report",
    "Sender",
    "Target",
    "Undeliverable",
    "UnknownTask",
    "Unreadable",
    "backoff",
    "configured_sender",
    "drain",
    "enqueue",
    "enqueue_once",
    "error_text",
    "notify",
    "oldest_pending_seconds",
    "pending_count",
    "register_task_kind",
    "relay",
    "relay_batch",
    "requeue",
    "target_of",
    "task_name",
    "write",
    "write_once",
]


# -- enqueue ------------------------------------------------------------------------------------


def task_name(task: object) -> str:
    """The registered name of ``task``: a Celery task (its ``name``) or the name itself."""
    if isinstance(task, Mapping):
        # A Celery signature (a dict) names its task but carries its own arguments and
        # options, which the message would not send: the task would run without them.
        raise TypeError(
            f"enqueue() takes a task and its arguments, not a Celery signature: {task!r}; "
            "write enqueue(task, *args, **kwargs)"
        )
    name = task if isinstance(task, str) else getattr(task, "name", None)
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"enqueue() needs a Celery task or a task name, not {task!r}")
    problem = _storable.text_problem(name)
    if problem is not None:
        raise TypeError(f"a task name that {problem} cannot be stored: {name!r}")
    if name != name.strip():
        # MariaDB's collations ignore trailing spaces: "t " would hold the keys of "t".
        raise ValueError(f"a task name has no whitespace at either end: {name!r}")
    max_length = OutboxMessage._meta.get_field("task").max_length
    if max_length is not None and len(name) > max_length:
        raise ValueError(f"a task name has at most {max_length} characters")
    return name


def enqueue(task: object, /, *args: Any, **kwargs: Any) -> uuid.UUID:
    """Write one message in the current transaction of the idempotency database.

    ``task`` is a Celery task or its registered name, or a task of Django's Tasks framework
    on ``tasks_backend.OutboxBackend`` (written as its ``enqueue()`` writes it; a task on
    another backend raises ``TypeError``); ``args`` and ``kwargs`` must be JSON
    that every supported database stores unchanged (no NUL character, no lone surrogate,
    integers within 64 bits, at most 31 levels of nesting; on MariaDB and MySQL, within
    one statement the server takes: ``max_allowed_packet``); otherwise
    ``TypeError`` before any SQL runs, nothing written, the transaction intact. Outside
    ``transaction.atomic`` on the ``DATABASE`` alias it raises
    ``TransactionManagementError``: a message written in autocommit would be sent even if
    the caller's work rolled back. On PostgreSQL a
    ``NOTIFY`` in the same transaction wakes the relays when it commits. Returns the
    message id, which is also the task id the relay sends it with.
    """
    target = target_of(task)
    return write(target.name, args, kwargs, target.delivery).id


def enqueue_once(
    key: str,
    task: object,
    /,
    *args: Any,
    unique_until: str | timedelta | float = "finished",
    on_conflict: str = "return",
    **kwargs: Any,
) -> uuid.UUID:
    """Enqueue ``task`` as ``enqueue`` does, unless a live message of the same task
    holds ``key``: then nothing is written and that message's id is returned
    (``on_conflict="return"``), or ``django_idempotency.TaskAlreadyQueued`` carrying it is
    raised (``on_conflict="raise"``).

    ``task`` is a Celery task, its registered name, or a task of Django's Tasks framework
    on ``tasks_backend.OutboxBackend``. The key (1 to 255 printable ASCII characters, as a
    header key) is scoped by the task's name. A message holds its key while it waits to be
    sent and then, by ``unique_until``: ``"started"`` until a worker started it,
    ``"finished"`` until its run succeeded or failed (or its worker died and the run's
    lease ran out, or the message is dead), a duration (a ``timedelta``, or a number of
    seconds as ``ttl`` takes it) for that long after the enqueue. ``"started"`` and
    ``"finished"`` read the worker's record of the run for a task under
    ``@idempotent_task()`` (keyed by the message); for any other task, the run its worker
    reports on the key (Celery's ``task_prerun``/``task_postrun``, the Tasks
    framework's ``task_started``/``task_finished``), held at most its lease (the task's
    hard time limit under Celery's prefork pool, else the ``LEASE`` setting) after it
    started; only the default ``OUTBOX_SENDER`` asks for such a report (another raises
    ``ValueError``).

    The key is written with the message in the caller's transaction: two enqueues racing
    in two transactions give one message, and an enqueue rolled back leaves the key free.
    Returns the id of the new message, or of the live one.
    """
    wanted = _unique.unique(key, unique_until, on_conflict)
    target = target_of(task)
    # A task under @idempotent_task() keyed by the message tells when its run started and
    # ended by its record; any other task's worker reports its run on the key's row.
    reported = wanted.until.needs_task_record and not _unique.records_by_message(target.function)
    if reported and target.delivery is None and not sender_reports_runs():
        raise ValueError(
            f"enqueue_once(unique_until={unique_until!r}) of {target.name!r} needs the worker "
            "to report the run, which only the default OUTBOX_SENDER (Celery's) asks for; "
            "put the task under @idempotent_task(), or give a timedelta"
        )
    run_ttl = app_settings.TTL if reported else _unique.record_ttl(target.function)
    if run_ttl is not None and target.run_after is not None:
        # No worker runs it before run_after: a run's record is missing until then too.
        # (At most the longest duration a setting takes: the hold's end, sent_at plus
        # run_ttl, stays a datetime for a run_after on the calendar's last day.)
        now, after = timezone.now(), target.run_after
        if timezone.is_aware(after) and timezone.is_naive(now):  # USE_TZ = False
            after = timezone.make_naive(after)
        run_ttl += min(max(after - now, timedelta(0)), MAX_DURATION)
    written = write_once(target.name, args, kwargs, target.delivery, wanted, run_ttl, reported)
    return written.id if isinstance(written, OutboxMessage) else written


@dataclass(frozen=True)
class Target:
    """What the outbox writes for a task: its name, for a task framework's message the
    ``delivery`` its sender reads, and the function a worker runs (for ``enqueue_once``)."""

    name: str
    delivery: dict[str, Any] | None = None
    function: object = None
    #: No worker runs the message before this moment (a task's ``run_after``).
    run_after: datetime | None = None


#: ``recognize(task) -> Target | None``, registered by the task frameworks whose tasks the
#: outbox carries besides Celery's (``tasks_backend`` registers Django's Tasks framework).
_KINDS: list[Callable[[object], Target | None]] = []


def register_task_kind(recognize: Callable[[object], Target | None]) -> None:
    """Let :func:`enqueue_once` take another framework's tasks: ``recognize(task)`` answers
    the :class:`Target` of a task it knows, else ``None``."""
    if recognize not in _KINDS:
        _KINDS.append(recognize)


def target_of(task: object) -> Target:
    """The :class:`Target` of ``task``: a registered framework's, a Celery task's (its
    ``name``, its function ``run``), or a task name's."""
    for recognize in _KINDS:
        found = recognize(task)
        if found is not None:
            return found
    return Target(
        task_name(task), None, None if isinstance(task, str) else getattr(task, "run", None)
    )


def write(
    name: str,
    args: tuple[Any, ...] | list[Any],
    kwargs: dict[str, Any],
    delivery: dict[str, Any] | None = None,
) -> OutboxMessage:
    """The message behind :func:`enqueue` and the Tasks backend's ``enqueue``, written in
    the current transaction of the idempotency database, with the same refusals."""
    alias, build = _prepared(name, args, kwargs, delivery)
    message = build()
    message.save(using=alias, force_insert=True)
    notify(alias)
    return message


def write_once(
    name: str,
    args: tuple[Any, ...] | list[Any],
    kwargs: dict[str, Any],
    delivery: dict[str, Any] | None,
    wanted: _unique.Unique,
    run_ttl: timedelta | None = None,
    run_reported: bool = False,
) -> OutboxMessage | uuid.UUID:
    """:func:`write` holding ``wanted.key``: the new message, or the id of the live message
    that holds the key (nothing written). ``run_reported``: the worker reports the
    message's run on the key's row (a task whose record does not tell)."""
    alias, build = _prepared(name, args, kwargs, delivery, run_reported)
    written = _unique.write_once(alias, name, wanted, build, run_ttl)
    if isinstance(written, OutboxMessage):
        notify(alias)
    return written


def _prepared(
    name: str,
    args: tuple[Any, ...] | list[Any],
    kwargs: dict[str, Any],
    delivery: dict[str, Any] | None,
    run_reported: bool = False,
) -> tuple[str, Callable[[], OutboxMessage]]:
    # Every refusal before any SQL runs; then what makes the message (unsaved).
    task_name(name)  # a task framework's name too (a module path longer than the column)
    alias = app_settings.DATABASE
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            f"enqueue() must run inside transaction.atomic(using={alias!r}), so that the "
            "message commits or rolls back with the work it belongs to"
        )
    # Stored as JSON gives them back, so the sender hands on exactly what was checked.
    positional, sent = _storable.json_checked(list(args), "the arguments of an outbox message")
    named, more = _storable.json_checked(dict(kwargs), "the keyword arguments of an outbox message")
    vendor = of(alias)
    if vendor.packet_limit_sql is not None:  # a server that caps a statement's size
        # Sent, the message would make the server drop the connection: in a protected
        # body, a lost connection that a retry runs again.
        limit = vendor.statement_limit(connection, b"", sent + more)
        if limit is not None:
            raise TypeError(
                f"the arguments of an outbox message ({len(sent) + len(more)} bytes as "
                f"JSON) are too large for one statement the idempotency database takes "
                f"({limit} bytes: max_allowed_packet)"
            )

    def build() -> OutboxMessage:
        now = timezone.now()
        return OutboxMessage(
            task=name,
            args=positional,
            kwargs=named,
            available_at=now,
            created_at=now,
            delivery=delivery or {},
            run_reported=run_reported,
        )

    return alias, build


def notify(alias: str) -> None:
    """Wake the listening relays when the current transaction commits (PostgreSQL only)."""
    sql = of(alias).notify_sql
    if sql is not None:
        with connections[alias].cursor() as cursor:
            cursor.execute(sql, [CHANNEL])


# -- operator actions ---------------------------------------------------------------------------


def requeue(queryset: QuerySet[OutboxMessage]) -> int:
    """Make the dead messages of ``queryset`` pending again, due now, with no attempts.

    The admin's "requeue" action. Messages in another state are left alone. Their last
    error is kept until the next attempt. Returns how many were requeued.
    """
    alias = queryset.db
    with transaction.atomic(using=alias):
        count = queryset.filter(status=OutboxStatus.DEAD).update(
            status=OutboxStatus.PENDING, attempts=0, available_at=timezone.now()
        )
        if count:
            notify(alias)
    return int(count)


def pending_count(using: str | None = None) -> int:
    """Messages waiting to be sent (due or backing off)."""
    alias = using or app_settings.DATABASE
    return OutboxMessage.objects.using(alias).filter(status=OutboxStatus.PENDING).count()


def oldest_pending_seconds(using: str | None = None, now: datetime | None = None) -> float | None:
    """How long the oldest pending message has waited; ``None`` when none is pending."""
    alias = using or app_settings.DATABASE
    oldest = (
        OutboxMessage.objects.using(alias)
        .filter(status=OutboxStatus.PENDING)
        .order_by("created_at")
        .values_list("created_at", flat=True)
        .first()
    )
    if oldest is None:
        return None
    return max(0.0, ((now or timezone.now()) - oldest).total_seconds())
