"""The outbox's relay: due messages taken in batches and handed to the sender.

The relay takes due messages with ``SELECT ... FOR UPDATE SKIP LOCKED``, so several relays
share the work without waiting on each other, sends each one with the sender
(``OUTBOX_SENDER``), and records every outcome in the batch's transaction. A relay killed
after a send and before that transaction commits sends the message again: the message id
is the task id, so a consumer under ``@idempotent_task()`` runs once. Its public face is
:mod:`django_idempotency.outbox` (``relay``, ``drain``, ``relay_batch``, the exceptions).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Collection, Hashable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import QuerySet, TextField
from django.db.models.functions import Cast
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency import _storable, _unique, _validation, _wakeup, signals
from django_idempotency._autonomous import in_callers_transaction
from django_idempotency._senders import (
    SENDER_GROUP,
    Report,
    Sender,
    Undeliverable,
    Unreadable,
    configured_sender,
    databases_of,
    groups_of,
    send_together,
)
from django_idempotency._vendors import of
from django_idempotency._wakeup import Stop
from django_idempotency.conf import app_settings
from django_idempotency.models import OutboxMessage, OutboxStatus

logger = logging.getLogger("django_idempotency")

# The longest stored error text of a failed send.
MAX_ERROR_CHARS = 2000


# After an unexpected error a long-running relay pauses this long before it tries again,
# doubling after each further error in a row, up to the longest pause (seconds).
ERROR_PAUSE_SECONDS = 1.0


ERROR_PAUSE_MAX_SECONDS = 30.0


# What a send may raise that stops the relay instead of failing that send: the process is
# told to end. Anything else a sender raises, even what is no ``Exception`` (a timeout
# around the send: ``gevent.Timeout``, ``func_timeout``'s), is a failed send, recorded.
STOPS = (KeyboardInterrupt, SystemExit)


# Stored arguments nested deeper than this are not handed to a sender: only another program
# can have written them (enqueue allows _storable.MAX_DEPTH levels), and a sender's own
# serializer would exhaust Python's recursion limit on them.
MAX_READ_DEPTH = 500


@dataclass
class RelayResult:
    """What one relay run did: messages sent, failed (to be retried) and dead, and the
    unexpected errors a long-running relay survived."""

    sent: int = 0
    failed: int = 0
    dead: int = 0
    batches: int = 0
    # Messages the batches took; a batch that takes fewer than its size ends a drain.
    taken: int = 0
    errors: int = 0
    # One batch's messages, each as (id, task, "sent" | "failed" | "dead", error text), for
    # a ``report`` callback once the batch committed; never added up across batches.
    outcomes: list[tuple[uuid.UUID, str, str, str]] = field(default_factory=list, repr=False)

    def add(self, other: RelayResult) -> None:
        """Add another run's figures to this one."""
        self.sent += other.sent
        self.failed += other.failed
        self.dead += other.dead
        self.batches += other.batches
        self.taken += other.taken
        self.errors += other.errors


_MICROSECOND = timedelta(microseconds=1)

# The most parameters one statement marking messages sent carries: PostgreSQL's protocol
# counts a statement's parameters in 16 bits (reached through server-side binding), and
# a database whose backend names a lower max_query_params (SQLite's 999) takes fewer.
MAX_PARAMETERS = 65535


