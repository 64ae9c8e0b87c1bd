"""The one retry helper: a short transaction run again when the database asks for it."""

from __future__ import annotations

import contextvars
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from django.db import Error, InterfaceError, OperationalError

T = TypeVar("T")

# Deadlock and serialization failures: the database rolled the statement back and asks for a
# retry (PostgreSQL SQLSTATEs; MySQL/MariaDB error numbers).
_RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})
_RETRYABLE_MYSQL_ERRORS = frozenset({1213, 1205})
ATTEMPTS = 5


# The connection itself lost: the server went away (a node killed, a restart, a failover),
# the backend was terminated, or the session was killed. The transaction on it did not
# commit, and a retry on a new connection is what the client should do. PostgreSQL:
# SQLSTATE class 08 (connection exceptions), 57P01-57P03 (administrator, crash or shutdown
# and "cannot connect now"), and an OperationalError of psycopg's without a SQLSTATE (the
# server closed the connection). MySQL/MariaDB: 2002 and 2003 (cannot connect), 2006 (gone
# away), 2013 (lost during a query), 1053 (shutdown in progress), 1927 (connection killed),
# 4031 (disconnected by the server), and Galera's 1047 (the node is not ready: WSREP has
# not yet prepared the node for application use).
_LOST_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})
_LOST_MYSQL_ERRORS = frozenset({2002, 2003, 2006, 2013, 1053, 1927, 4031, 1047})

_LOCK_WAIT_TIMEOUT = 1205
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
    """A deadlock or serialization failure, which the database asks the client to retry."""
    cause = exc.__cause__
    if getattr(cause, "sqlstate", None) in _RETRYABLE_SQLSTATES:
        return True
    args: tuple[Any, ...] = getattr(cause, "args", ())
    if not args or args[0] not in _RETRYABLE_MYSQL_ERRORS:
        return False
    return not (args[0] == _LOCK_WAIT_TIMEOUT and _bounded.get())


def is_connection_lost(exc: Error) -> bool:
    """Whether ``exc`` says that the connection itself was lost (see ``_LOST_SQLSTATES``),
    rather than that its statement failed: the transaction on it did not commit."""
    if isinstance(exc, InterfaceError):  # the driver's connection is closed already
        return True
    cause = exc.__cause__
    if hasattr(cause, "sqlstate") or hasattr(cause, "pgcode"):  # psycopg, psycopg2
        state = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
        if state is None:
            return isinstance(exc, OperationalError)
        return str(state).startswith("08") or state in _LOST_SQLSTATES
    args: tuple[Any, ...] = getattr(cause, "args", ())
    return bool(args) and args[0] in _LOST_MYSQL_ERRORS


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
