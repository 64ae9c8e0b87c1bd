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

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, transaction
from django.db.models import QuerySet
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency import conf, signals
from django_idempotency.models import OutboxMessage, OutboxStatus

logger = logging.getLogger("django_idempotency")

# The PostgreSQL channel that enqueue() notifies and a waiting relay listens on.
CHANNEL = "django_idempotency_outbox"

# The longest stored error text of a failed send.
MAX_ERROR_CHARS = 2000

# A waiting relay looks at its stop flag at least this often, in seconds.
STOP_CHECK_SECONDS = 0.2

Sender = Callable[[OutboxMessage], object]
Stop = Callable[[], bool]


class Undeliverable(Exception):
    """Raised by a sender for a message that can never be sent: it becomes ``dead`` at once.

    Any other exception is a failed attempt, retried after a backoff.
    """


class UnknownTask(Undeliverable):
    """The message names a task that the sender does not know."""


# -- enqueue ------------------------------------------------------------------------------------


def task_name(task: object) -> str:
    """The registered name of ``task``: a Celery task (its ``name``) or the name itself."""
    name = task if isinstance(task, str) else getattr(task, "name", None)
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"enqueue() needs a Celery task or a task name, not {task!r}")
    max_length = OutboxMessage._meta.get_field("task").max_length
    if max_length is not None and len(name) > max_length:
        raise ValueError(f"a task name has at most {max_length} characters")
    return name


def enqueue(task: object, /, *args: Any, **kwargs: Any) -> uuid.UUID:
    """Write one message in the current transaction of the idempotency database.

    ``task`` is a Celery task or its registered name; ``args`` and ``kwargs`` must be JSON
    (``TypeError`` at once otherwise, nothing written). Outside ``transaction.atomic`` on the
    ``DATABASE`` alias it raises ``TransactionManagementError``: a message written in
    autocommit would be sent even if the caller's work rolled back. On PostgreSQL a
    ``NOTIFY`` in the same transaction wakes the relays when it commits. Returns the
    message id, which is also the task id the relay sends it with.
    """
    name = task_name(task)
    alias = conf.database()
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            f"enqueue() must run inside transaction.atomic(using={alias!r}), so that the "
            "message commits or rolls back with the work it belongs to"
        )
    positional, named = list(args), dict(kwargs)
    try:
        json.dumps([positional, named], allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the arguments of an outbox message must be JSON: {exc}") from exc
    now = timezone.now()
    message = OutboxMessage.objects.using(alias).create(
        task=name, args=positional, kwargs=named, available_at=now, created_at=now
    )
    notify(alias)
    return message.id


def notify(alias: str) -> None:
    """Wake the listening relays when the current transaction commits (PostgreSQL only)."""
    connection = connections[alias]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [CHANNEL])


# -- the relay ----------------------------------------------------------------------------------


@dataclass
class RelayResult:
    """What one relay run did: messages sent, failed (to be retried) and dead."""

    sent: int = 0
    failed: int = 0
    dead: int = 0
    batches: int = 0
    # Messages the batches took; a batch that takes fewer than its size ends a drain.
    taken: int = 0

    def add(self, other: RelayResult) -> None:
        """Add another run's figures to this one."""
        self.sent += other.sent
        self.failed += other.failed
        self.dead += other.dead
        self.batches += other.batches
        self.taken += other.taken


def backoff(attempts: int) -> timedelta:
    """The wait before the next send of a message that failed ``attempts`` times.

    ``OUTBOX_BACKOFF`` after the first failure, doubling after each further one, never more
    than ``OUTBOX_BACKOFF_MAX``.
    """
    longest = conf.outbox_backoff_max()
    wait: timedelta = conf.outbox_backoff() * (2 ** min(max(attempts - 1, 0), 32))
    return min(wait, longest)