def backoff(attempts: int) -> timedelta:
    """The wait before the next send of a message that failed ``attempts`` times.

    ``OUTBOX_BACKOFF`` after the first failure, doubling after each further one, never more
    than ``OUTBOX_BACKOFF_MAX``. Capped before it is multiplied, in whole microseconds, so
    no setting and no number of attempts overflows.
    """
    first = app_settings.OUTBOX_BACKOFF // _MICROSECOND
    longest = app_settings.OUTBOX_BACKOFF_MAX // _MICROSECOND
    doublings = max(attempts - 1, 0)
    # first is at least one microsecond: past this many doublings it exceeds any ceiling,
    # and below it the shift stays a small number.
    if doublings >= longest.bit_length() or first << doublings >= longest:
        return timedelta(microseconds=longest)
    return timedelta(microseconds=first << doublings)


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
    lock, so two relays still never hold the same message. A sender's own queries on this
    connection run in a savepoint, so whatever a sender raises (even after a failed query)
    is recorded on its message and the rest of the batch is sent. Sends ``outbox_relayed``.
    """
    alias = _outside_transactions(using)
    send = _sender(sender)
    result = _relay_batch(alias, _batch_size(batch_size), send, now or timezone.now())
    _relayed(result)
    return result


def _outside_transactions(using: str | None) -> str:
    """The outbox's alias; ``TransactionManagementError`` inside the caller's transaction.

    There the relay would read that transaction's own messages, which have not committed
    and may never, and hand them over; its batch would be a savepoint that commits only
    with the caller. (A test case's own transactions are no caller's: inside them the test's
    messages count as committed.)
    """
    # None is the default; "" names no database, and connections[""] refuses it.
    alias = app_settings.DATABASE if using is None else using
    if in_callers_transaction(connections[alias]):
        raise TransactionManagementError(
            f"the outbox relay must not run inside a transaction on {alias!r} "
            "(transaction.atomic(), ATOMIC_REQUESTS, autocommit turned off): it would hand "
            "over messages that have not committed, or what it hands over there would "
            "commit only with that transaction while its batches commit on their own. "
            "Run it outside any transaction on that database."
        )
    return alias


def _sender(sender: Sender | None) -> Sender:
    # None, not any false value: a sender that is also an empty queue is still the sender.
    return sender if sender is not None else configured_sender()


def _batch_size(batch_size: int | None) -> int:
    """The batch size asked for, or ``OUTBOX_BATCH_SIZE``; ``ValueError`` for anything the
    setting would not admit (``True``, ``1.5``, ``"3"``, past ``MAX_INT``)."""
    size = _validation.counted_argument("batch_size", batch_size)
    return size if size is not None else app_settings.OUTBOX_BATCH_SIZE


def _relay_batch(alias: str, size: int, send: Sender, now: datetime) -> RelayResult:
    try:
        return _relay_taken(alias, size, send, now, together=True)
    except _TogetherFailed:
        # Rolled back, the hand-over together with it: the batch again, one by one.
        return _relay_taken(alias, size, send, now, together=False)


class _TogetherFailed(Exception):
    """A hand-over of messages together raised: the batch's transaction rolls back."""


def _relay_taken(
    alias: str, size: int, send: Sender, now: datetime, *, together: bool
) -> RelayResult:
    result = RelayResult(batches=1)
    with transaction.atomic(using=alias):
        taken = _take(alias, now, size)
        result.taken = len(taken)
        # Sent before and made pending again: their keys forget the earlier runs' reports.
        _unique.sent_again(alias, [message.id for message, _ in taken if message.sent_at])
        # What each message's delivery held before the hand-over: a sender that records
        # something there (the Tasks backend: the target's result id) has it saved with
        # the mark.
        before = {message.id: dict(message.delivery) for message, _ in taken}
        readable = [message for message, unreadable in taken if unreadable is None]
        # The other databases the hand-over writes to (django-tasks-db's, routed elsewhere)
        # commit just before this batch does, and roll back with it.
        others = databases_of(send, readable) - {alias}
        for other in others:  # a caller's transaction there would hold the hand-over back
            _outside_transactions(other)
        with _holding(others):
            errors = _hand_over(alias, send, readable, together, others)
            sent: list[OutboxMessage] = []
            for message, unreadable in taken:
                error = unreadable or errors[message.id]
                if error is None:
                    sent.append(message)
                    logger.info("sent outbox message %s (%s)", message.id, message.task)
                    result.outcomes.append((message.id, message.task, "sent", ""))
                    continue
                dead = _record_failure(alias, message, error, now)
                result.dead += dead
                result.failed += not dead
                outcome = "dead" if dead else "failed"
                result.outcomes.append((message.id, message.task, outcome, error_text(error)))
            if sent:
                _mark_sent(alias, sent, before)
        result.sent = len(sent)
    return result


@contextlib.contextmanager
def _holding(others: Collection[str]) -> Iterator[None]:
    """A transaction on each database of ``others`` (a savepoint where one is open already),
    committed when the block ends and rolled back if it raises: the batch's writes there
    are undone with the batch, and only a relay killed between their commit and the
    batch's own leaves them behind. A statement there that failed, its error caught
    inside, raises here: committing would silently roll the hand-over back while the
    batch marked it sent."""
    if not others:
        yield
        return
    with contextlib.ExitStack() as stack:
        for other in sorted(others):
            stack.enter_context(transaction.atomic(using=other))
        with _watching(others) as usable:
            yield
        usable()


