"""Who sends an outbox message, and what a sender raises.

A message a task framework wrote (its ``delivery`` is set: Django's Tasks framework through
``tasks_backend.OutboxBackend``) goes to the sender that framework registered
(:func:`register_delivery`); any other to the configured sender (``OUTBOX_SENDER``). The
outbox knows senders, not task frameworks: nothing here imports Celery or ``django.tasks``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable

from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import app_settings, only_tasks_through_outbox
from django_idempotency.models import OutboxMessage

__all__ = [
    "Report",
    "Sender",
    "Undeliverable",
    "UnknownTask",
    "Unreadable",
    "configured_sender",
    "deliver_task",
    "register_delivery",
]

Sender = Callable[[OutboxMessage], object]
#: ``report(id, task, outcome, error)``: one line per message, once its batch committed.
Report = Callable[[uuid.UUID, str, str, str], object]


class Undeliverable(Exception):
    """Raised by a sender for a message that can never be sent: it becomes ``dead`` at once.

    Any other exception is a failed attempt, retried after a backoff.
    """


class UnknownTask(Undeliverable):
    """The message names a task that the sender does not know."""


class Unreadable(Undeliverable):
    """The message's stored arguments cannot be read back: it is ``dead`` at once, unsent.

    Only a program other than ``enqueue()`` can have written them.
    """


# The sender of the messages a task framework wrote (their ``delivery`` is set), registered
# by that framework's side when the app is ready; one at most.
_delivering: list[Sender] = []


def register_delivery(send: Sender) -> None:
    """Send the messages whose ``delivery`` is set with ``send`` (Django's Tasks framework
    registers its backends' hand-over)."""
    _delivering[:] = [send]


def configured_sender() -> Sender:
    """The relay's sender: a message of a task framework goes to the sender it registered
    (:func:`deliver_task`), any other to ``OUTBOX_SENDER``, imported here;
    ``ImproperlyConfigured`` when it cannot be, unless it is the default sender without
    Celery in a project whose outbox serves Django's Tasks framework: then such a message
    fails to send, recorded with why."""
    try:
        send: Sender = app_settings.OUTBOX_SENDER
    except ImportError as exc:
        problem = ImproperlyConfigured(
            f"IDEMPOTENCY['OUTBOX_SENDER'] cannot be imported ({exc}); the default sender "
            "needs Celery: pip install 'django-idempotency[celery]'"
        )
        if not only_tasks_through_outbox():
            raise problem from exc
        send = functools.partial(_unsendable, problem)
    return functools.partial(_routed, send)


def _routed(send: Sender, message: OutboxMessage) -> None:
    if message.delivery:
        deliver_task(message)
    else:
        send(message)


def _unsendable(problem: Exception, message: OutboxMessage) -> None:
    raise problem


def deliver_task(message: OutboxMessage) -> None:
    """Hand a message a task framework wrote to the sender that framework registered."""
    if not _delivering:
        raise UnknownTask(
            "this message was written by Django's Tasks framework, which this process "
            "cannot load (neither django.tasks nor the django-tasks backport is importable)"
        )
    _delivering[0](message)
