"""Outbox senders that the tests configure with ``OUTBOX_SENDER``; every send is counted.

A send is a ``ProviderCall`` row ``sent:<message id>:<pid>`` written through the
``provider`` connection (autocommit), so it survives the relay's transaction rolling back
and the relay being killed. On SQLite, where the relay's batch holds the database's only
write lock, it is written in the relay's own transaction instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from django.db import DatabaseError, connections

from django_idempotency.models import OutboxMessage
from django_idempotency.outbox import Undeliverable
from tests.testapp.models import ProviderCall

BROKEN = "tests.broken"
UNDELIVERABLE = "tests.undeliverable"
# Its send runs a failing query on the relay's connection, catches the error and returns.
SWALLOWS_QUERY_ERROR = "tests.swallows_query_error"


class UnprintableError(Exception):
    """An exception whose text cannot even be read: ``str()`` of it raises."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class SendTimeout(BaseException):
    """A timeout around a send that is no ``Exception``, as ``gevent.Timeout`` and
    ``func_timeout``'s ``FunctionTimedOut`` are: ``except Exception`` does not catch it."""


def _failed_query() -> None:
    # A statement that fails on the relay's own connection, inside its batch transaction:
    # on PostgreSQL it aborts that transaction unless something rolls it back.
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT * FROM no_such_table_for_the_outbox")


def _raise(exc: BaseException) -> None:
    raise exc


# Task names whose send fails in an unusual way (the sender ``record`` raises for them).
FAILURES = {
    "tests.fails.nul_in_error": lambda: _raise(
        ConnectionError("the broker said \x00 then \ud800 then \U0001f600")
    ),
    "tests.fails.unprintable_error": lambda: _raise(UnprintableError()),
    "tests.fails.key_error": lambda: _raise(KeyError("topic")),
    "tests.fails.recursion_error": lambda: _raise(RecursionError("maximum recursion depth")),
    "tests.fails.overflow_error": lambda: _raise(OverflowError("int too large")),
    "tests.fails.failed_query": _failed_query,
    "tests.fails.long_error": lambda: _raise(ConnectionError("x" * 100_000)),
    "tests.fails.timeout_not_an_exception": lambda: _raise(SendTimeout("5 seconds")),
    "tests.fails.cancelled": lambda: _raise(asyncio.CancelledError("the send was cancelled")),
}


def count_send(message: OutboxMessage) -> None:
    alias = "default" if connections["default"].vendor == "sqlite" else "provider"
    ProviderCall.objects.using(alias).create(key=f"sent:{message.id}:{os.getpid()}")


def sends(message_id: object) -> int:
    """How many times a sender handed this message over."""
    return ProviderCall.objects.filter(key__startswith=f"sent:{message_id}:").count()


def record(message: OutboxMessage) -> None:
    """Send nowhere; count the send. ``tests.broken`` fails; ``tests.undeliverable`` for good;
    the tasks of ``FAILURES`` fail in their own ways."""
    if message.task == BROKEN:
        raise ConnectionError("the broker is down")
    if message.task == UNDELIVERABLE:
        raise Undeliverable("no such topic")
    if message.task in FAILURES:
        FAILURES[message.task]()
    if message.task == SWALLOWS_QUERY_ERROR:
        with contextlib.suppress(DatabaseError):
            _failed_query()
    count_send(message)


def slow_record(message: OutboxMessage) -> None:
    """Like :func:`record`, a third of a second per message: a batch takes a while."""
    time.sleep(0.3)
    count_send(message)


def celery_and_record(message: OutboxMessage) -> None:
    """The Celery sender, counted."""
    from django_idempotency import celery_sender

    celery_sender.send(message)
    count_send(message)


def celery_then_die(message: OutboxMessage) -> None:
    """The Celery sender, counted, then the relay dies before it can mark the message sent."""
    celery_and_record(message)
    os.kill(os.getpid(), signal.SIGKILL)


# In a batch, it makes ``BatchRecord.send_batch`` raise before it sends anything.
BREAKS_THE_BATCH = "tests.breaks_the_batch"


class BatchRecord:
    """:func:`record`, and ``send_batch``: the batch's messages at once, each as ``record``
    sends it, its failure returned; every ``send_batch`` that sends is counted as
    ``batch:<first message id>``. A batch holding ``tests.breaks_the_batch`` raises."""

    def __call__(self, message: OutboxMessage) -> None:
        record(message)

    def send_batch(self, messages: list[OutboxMessage]) -> list[Exception | None]:
        if any(message.task == BREAKS_THE_BATCH for message in messages):
            raise RuntimeError("the batch broke")
        alias = "default" if connections["default"].vendor == "sqlite" else "provider"
        ProviderCall.objects.using(alias).create(key=f"batch:{messages[0].id}")
        outcomes: list[Exception | None] = []
        for message in messages:
            try:
                record(message)
            except Exception as exc:
                outcomes.append(exc)
            else:
                outcomes.append(None)
        return outcomes


batch_record = BatchRecord()


class ShortBatch(BatchRecord):
    """A ``send_batch`` that answers one outcome too few: a defect of the sender's."""

    def send_batch(self, messages: list[OutboxMessage]) -> list[Exception | None]:
        return super().send_batch(messages)[:-1]


short_batch = ShortBatch()


class TrueBatch(BatchRecord):
    """A ``send_batch`` that answers ``True`` for a message handed over, not ``None``: a
    defect of the sender's (``False`` or a text would be as wrong)."""

    def send_batch(self, messages: list[OutboxMessage]) -> list[Exception | None]:
        return [True if outcome is None else outcome for outcome in super().send_batch(messages)]  # type: ignore[misc]


true_batch = TrueBatch()