def _mark_sent(
    alias: str, sent: list[OutboxMessage], before: dict[uuid.UUID, dict[str, Any]]
) -> None:
    """One ``UPDATE`` for the whole batch, or for each part of it that one statement's
    parameters hold (a message takes one, and on all but PostgreSQL two more for a changed
    delivery): past that limit the statement would fail after the batch was handed over,
    and every run would hand it over again."""
    connection = connections[alias]
    most = min(connection.features.max_query_params or MAX_PARAMETERS, MAX_PARAMETERS)
    each = 1 if of(alias).json_rows else 3
    size = max((most - 3) // each, 1)  # three: the status, sent_at, the deliveries' JSON
    for start in range(0, len(sent), size):
        _mark_part_sent(alias, sent[start : start + size], before)


def _mark_part_sent(
    alias: str, sent: list[OutboxMessage], before: dict[uuid.UUID, dict[str, Any]]
) -> None:
    """One ``UPDATE``: ``sent`` marked sent, and each changed delivery saved.

    Written out rather than through ``Case(When(...))``: the ORM resolves each ``When``
    as a filter of its own, which costs more than the rest of a Tasks batch's hand-over.
    """
    connection = connections[alias]
    meta = OutboxMessage._meta
    quote = connection.ops.quote_name
    pk, delivery = meta.pk, meta.get_field("delivery")
    assert pk is not None
    assert pk.column
    assert delivery.column
    id_column = quote(pk.column)
    ids = [pk.get_db_prep_value(message.pk, connection) for message in sent]
    sets = f"{quote('status')} = %s, {quote('sent_at')} = %s"
    params: list[Any] = [OutboxStatus.SENT, timezone.now()]
    changed = [message for message in sent if message.delivery != before[message.id]]
    if changed and of(alias).json_rows:
        # Every changed delivery in one jsonb parameter, by id, rather than
        # two parameters a message, each quoted by the client in Python.
        column = quote(delivery.column)
        sets += f", {column} = COALESCE(%s::jsonb -> {id_column}::text, {column})"
        by_id = {str(message.pk): message.delivery for message in changed}
        params.append(delivery.get_db_prep_value(by_id, connection))
    elif changed:
        column = quote(delivery.column)
        cases = " ".join(["WHEN %s THEN %s"] * len(changed))
        sets += f", {column} = CASE {id_column} {cases} ELSE {column} END"
        for message in changed:
            params.append(pk.get_db_prep_value(message.pk, connection))
            params.append(delivery.get_db_prep_value(message.delivery, connection))
    placeholders = ", ".join(["%s"] * len(ids))
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {quote(meta.db_table)} SET {sets} WHERE {id_column} IN ({placeholders})",
            [*params, *ids],
        )


def _hand_over(
    alias: str,
    send: Sender,
    messages: list[OutboxMessage],
    together: bool,
    others: Collection[str] = (),
) -> dict[uuid.UUID, BaseException | None]:
    """Each message's failed send, or ``None`` once it was handed over: the messages that a
    sender takes together (``groups``) in one hand-over per group if ``together``, then the
    others one by one, oldest first. The groups go first: if one fails, the batch rolls
    back before anything was sent that a rollback cannot take back."""
    errors: dict[uuid.UUID, BaseException | None] = {}
    groups: dict[Hashable, list[OutboxMessage]] = {}
    alone: list[OutboxMessage] = []
    kinds = groups_of(send, messages) if together else [None] * len(messages)
    for message, group in zip(messages, kinds, strict=True):
        if group is None:
            alone.append(message)
        else:
            groups.setdefault(group, []).append(message)
    # The sender's group (a broker: no rollback takes it back) after the Tasks backends'.
    for group in sorted(groups, key=lambda group: group == SENDER_GROUP):
        errors.update(_send_group(alias, send, group, groups[group], others))
    for message in alone:
        errors[message.id] = _send(alias, send, message, others)
    return errors


