"""Outbox senders that the tests configure with ``OUTBOX_SENDER``; every send is counted.

A send is a ``ProviderCall`` row ``sent:<message id>:<pid>`` written through the
``provider`` connection (autocommit), so it survives the relay's transaction rolling back
and the relay being killed. On SQLite, where the relay's batch holds the database's only
write lock, it is written in the relay's own transaction instead.
"""

from __future__ import annotations

import os
import signal
import time

from django.db import connections

from django_idempotency.models import OutboxMessage
from django_idempotency.outbox import Undeliverable
from tests.testapp.models import ProviderCall

BROKEN = "tests.broken"
UNDELIVERABLE = "tests.undeliverable"


def count_send(message: OutboxMessage) -> None:
    alias = "default" if connections["default"].vendor == "sqlite" else "provider"
    ProviderCall.objects.using(alias).create(key=f"sent:{message.id}:{os.getpid()}")


def sends(message_id: object) -> int:
    """How many times a sender handed this message over."""
    return ProviderCall.objects.filter(key__startswith=f"sent:{message_id}:").count()


def record(message: OutboxMessage) -> None:
    """Send nowhere; count the send. ``tests.broken`` fails; ``tests.undeliverable`` for good."""
    if message.task == BROKEN:
        raise ConnectionError("the broker is down")
    if message.task == UNDELIVERABLE:
        raise Undeliverable("no such topic")
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
