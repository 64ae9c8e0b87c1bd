"""Who sends an outbox message, and what a sender raises.

A message a task framework wrote (its ``delivery`` is set: Django's Tasks framework through
``tasks_backend.OutboxBackend``) goes to the backend that framework's registered lookup
names (:func:`register_delivery`), one by one or in batches where it takes them; any other
to the configured sender (``OUTBOX_SENDER``). The outbox knows senders, not task
frameworks: nothing here imports Celery or ``django.tasks``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import app_settings, only_tasks_through_outbox
from django_idempotency.models import OutboxMessage

__all__ = [
    "SENDER_GROUP",
    "Report",
    "Sender",
    "Undeliverable",
    "UnknownTask",
    "Unreadable",
    "configured_sender",
    "databases_of",
    "deliver_task",
    "groups_of",
    "register_delivery",
    "send_together",
]

Sender = Callable[[OutboxMessage], object]
#: What a batch hand-over answers: per message, in order, the exception its hand-over raised
#: or ``None`` once it was handed over.
Outcomes = list[Exception | None]
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
    return Routed(send)


#: The group of the messages a sender with ``send_batch`` takes together (no Tasks backend):
#: handed over after the Tasks backends' groups, whose database work a rollback takes back.
SENDER_GROUP = ("sender",)


class Routed:
    """The configured sender: a message of Django's Tasks framework to its Tasks backend,
    any other to ``send``; the former in batches where the backend takes them
    (``deliver_batch``), the latter one by one."""

    def __init__(self, send: Sender) -> None:
        self.send = send

    def __call__(self, message: OutboxMessage) -> None:
        if message.delivery:
            deliver_task(message)
        else:
            self.send(message)

    def groups(self, messages: Sequence[OutboxMessage]) -> list[Hashable | None]:
        """Per message, its group: messages of one group are handed over together (a
        Tasks backend that takes batches; a sender with ``send_batch``, the Celery
        sender's); ``None``: on its own."""
        batching: dict[Any, bool] = {}  # per Tasks backend: does it take batches?
        sender_batches = callable(getattr(self.send, "send_batch", None))
        groups: list[Hashable | None] = []
        for message in messages:
            if not message.delivery:
                groups.append(SENDER_GROUP if sender_batches else None)
                continue
            alias = message.delivery.get("backend")
            if not isinstance(alias, str):  # not one another program could name
                groups.append(None)
                continue
            if alias not in batching:
                backend = _backend(alias, quiet=True)
                batching[alias] = callable(getattr(backend, "deliver_batch", None))
            groups.append(alias if batching[alias] else None)
        return groups

    def databases(self, messages: Sequence[OutboxMessage]) -> set[str]:
        """The databases that handing ``messages`` over writes to, as their Tasks backends
        name them (``databases()``); a sender's own are not known."""
        found: set[str] = set()
        for alias in {message.delivery.get("backend") for message in messages if message.delivery}:
            if not isinstance(alias, str):
                continue
            databases = getattr(_backend(alias, quiet=True), "databases", None)
            if callable(databases):
                found.update(databases())
        return found

    def send_together(self, group: Hashable, messages: Sequence[OutboxMessage]) -> Outcomes:
        """Hand the messages of one group over together (one backend's batch)."""
        if group is SENDER_GROUP:
            sent: Outcomes = list(self.send.send_batch(messages))  # type: ignore[attr-defined]
            return sent
        outcomes: Outcomes = list(_backend(group, quiet=False).deliver_batch(messages))
        return outcomes


def groups_of(send: Sender, messages: Sequence[OutboxMessage]) -> list[Hashable | None]:
    """Per message, the group it is handed over with by ``send``; ``None``: one by one
    (every message of any sender but the configured one)."""
    return send.groups(messages) if isinstance(send, Routed) else [None] * len(messages)


def databases_of(send: Sender, messages: Sequence[OutboxMessage]) -> set[str]:
    """The databases that ``send`` writes to when it hands ``messages`` over, where it can
    say (the configured sender, for messages of a Tasks backend on django-tasks-db)."""
    return send.databases(messages) if isinstance(send, Routed) else set()


def send_together(send: Sender, group: Hashable, messages: Sequence[OutboxMessage]) -> Outcomes:
    """The outcome of each message's hand-over with the others of its group, in order."""
    if not isinstance(send, Routed):
        raise TypeError("only the configured sender hands messages over together")
    return send.send_together(group, messages)


def _unsendable(problem: Exception, message: OutboxMessage) -> None:
    raise problem


def deliver_task(message: OutboxMessage) -> None:
    """Hand a message of Django's Tasks framework to the backend it was enqueued on
    (``tasks_backend.OutboxBackend.deliver``), which passes it on to its ``DELIVER_TO``."""
    alias = message.delivery.get("backend")
    deliver = getattr(_backend(alias, quiet=False), "deliver", None)
    if not callable(deliver):
        raise UnknownTask(f"the Tasks backend {alias!r} is no outbox backend")
    deliver(message)


def _backend(alias: Any, quiet: bool) -> Any:
    """The backend ``alias`` of the task framework that registered its lookup;
    ``UnknownTask`` when it cannot be had (``None`` if ``quiet``)."""
    if not _backends:
        if quiet:
            return None
        raise UnknownTask(
            "this message was written by Django's Tasks framework, which this process "
            "cannot load (neither django.tasks nor the django-tasks backport is importable)"
        )
    try:
        return _backends[0](alias)
    except UnknownTask:
        if quiet:
            return None
        raise


# The lookup of the backends a task framework's messages name (their ``delivery`` is set),
# registered by that framework's side when the app is ready; one at most.
_backends: list[Callable[[Any], Any]] = []


def register_delivery(backend: Callable[[Any], Any]) -> None:
    """Hand the messages whose ``delivery`` is set to the backend ``backend(alias)`` names
    (``UnknownTask`` when it names none): its ``deliver(message)``, or its
    ``deliver_batch(messages)`` where it has one. Django's Tasks framework registers its
    outbox backends."""
    _backends[:] = [backend]