def _send_group(
    alias: str,
    send: Sender,
    group: Hashable,
    messages: list[OutboxMessage],
    others: Collection[str] = (),
) -> dict[uuid.UUID, BaseException | None]:
    """One hand-over of ``messages`` together, in the batch's transaction itself (no
    savepoint: two round trips a batch saved). If it raises, or leaves that transaction
    unusable (a statement of its failed and the error was caught inside it: a body run
    eagerly, a receiver of ``task_enqueued``), :class:`_TogetherFailed` rolls the batch
    back, and the relay takes it again and sends its messages one by one, each in a
    savepoint of its own: the failure lands on the message that caused it."""
    try:
        with _watching([alias, *others]) as usable:
            outcomes = send_together(send, group, messages)
        if len(outcomes) != len(messages):
            raise RuntimeError(f"{len(outcomes)} outcomes for {len(messages)} messages")
        wrong = [o for o in outcomes if o is not None and not isinstance(o, BaseException)]
        if wrong:
            # What True, False or a text says of a message cannot be told: not a failure
            # recorded on messages that may well have been handed over (sent again and
            # again, then dead), but the batch rolled back and sent one by one.
            raise TypeError(
                f"an outcome of a batch's hand-over is None or an exception, not {wrong[0]!r}"
            )
        usable()
    except STOPS:
        raise
    except BaseException as exc:
        logger.warning(
            "handing over %s outbox messages together failed (%s); the batch rolled back "
            "and is sent one by one",
            len(messages),
            error_text(exc),
        )
        raise _TogetherFailed from exc
    return {message.id: outcome for message, outcome in zip(messages, outcomes, strict=True)}


