"""Claims that commit on their own, whatever transaction the caller is in.

The claim must be visible to every other connection before the work runs: that is what turns
a duplicate into a prompt ``409`` / ``InProgress`` rather than a wait on a row lock, and what
lets ``"fail"`` hold across a crash. When the caller's connection is inside a transaction
(``ATOMIC_REQUESTS``, ``run_once`` inside ``transaction.atomic()``, a protected view calling
``run_once``), a statement on it would commit only with the caller. So the claim-side
statements (the claim, the reads of the record, the release, the give-back, a recovery's
closing) then run on a second connection to the same database, in autocommit: an
*autonomous transaction*. The work and the fenced completion stay on the caller's
connection, inside its transaction, and commit with it.

The second connection is made only when it is needed, one per thread and database, with the
caller's settings (so it goes through the same PgBouncer, or comes from the same Django
pool), and is closed when the request ends, as Django closes its own.

Django's ``TestCase`` (and pytest-django's ``db``) wraps each test in transactions that it
marks as its own (``_from_testcase``). Those are not a caller's transaction: inside them the
claim stays on the test's connection, so a retry replays within the test and nothing the
test claimed outlives it.

SQLite serialises writers on the whole database: a second connection cannot commit while the
caller's transaction has read or written. There the claim stays in the caller's transaction;
that keeps "at most one effect" for ``"retry"`` (the claim and the work commit together), and
the other recovery policies, which must outlive a crash, refuse to run
(``ImproperlyConfigured``) rather than silently lose their promise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = [
    "claiming",
    "close_idle",
    "in_callers_transaction",
    "refuse_unkeepable",
    "separate",
]

# The caller's connection wrapper keeps its second connection in this attribute: both are
# per thread, so they live and die together.
_ATTRIBUTE = "_django_idempotency_autonomous"
# Whether this process ever made a second connection: until it has, closing them after a
# request has nothing to look at.
_made = False


def in_callers_transaction(connection: BaseDatabaseWrapper) -> bool:
    """Whether a statement on ``connection`` would commit only with a transaction the caller
    opened (an atomic block that is not a test case's, or autocommit turned off)."""
    if connection.in_atomic_block:
        blocks: list[Any] = connection.atomic_blocks
        return not (blocks and getattr(blocks[0], "_from_testcase", False))
    # Only an open connection can have had autocommit turned off (Django connects in
    # autocommit); an unopened one is in autocommit as soon as it connects.
    return connection.connection is not None and not connection.get_autocommit()


def _second_connection(connection: BaseDatabaseWrapper) -> BaseDatabaseWrapper:
    second: BaseDatabaseWrapper | None = getattr(connection, _ATTRIBUTE, None)
    if second is None:
        global _made
        _made = True
        # The same backend class and the very same settings dictionary as the caller's
        # connection: the same server, pooler, pool and options.
        second = type(connection)(connection.settings_dict, connection.alias)
        setattr(connection, _ATTRIBUTE, second)
        _close_together(connection, second)
    elif second.errors_occurred:
        # A connection that failed (the server restarted, a backend was terminated) is
        # replaced rather than reused broken.
        second.close_if_unusable_or_obsolete()
        second.errors_occurred = False
    else:
        # CONN_HEALTH_CHECKS, as Django applies them to its own: once per request.
        second.close_if_health_check_failed()
    return second


def separate(alias: str) -> bool:
    """Whether claim-side statements on ``alias`` go to the second connection now."""
    connection = connections[alias]
    return connection.vendor != "sqlite" and in_callers_transaction(connection)


def _close_together(connection: BaseDatabaseWrapper, second: BaseDatabaseWrapper) -> None:
    # Whoever closes the caller's connection (connections.close_all(), a test runner
    # dropping its database, Celery after a task) closes the second one too.
    close = connection.close

    def close_both() -> None:
        try:
            close()
        finally:
            second.close()

    connection.close = close_both  # type: ignore[method-assign]


@contextmanager
def claiming(alias: str) -> Iterator[None]:
    """Run the enclosed claim-side statements where they commit at once.

    Where the caller's connection is inside a transaction, ``connections[alias]`` is this
    thread's second connection for the duration (so the store's statements, the ORM and
    ``transaction.atomic(using=alias)`` all use it); elsewhere nothing changes.
    """
    if not separate(alias):
        yield
        return
    connection = connections[alias]
    connections[alias] = _second_connection(connection)
    try:
        yield
    finally:
        connections[alias] = connection


def refuse_unkeepable(alias: str, policy: str, where: str) -> None:
    """Raise ``ImproperlyConfigured`` where the claim could not keep its promise:

    - ``"resume"`` inside a caller's transaction: its steps could not commit as they finish;
    - SQLite inside a caller's transaction, for any policy but ``"retry"``: the claim could
      not commit on its own, so the policy could not hold across a crash;
    - a caller's transaction under ``REPEATABLE READ`` or ``SERIALIZABLE`` on PostgreSQL:
      its snapshot cannot see a claim committed on the second connection, so the completion
      would never find the record.
    """
    connection = connections[alias]
    if not in_callers_transaction(connection):
        return
    if policy == "resume":
        raise ImproperlyConfigured(
            f"{where} uses the recovery policy 'resume' inside a transaction of the caller's "
            f"on {alias!r}. Its steps must each commit as they finish, so that a later "
            "attempt finds them after a crash; inside the caller's transaction they would "
            "commit only with it. Call it outside transaction.atomic() (for views: the mixin "
            "and plain @idempotent views are taken out of ATOMIC_REQUESTS; put "
            "@transaction.non_atomic_requests above @api_view)."
        )
    if connection.vendor == "sqlite" and policy != "retry":
        raise ImproperlyConfigured(
            f"{where} uses the recovery policy {policy!r} inside a transaction on the SQLite "
            f"database {alias!r}. SQLite cannot commit the claim on its own while that "
            "transaction is open, so the policy could not hold across a crash. Call it "
            "outside transaction.atomic() (for views: turn ATOMIC_REQUESTS off, or put "
            "@transaction.non_atomic_requests above @api_view), or use PostgreSQL or MariaDB."
        )
    level = _snapshot_isolation(connection)
    if level is not None:
        raise ImproperlyConfigured(
            f"{where} runs inside a {level.upper()} transaction on {alias!r}: its snapshot "
            "cannot see a claim committed on its own, so the operation could never "
            "complete. Call it in a READ COMMITTED transaction (Django's default) or "
            "outside transaction.atomic()."
        )


def _snapshot_isolation(connection: BaseDatabaseWrapper) -> str | None:
    """The caller's isolation level where it keeps the claim out of the caller's sight (or,
    on MariaDB/MySQL, makes the caller's reads lock what the claim must write), else None."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('transaction_isolation')")
            (level,) = cursor.fetchone()
        return str(level) if level in ("repeatable read", "serializable") else None
    if connection.vendor == "mysql":
        # InnoDB's UPDATE reads the latest committed row under REPEATABLE READ; SERIALIZABLE
        # turns the caller's reads into shared locks that the claim's insert would wait on.
        # Django sets the level per session from OPTIONS["isolation_level"].
        level = getattr(connection, "isolation_level", None)
        return "serializable" if level == "serializable" else None
    return None


def close_idle(**kwargs: Any) -> None:
    """``request_started`` / ``request_finished`` receiver: close the second connections as
    Django closes its own (``CONN_MAX_AGE``, unusable after an error)."""
    if not _made:
        return
    for connection in connections.all(initialized_only=True):
        second: BaseDatabaseWrapper | None = getattr(connection, _ATTRIBUTE, None)
        if second is not None:
            second.close_if_unusable_or_obsolete()