def relay_batch(
    *,
    using: str | None = None,
    batch_size: int | None = None,
    sender: Sender | None = None,
    now: datetime | None = None,
) -> RelayResult:
    """Send one batch of due messages and record the outcomes, in one transaction.

    The batch is locked with ``FOR UPDATE SKIP LOCKED`` (messages another relay holds are
    skipped). Without row locks (SQLite) a no-op write first takes the database's write
    lock, so two relays still never hold the same message.
    """
    alias = using or conf.database()
    size = batch_size if batch_size is not None else conf.outbox_batch_size()
    if size <= 0:
        raise ValueError("batch_size must be positive")
    send = sender or configured_sender()
    now = now or timezone.now()
    result = RelayResult(batches=1)
    with transaction.atomic(using=alias):
        messages = list(_due(alias, now)[:size])
        result.taken = len(messages)
        sent: list[uuid.UUID] = []
        for message in messages:
            try:
                send(message)
            except Exception as exc:  # a failed send is recorded, never raised
                dead = _record_failure(alias, message, exc, now)
                result.dead += dead
                result.failed += not dead
            else:
                sent.append(message.id)
                logger.info("sent outbox message %s (%s)", message.id, message.task)
        if sent:
            OutboxMessage.objects.using(alias).filter(pk__in=sent).update(
                status=OutboxStatus.SENT, sent_at=timezone.now()
            )
        result.sent = len(sent)
    if result.taken:
        signals.outbox_relayed.send(
            sender=OutboxMessage, sent=result.sent, failed=result.failed, dead=result.dead
        )
    return result


def configured_sender() -> Sender:
    """``OUTBOX_SENDER``, imported; ``ImproperlyConfigured`` when it cannot be."""
    try:
        return conf.outbox_sender()
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"IDEMPOTENCY['OUTBOX_SENDER'] cannot be imported ({exc}); the default sender "
            "needs Celery: pip install 'django-idempotency[celery]'"
        ) from exc


def _due(alias: str, now: datetime) -> QuerySet[OutboxMessage]:
    connection = connections[alias]
    due = (
        OutboxMessage.objects.using(alias)
        .filter(status=OutboxStatus.PENDING, available_at__lte=now)
        .order_by("available_at")
    )
    features = connection.features
    if features.has_select_for_update_skip_locked:
        return due.select_for_update(skip_locked=True)
    if features.has_select_for_update:
        return due.select_for_update()
    # SQLite: a write statement takes the database's write lock for the rest of the
    # transaction, even when it changes no row; a second relay waits here until the first
    # has recorded its batch, and then reads what is still pending.
    table = connection.ops.quote_name(OutboxMessage._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET attempts = attempts WHERE 1 = 0")
    return due


def _record_failure(alias: str, message: OutboxMessage, exc: Exception, now: datetime) -> bool:
    """Count a failed send; True when the message is now dead."""
    attempts = message.attempts + 1
    dead = isinstance(exc, Undeliverable) or attempts >= conf.outbox_max_attempts()
    error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    fields: dict[str, Any] = {"attempts": attempts, "last_error": error}
    if dead:
        fields["status"] = OutboxStatus.DEAD
        logger.error(
            "outbox message %s (%s) is dead after %s attempts: %s",
            message.id,
            message.task,
            attempts,
            error,
        )
    else:
        fields["available_at"] = now + backoff(attempts)
        logger.warning(
            "sending outbox message %s (%s) failed (attempt %s): %s",
            message.id,
            message.task,
            attempts,
            error,
        )
    OutboxMessage.objects.using(alias).filter(pk=message.pk).update(**fields)
    return dead


def drain(
    *,
    using: str | None = None,
    batch_size: int | None = None,
    sender: Sender | None = None,
    stop: Stop | None = None,
) -> RelayResult:
    """Send what is due now, batch after batch, until a batch comes back short.

    Messages that fail are due again only after their backoff, so a drain always ends.
    ``stop()`` is asked between batches.
    """
    size = batch_size if batch_size is not None else conf.outbox_batch_size()
    send = sender or configured_sender()
    total = RelayResult()
    while stop is None or not stop():
        batch = relay_batch(using=using, batch_size=size, sender=send)
        total.add(batch)
        if batch.taken < size:
            break
    return total


def relay(
    *,
    using: str | None = None,
    batch_size: int | None = None,
    once: bool = False,
    stop: Stop | None = None,
    listen: bool = True,
    poll_interval: float | None = None,
    sender: Sender | None = None,
) -> RelayResult:
    """The relay behind ``relay_outbox`` and the Celery task: drain, then wait, until stopped.

    ``once``: drain what is due and return. Otherwise drain, then wait for a ``NOTIFY``
    (PostgreSQL, ``listen``) or for ``poll_interval`` seconds (``OUTBOX_POLL_INTERVAL``),
    whichever comes first, and drain again, until ``stop()`` answers true; the batch in hand
    is always finished first. A failed send never raises: it is counted and recorded. A
    database error is logged and the relay tries again after the poll interval (with
    ``once`` it raises).
    """
    alias = using or conf.database()
    send = sender or configured_sender()
    if once:
        return drain(using=alias, batch_size=batch_size, sender=send, stop=stop)
    should_stop: Stop = stop or (lambda: False)
    interval = (
        poll_interval if poll_interval is not None else conf.outbox_poll_interval().total_seconds()
    )
    total = RelayResult()
    connection = connections[alias]
    with _listener(alias, listen) as wait:
        while not should_stop():
            # A long-running relay has no request cycle to recycle its connection: after a
            # database error or past CONN_MAX_AGE it is closed here and opened afresh.
            connection.close_if_unusable_or_obsolete()
            try:
                total.add(drain(using=alias, batch_size=batch_size, sender=send, stop=should_stop))
            except DatabaseError:
                # The batch rolled back: its messages are still pending and are sent later.
                logger.exception("the outbox relay could not read or record a batch")
                connection.close()
            wait(interval, should_stop)
    return total


Wait = Callable[[float, Stop], None]


@contextlib.contextmanager
def _listener(alias: str, listen: bool) -> Iterator[Wait]:
    """A wait that a ``NOTIFY`` cuts short, on a dedicated connection (PostgreSQL)."""
    connection = connections[alias]
    if not listen or connection.vendor != "postgresql":
        yield _sleep
        return
    listener = _Listener(alias)
    try:
        yield listener.wait
    finally:
        listener.close()


def _sleep(seconds: float, stop: Stop) -> None:
    deadline = time.monotonic() + seconds
    while not stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, STOP_CHECK_SECONDS))


