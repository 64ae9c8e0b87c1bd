"""The exceptions of the framework-neutral API (:func:`django_idempotency.run_once`)."""

from __future__ import annotations

import math
import uuid
from datetime import datetime

from django.utils import timezone


class IdempotencyError(Exception):
    """Base class: the operation was not run, and nothing was committed by this call.

    Every one pickles with its attributes (``retry_after``, ``message_id``, ...), so that it
    crosses a process pool or a task result backend that pickles as it was raised."""

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled (a process pool, a task result backend that pickles), an error comes back
        # as raised: rebuilt without its ``__init__``, which takes more than the message.
        return (_rebuilt, (type(self), self.args), self.__dict__)


def _rebuilt(cls: type[IdempotencyError], args: tuple[object, ...]) -> IdempotencyError:
    error = cls.__new__(cls)
    error.args = args
    return error


class InProgress(IdempotencyError):
    """Another attempt holds the key's live lease, or took this attempt's lease over.

    ``retry_after`` is the number of whole seconds (at least 1) left of that lease.
    """

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class KeyReused(IdempotencyError):
    """The key was first used with another fingerprint: a new operation needs a new key."""


class OutcomeUnknown(IdempotencyError):
    """An earlier attempt stopped midway and the ``"fail"`` recovery policy closed the record:
    whether it took effect is unknown, and it is never run again."""


class RecordUnreadable(IdempotencyError):
    """The operation's outcome is stored but cannot be read back: sealed with a key that
    ``ENCRYPTION_KEYS`` no longer holds (``key_id`` names it), or damaged. Within the record's
    TTL it is never run again; once a key that opens it is configured again, the stored
    outcome is returned as it was."""

    def __init__(self, message: str, key_id: str | None = None) -> None:
        super().__init__(message)
        self.key_id = key_id


class OutcomeTooLarge(IdempotencyError):
    """The operation's outcome (its result, or its response and headers) is larger than
    the database takes in one statement (MariaDB's and MySQL's ``max_allowed_packet``): it
    was not stored, the operation's database work was rolled back and its claim released.
    Under ``recovery="resume"`` (a step's result, or the operation's own), the work not
    yet committed is rolled back and the operation ends as when its body raises (its
    earlier steps kept, its lease given back). Every retry would end the same way: make
    the outcome smaller, or raise the server's limit. ``size`` is the outcome's size in
    bytes (its body, and its headers as JSON) before the escaping that sending adds (up
    to as much again), ``limit`` the server's, in bytes."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class StoreUnavailable(IdempotencyError):
    """The idempotency store failed the operation: the database was unreachable, a
    statement failed, or a claim connection could not be had within ``CLAIM_TIMEOUT``.

    ``ran`` says whether the operation's body ran before it failed. ``False``: the claim (or
    a read before the body) failed, and nothing ran. ``True``: the body ran but its outcome
    (or a step's, or the claim of an operation it runs) could not be recorded, so its
    database work was rolled back; a retry with the same key runs it again (or its recovery
    policy decides). Either way, retry it with the same key.
    """

    def __init__(self, message: str, ran: bool = False) -> None:
        super().__init__(message)
        self.ran = ran


class TaskAlreadyQueued(IdempotencyError):
    """``outbox.enqueue_once(..., on_conflict="raise")`` found the key held by a live
    message: nothing was written. ``message_id`` is that message's id (a ``uuid.UUID``),
    also its task id."""

    def __init__(self, message: str, message_id: uuid.UUID) -> None:
        super().__init__(message)
        self.message_id = message_id


class SimulatedCrash(BaseException):
    """Ends an attempt as a killed process would, for tests (``django_idempotency.testing``).

    Raised inside a protected body, it rolls the body's database work back and leaves the
    claim exactly as a ``SIGKILL`` would: in progress, its lease running, nothing released.
    A ``BaseException``, so that application code catching ``Exception`` cannot swallow it.
    """


def seconds_left(until: datetime | None, now: datetime | None = None) -> int:
    """Whole seconds from ``now`` until ``until``, rounded up, at least 1."""
    if until is None:
        return 1
    left = (until - (now or timezone.now())).total_seconds()
    return max(1, math.ceil(left))