class _FailedStatements:
    """Whether a statement on the relay's connection failed (whatever caught its error)."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(
        self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any
    ) -> Any:
        try:
            return execute(sql, params, many, context)
        except Exception:
            self.failed = True
            raise


@contextlib.contextmanager
def _watching(aliases: Collection[str]) -> Iterator[Callable[[], None]]:
    """Watch the statements on ``aliases`` while the block runs; it gets a function that
    raises ``TransactionManagementError`` if one of their transactions can no longer go
    on: marked for rollback by the ORM, or a statement failed (its error caught inside)
    and a savepoint can no longer be taken (PostgreSQL's aborted transaction)."""
    watched = [(alias, _FailedStatements()) for alias in aliases]
    with contextlib.ExitStack() as stack:
        for alias, statements in watched:
            stack.enter_context(connections[alias].execute_wrapper(statements))

        def usable() -> None:
            for alias, statements in watched:
                if transaction.get_rollback(using=alias) or (
                    statements.failed and not _usable(alias)
                ):
                    raise TransactionManagementError(
                        f"a statement on {alias!r} failed inside the hand-over and its error "
                        "was caught there: the transaction cannot go on"
                    )

        yield usable


def _usable(alias: str) -> bool:
    """Whether the batch's transaction still takes statements (PostgreSQL aborts it at a
    failed one, unless a savepoint around it was rolled back): asked only after a statement
    failed."""
    try:
        transaction.savepoint_commit(_savepoint(using=alias), using=alias)
    except DatabaseError:
        return False
    return True


def _relayed(result: RelayResult) -> None:
    if result.taken:
        signals.outbox_relayed.send(
            sender=OutboxMessage, sent=result.sent, failed=result.failed, dead=result.dead
        )


def _send(
    alias: str, send: Sender, message: OutboxMessage, others: Collection[str] = ()
) -> BaseException | None:
    """Send one message; the exception it raised, or ``None`` once it was handed over. Its
    writes on ``others`` (the hand-over's other databases) are in savepoints of their own,
    rolled back with a send that fails."""
    queries = _SenderQueries(alias)
    try:
        with _holding(others):
            with connections[alias].execute_wrapper(queries):
                send(message)
            queries.release()
    except STOPS:
        raise
    except BaseException as exc:  # a failed send is recorded, never raised
        queries.roll_back()
        return exc
    return None


class _SenderQueries:
    """A savepoint taken just before a sender's first query on the relay's connection.

    PostgreSQL aborts a transaction at its first failed statement: a sender whose own query
    failed on this connection would leave the batch unable to record anything. Rolling back
    to this savepoint undoes only that send's database work. A sender that runs no query
    here (the Celery sender) costs no statement.
    """

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.savepoint: str | None = None
        self.opening = False
        # Whether the batch's block was marked for rollback before this send.
        self.marked = transaction.get_rollback(using=alias)

    def __call__(
        self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any
    ) -> Any:
        if self.savepoint is None and not self.opening:
            self.opening = True  # the SAVEPOINT statement passes through here too
            try:
                self.savepoint = _savepoint(using=self.alias)
            finally:
                self.opening = False
        return execute(sql, params, many, context)

    def release(self) -> None:
        # Raises when the sender left the transaction aborted (it caught its own error).
        if self.savepoint is not None:
            transaction.savepoint_commit(self.savepoint, using=self.alias)

    def roll_back(self) -> None:
        if self.savepoint is not None:
            # As an inner atomic block does: the mark the ORM left (a save that failed)
            # cleared first, else Django refuses the ROLLBACK TO SAVEPOINT itself; then
            # the batch's transaction is usable again.
            transaction.set_rollback(False, using=self.alias)
            transaction.savepoint_rollback(self.savepoint, using=self.alias)
        elif not self.marked:
            # The send failed before its first statement reached the database (a value
            # the ORM could not prepare), but the ORM marked the batch's block for
            # rollback: nothing of the send's is in the transaction, which is usable.
            transaction.set_rollback(False, using=self.alias)


def _take(alias: str, now: datetime, size: int) -> list[tuple[OutboxMessage, Unreadable | None]]:
    """The batch, locked, each message with why its stored arguments cannot be read, if so.

    The arguments are read as text and decoded here, not by the model field: one row that
    another program wrote (JSON nested deeper than Python decodes, a number of 5,000 digits)
    must not make the whole batch, and every batch after it, fail to load.
    """
    rows = (
        _due(alias, now)
        .defer("args", "kwargs", "delivery")
        .annotate(
            stored_args=Cast("args", output_field=TextField()),
            stored_kwargs=Cast("kwargs", output_field=TextField()),
            stored_delivery=Cast("delivery", output_field=TextField()),
        )[:size]
    )
    taken: list[tuple[OutboxMessage, Unreadable | None]] = []
    for message in rows:
        stored = vars(message)
        texts = [stored.pop(f"stored_{column}") for column in ("args", "kwargs", "delivery")]
        # Each set even when one before it cannot be read: a deferred field left unset
        # would be loaded again, through the model field, by whatever reads it.
        message.args, message.kwargs, message.delivery = [], {}, {}
        try:
            message.args = _stored_arguments(texts[0], "args", list)
            message.kwargs = _stored_arguments(texts[1], "kwargs", dict)
            message.delivery = _stored_arguments(texts[2], "delivery", dict)
        except Unreadable as exc:
            taken.append((message, exc))
        else:
            taken.append((message, None))
    return taken


def _stored_arguments(text: str | None, column: str, kind: type[Any]) -> Any:
    what = "a JSON list" if kind is list else "a JSON object"
    are = "is" if column == "delivery" else "are"
    try:
        value = _storable.read_json(text if text is not None else "null")
    except ValueError as exc:
        raise Unreadable(f"the stored {column} cannot be decoded: {exc}") from None
    if not isinstance(value, kind):
        raise Unreadable(f"the stored {column} {are} not {what}")
    # Each level takes two characters at least: short texts need no walk.
    deep = len(text or "") > 2 * MAX_READ_DEPTH and _storable.nested_deeper_than(
        value, MAX_READ_DEPTH
    )
    if deep:
        raise Unreadable(f"the stored {column} {are} nested more than {MAX_READ_DEPTH} levels deep")
    return value


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


def error_text(exc: BaseException) -> str:
    """``"ExceptionClass: message"``, fit for any text column, at most ``MAX_ERROR_CHARS``.

    NUL characters and lone surrogates are escaped; an exception whose ``str()`` raises is
    named by its class.
    """
    name = type(exc).__name__
    try:
        text = f"{name}: {exc}"
    except Exception:
        text = f"{name} (its text could not be read)"
    return _storable.storable_text(text)[:MAX_ERROR_CHARS]


def _record_failure(alias: str, message: OutboxMessage, exc: BaseException, now: datetime) -> bool:
    """Count a failed send; True when the message is now dead."""
    attempts = message.attempts + 1
    dead = isinstance(exc, Undeliverable) or attempts >= app_settings.OUTBOX_MAX_ATTEMPTS
    error = error_text(exc)
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
        # From the failure, not from the batch's start (``now``): a send late in a slow
        # batch waits its whole backoff too.
        fields["available_at"] = max(now, timezone.now()) + backoff(attempts)
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
    report: Report | None = None,
) -> RelayResult:
    """Send what is due now, batch after batch, until a batch comes back short.

    Messages that fail are due again only after their backoff, so a drain always ends.
    ``stop()`` is asked between batches.
    """
    total = RelayResult()
    alias, size = _outside_transactions(using), _batch_size(batch_size)
    _drain(total, alias, size, _sender(sender), stop, report)
    return total


