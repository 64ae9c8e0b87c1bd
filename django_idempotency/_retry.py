"""The one retry helper: a short transaction run again when the database asks for it."""

from __future__ import annotations

import contextvars
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from django.db import OperationalError

from django_idempotency import _vendors

T = TypeVar("T")

ATTEMPTS = 5


#: Inside a claim whose waits are bounded (``CLAIM_TIMEOUT``), a lock wait that timed out is
#: the bound at work, not a victim to run again.
_bounded: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "django_idempotency_bounded", default=False
)


@contextmanager
def bounded() -> Iterator[None]:
    """Within the block, a lock wait timeout is final (never run again)."""
    token = _bounded.set(True)
    try:
        yield
    finally:
        _bounded.reset(token)


def is_retryable(exc: OperationalError) -> bool:
    """A deadlock or serialization failure, which the database asks the client to retry
    (the codes are each vendor's: ``_vendors``)."""
    return _vendors.retryable(exc, _bounded.get())


def retrying(func: Callable[[], T]) -> T:
    """Run ``func`` (one short transaction) again when the database picked it as a deadlock
    victim or failed it for serialization; other errors propagate at once.

    InnoDB can pick a concurrent duplicate insert, or one of two purgers whose index locks
    cross, as a victim; each caller's transaction starts afresh, so running it again is safe.
    Up to five attempts, with a few milliseconds of jittered sleep between them.
    """
    for attempt in range(ATTEMPTS):
        try:
            return func()
        except OperationalError as exc:
            pause_or_raise(exc, attempt)
    raise AssertionError("unreachable")


def pause_or_raise(exc: OperationalError, attempt: int) -> None:
    """After the failure ``exc`` of attempt ``attempt`` (from 0): raise it when it cannot be
    retried or was the last attempt, else sleep a few jittered milliseconds. The loop of
    :func:`retrying`, for a hot path that keeps its loop to itself."""
    if not is_retryable(exc) or attempt == ATTEMPTS - 1:
        raise exc
    time.sleep(random.uniform(0.001, 0.01) * (attempt + 1))