class _Listener:
    """``LISTEN`` on a connection of its own (psycopg 3), opened again after a failure.

    The Django connection cannot listen: it may sit in a transaction, and notifications are
    delivered between transactions only. Whatever goes wrong here, the relay falls back to
    polling, so a lost notification costs at most one poll interval.
    """

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.connection: Any = None

    def _connect(self) -> Any:
        if self.connection is not None:
            return self.connection
        try:
            import psycopg
        except ImportError:
            return None
        django_connection = connections[self.alias]
        try:
            params = django_connection.get_connection_params()
            params.pop("cursor_factory", None)
            self.connection = psycopg.connect(**params, autocommit=True)
            self.connection.execute(f"LISTEN {CHANNEL}")
        except (psycopg.Error, TypeError) as exc:
            logger.warning("the outbox relay cannot listen (%s); polling only", exc)
            self.close()
        return self.connection

    def wait(self, seconds: float, stop: Stop) -> None:
        connection = self._connect()
        if connection is None:
            _sleep(seconds, stop)
            return
        import psycopg

        deadline = time.monotonic() + seconds
        try:
            while not stop():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                # One notification is enough: the drain that follows reads everything due.
                wait = min(left, STOP_CHECK_SECONDS)
                for _notify in connection.notifies(timeout=wait, stop_after=1):
                    return
        except psycopg.Error as exc:
            logger.warning("the outbox relay lost its listening connection: %s", exc)
            self.close()

    def close(self) -> None:
        if self.connection is not None:
            with contextlib.suppress(Exception):
                self.connection.close()
        self.connection = None


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
    alias = using or conf.database()
    return OutboxMessage.objects.using(alias).filter(status=OutboxStatus.PENDING).count()


def oldest_pending_seconds(using: str | None = None, now: datetime | None = None) -> float | None:
    """How long the oldest pending message has waited; ``None`` when none is pending."""
    alias = using or conf.database()
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