def _drain(
    total: RelayResult,
    alias: str,
    size: int,
    send: Sender,
    stop: Stop | None,
    report: Report | None = None,
) -> None:
    # Each batch's figures are added as soon as it committed, before its signal is sent:
    # whatever is raised after that, the caller's total keeps them.
    while stop is None or not stop():
        batch = _relay_batch(alias, size, send, timezone.now())
        total.add(batch)
        if report is not None:
            for outcome in batch.outcomes:
                report(*outcome)
        _relayed(batch)
        if batch.taken < size:
            break


def relay(
    *,
    using: str | None = None,
    batch_size: int | None = None,
    once: bool = False,
    stop: Stop | None = None,
    listen: bool = True,
    poll_interval: float | None = None,
    sender: Sender | None = None,
    report: Report | None = None,
) -> RelayResult:
    """The relay behind ``relay_outbox`` and the Celery task: drain, then wait, until stopped.

    ``once``: drain what is due and return. Otherwise drain, then wait for a ``NOTIFY``
    (PostgreSQL, ``listen``) or for ``poll_interval`` seconds (``OUTBOX_POLL_INTERVAL``),
    whichever comes first, and drain again, until ``stop()`` answers true; the batch in hand
    is always finished first. A failed send never raises: it is counted and recorded. Any
    other error (the database, a signal receiver, anything) is counted (``errors``, the
    ``outbox_relay_failed`` signal); a long-running relay logs it, pauses (1 s, doubling
    while errors follow each other, at most 30 s) and goes on, while with ``once`` it
    raises. The batch in hand when it happened rolled back: its messages are sent later.
    ``report(id, task, outcome, error)`` is called for each message of a batch once the
    batch committed (``outcome``: ``"sent"``, ``"failed"`` or ``"dead"``).
    ``TransactionManagementError``, before anything is taken, inside a transaction on the
    outbox's database: its messages are not committed.
    """
    # A wrong argument is raised at once, not retried as an unexpected error.
    alias, size = _outside_transactions(using), _batch_size(batch_size)
    send = _sender(sender)
    if once:
        total = RelayResult()
        try:
            _drain(total, alias, size, send, stop, report)
        except Exception as exc:
            _failed(exc)
            raise
        return total
    should_stop: Stop = stop or (lambda: False)
    interval = _poll_interval(poll_interval)
    total = RelayResult()
    in_a_row = 0
    with _wakeup.listener(alias, listen) as wait:
        while not should_stop():
            try:
                # A long-running relay has no request cycle to recycle its connection: after
                # an error or past CONN_MAX_AGE it is closed here and opened afresh.
                connections[alias].close_if_unusable_or_obsolete()
                _drain(total, alias, size, send, should_stop, report)
                wait(interval, should_stop)
            except Exception as exc:
                in_a_row += 1
                total.errors += 1
                logger.exception(
                    "the outbox relay hit an unexpected error (%s in a row); the batch in "
                    "hand rolled back and its messages are sent later",
                    in_a_row,
                )
                _failed(exc)
                with contextlib.suppress(Exception):
                    connections[alias].close()
                _wakeup.sleep(_error_pause(in_a_row), should_stop)
            else:
                in_a_row = 0
    return total


def _poll_interval(poll_interval: float | None) -> float:
    """Seconds between drains: ``poll_interval``, or ``OUTBOX_POLL_INTERVAL``; ``ValueError``
    for what the setting would not admit (zero, negative, not finite, a bool, text)."""
    if poll_interval is None:
        return app_settings.OUTBOX_POLL_INTERVAL.total_seconds()
    try:
        return _validation.duration(poll_interval).total_seconds()
    except _validation.Invalid as exc:
        raise ValueError(f"poll_interval {exc}") from None


def _error_pause(in_a_row: int) -> float:
    doublings = min(in_a_row - 1, 8)  # 2**8 s is past the longest pause already
    pause: float = ERROR_PAUSE_SECONDS * 2**doublings
    return min(pause, ERROR_PAUSE_MAX_SECONDS)


def _failed(exc: Exception) -> None:
    # Sent robustly: a receiver that raises here must not end the relay it reports on.
    for _receiver, response in signals.outbox_relay_failed.send_robust(
        sender=OutboxMessage, error=exc
    ):
        if isinstance(response, Exception):
            logger.warning("a receiver of outbox_relay_failed raised: %s", error_text(response))


# Django 6.1 names it savepoint_create (savepoint() is deprecated there).
_savepoint: Callable[..., str] = getattr(transaction, "savepoint_create", transaction.savepoint)
