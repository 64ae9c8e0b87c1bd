"""Who sends an outbox message: the configured sender (``OUTBOX_SENDER``), or, for a task of
Django's Tasks framework, the Tasks backend it was enqueued on; and what a sender raises."""

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


def configured_sender() -> Sender:
    """The relay's sender: a message of Django's Tasks framework goes to its Tasks backend
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
    """Hand a message of Django's Tasks framework to the backend it was enqueued on
    (``tasks_backend.OutboxBackend.deliver``), which passes it on to its ``DELIVER_TO``."""
    from django_idempotency._tasks_compat import task_backends

    alias = message.delivery.get("backend")
    try:
        backend = task_backends[alias]
    except Exception as exc:  # InvalidTaskBackend: no longer in TASKS
        raise UnknownTask(f"the Tasks backend {alias!r} cannot be had: {exc}") from exc
    deliver = getattr(backend, "deliver", None)
    if not callable(deliver):
        raise UnknownTask(f"the Tasks backend {alias!r} is no outbox backend")
    deliver(message)
