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
from datetime import datetime
from typing import Any

from django.db import connections, transaction
from django.db.models import QuerySet
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency import _storable
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
from django_idempotency._wakeup import CHANNEL
from django_idempotency.conf import app_settings
from django_idempotency.models import OutboxMessage, OutboxStatus

logger = logging.getLogger("django_idempotency")

__all__ = [
    "MAX_ERROR_CHARS",
    "RelayResult",
    "Report",
    "Sender",
    "Undeliverable",
    "UnknownTask",
    "Unreadable",
    "backoff",
    "configured_sender",
    "drain",
    "enqueue",
    "error_text",
    "notify",
    "oldest_pending_seconds",
    "pending_count",
    "relay",
    "relay_batch",
    "requeue",
    "task_name",
    "write",
]


# -- enqueue ------------------------------------------------------------------------------------


def task_name(task: object) -> str:
    """The registered name of ``task``: a Celery task (its ``name``) or the name itself."""
    name = task if isinstance(task, str) else getattr(task, "name", None)
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"enqueue() needs a Celery task or a task name, not {task!r}")
    problem = _storable.text_problem(name)
    if problem is not None:
        raise TypeError(f"a task name that {problem} cannot be stored: {name!r}")
    max_length = OutboxMessage._meta.get_field("task").max_length
    if max_length is not None and len(name) > max_length:
        raise ValueError(f"a task name has at most {max_length} characters")
    return name


def enqueue(task: object, /, *args: Any, **kwargs: Any) -> uuid.UUID:
    """Write one message in the current transaction of the idempotency database.

    ``task`` is a Celery task or its registered name; ``args`` and ``kwargs`` must be JSON
    that every supported database stores unchanged (no NUL character, no lone surrogate,
    integers within 64 bits, at most 31 levels of nesting); otherwise
    ``TypeError`` before any SQL runs, nothing written, the transaction intact. Outside
    ``transaction.atomic`` on the ``DATABASE`` alias it raises
    ``TransactionManagementError``: a message written in autocommit would be sent even if
    the caller's work rolled back. On PostgreSQL a
    ``NOTIFY`` in the same transaction wakes the relays when it commits. Returns the
    message id, which is also the task id the relay sends it with.
    """
    return write(task_name(task), args, kwargs).id


def write(
    name: str,
    args: tuple[Any, ...] | list[Any],
    kwargs: dict[str, Any],
    delivery: dict[str, Any] | None = None,
) -> OutboxMessage:
    """The message behind :func:`enqueue` and the Tasks backend's ``enqueue``, written in
    the current transaction of the idempotency database, with the same refusals."""
    alias = app_settings.DATABASE
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            f"enqueue() must run inside transaction.atomic(using={alias!r}), so that the "
            "message commits or rolls back with the work it belongs to"
        )
    # Stored as JSON gives them back, so the sender hands on exactly what was checked.
    positional = _storable.json_value(list(args), "the arguments of an outbox message")
    named = _storable.json_value(dict(kwargs), "the keyword arguments of an outbox message")
    now = timezone.now()
    message = OutboxMessage.objects.using(alias).create(
        task=name,
        args=positional,
        kwargs=named,
        available_at=now,
        created_at=now,
        delivery=delivery or {},
    )
    notify(alias)
    return message


def notify(alias: str) -> None:
    """Wake the listening relays when the current transaction commits (PostgreSQL only)."""
    connection = connections[alias]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [CHANNEL])


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
