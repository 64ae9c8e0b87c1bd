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

That claim connection is ``IDEMPOTENCY["CLAIM_DATABASE"]`` when it is set (a ``DATABASES``
alias for the same database, through a PgBouncer pool of its own, say; Django opens and
closes it as any other). Otherwise it is a connection of the claim's own, made only when it
is needed, one per thread and database, with the caller's settings but never from the
caller's Django pool: a pool sized to the server's threads would starve in a burst, every
thread holding its connection and waiting for a second one. It is closed when the request
ends, as Django closes its own. How long a claim waits for it, and for its statements, is
bounded by ``CLAIM_TIMEOUT``; past it the claim fails (``StoreUnavailable``, ``503``) and
nothing ran.

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

import contextlib
import logging
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency import _retry
from django_idempotency._policies import recovery_policy
from django_idempotency._vendors import of
from django_idempotency.conf import app_settings

logger = logging.getLogger("django_idempotency")

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
# The CLAIM_TIMEOUT a second connection was made under, kept in its settings.
_BOUND = "_django_idempotency_claim_timeout"
# A statement the claim connection runs after each connect (MariaDB's lock-wait bound, where
# the project's init_command is its own), kept in its settings.
_AFTER_CONNECT = "_django_idempotency_after_connect"
# Whether this process ever made a second connection: until it has, closing them after a
# request has nothing to look at.
_made = False


def in_callers_transaction(connection: BaseDatabaseWrapper) -> bool:
    """Whether a statement on ``connection`` would commit only with a transaction the caller
    opened (an atomic block that is not a test case's, or autocommit turned off)."""
    if connection.in_atomic_block:
        blocks: list[Any] = connection.atomic_blocks
        return not (blocks and getattr(blocks[0], "_from_testcase", False))
    if connection.connection is None:
        # An unopened connection is in autocommit as soon as it connects, unless its entry
        # turns autocommit off (AUTOCOMMIT: False, a project that manages its transactions
        # itself): then its first statement begins the caller's transaction.
        return not connection.settings_dict.get("AUTOCOMMIT", True)
    return not connection.get_autocommit()


def _second_connection(connection: BaseDatabaseWrapper) -> BaseDatabaseWrapper:
    claims = app_settings.CLAIM_DATABASE
    if claims is not None:
        claim = connections[claims]
        if claim.in_atomic_block or not (
            claim.get_autocommit()
            if claim.connection is not None
            else claim.settings_dict.get("AUTOCOMMIT", True)
        ):
            # (An unopened connection whose entry turns AUTOCOMMIT off would begin a
            # transaction with the claim, never committed: check E038 reports that entry.)
            raise ImproperlyConfigured(
                f"IDEMPOTENCY['CLAIM_DATABASE'] ({claims!r}) is inside a transaction: its "
                "claims must commit at once. Open no transaction on that alias."
            )
        _bound_lock_wait(claim)
        return claim
    second: BaseDatabaseWrapper | None = getattr(connection, _ATTRIBUTE, None)
    if second is not None and second.settings_dict.get(_BOUND) != app_settings.CLAIM_TIMEOUT:
        # Made under another CLAIM_TIMEOUT: its timeouts are fixed when it connects (on
        # MariaDB, the server's lock wait too), so it is replaced rather than left to wait
        # longer than the bound now in force.
        second.close()
        second = None
    if second is None:
        global _made
        _made = True
        second = type(connection)(_claim_settings(connection), connection.alias)
        _bound_after_connect(second)
        if getattr(connection, _ATTRIBUTE, None) is None:
            _close_together(connection)
        setattr(connection, _ATTRIBUTE, second)
    elif second.errors_occurred:
        # A connection that failed (the server restarted, a backend was terminated, the
        # claim's time ran out) is replaced rather than reused broken.
        second.close_if_unusable_or_obsolete()
        second.errors_occurred = False
    else:
        # CONN_HEALTH_CHECKS, as Django applies them to its own: once per request.
        second.close_if_health_check_failed()
    return second


def _claim_settings(connection: BaseDatabaseWrapper) -> dict[str, Any]:
    """The caller's ``DATABASES`` entry for a claim connection of its own: the same server
    and options (the same PgBouncer), never the caller's Django pool, in autocommit (an
    entry with ``AUTOCOMMIT`` off included), and a connect timeout within
    ``CLAIM_TIMEOUT`` where none is set."""
    options = {k: v for k, v in connection.settings_dict["OPTIONS"].items() if k != "pool"}
    seconds = _whole_seconds(app_settings.CLAIM_TIMEOUT)
    # Each vendor's bounds: a connect timeout, and on MariaDB the statements' and the
    # server's lock wait (its after_connect: see _bound_after_connect).
    after_connect = of(connection.alias).claim_connection_options(options, seconds)
    return {
        **connection.settings_dict,
        "OPTIONS": options,
        # Its claims commit at once, whatever the caller's entry says of autocommit.
        "AUTOCOMMIT": True,
        _BOUND: app_settings.CLAIM_TIMEOUT,
        _AFTER_CONNECT: after_connect,
    }


# The (server connection, seconds) a CLAIM_DATABASE connection's lock wait was bounded for.
_LOCK_WAIT_BOUND = "_django_idempotency_lock_wait_bound"


def _bound_lock_wait(claim: BaseDatabaseWrapper) -> None:
    # CLAIM_DATABASE is the project's own alias, connected with its own settings: its lock
    # wait is bounded (where the vendor needs it: MariaDB's server waits on after the
    # client left) once per server connection and CLAIM_TIMEOUT, so that a claim the
    # caller gave up on is never committed after it there either.
    seconds = _whole_seconds(app_settings.CLAIM_TIMEOUT)
    bound = of(claim.alias).lock_wait_bound(seconds)
    if bound is None:
        return
    claim.ensure_connection()
    done = getattr(claim, _LOCK_WAIT_BOUND, None)
    if done is not None and done[0] is claim.connection and done[1] == seconds:
        return
    with claim.cursor() as cursor:
        cursor.execute(bound)
    setattr(claim, _LOCK_WAIT_BOUND, (claim.connection, seconds))


def _bound_after_connect(second: BaseDatabaseWrapper) -> None:
    # A project's init_command of its own runs first; the claim connection's lock wait is
    # bounded right after it, on every connect of that connection.
    statement = second.settings_dict.get(_AFTER_CONNECT)
    if statement is None:
        return
    init = second.init_connection_state

    def bounded_init() -> None:
        init()
        with second.connection.cursor() as cursor:
            cursor.execute(statement)

    second.init_connection_state = bounded_init  # type: ignore[method-assign]


def _follow_tenant(caller: BaseDatabaseWrapper, claim: BaseDatabaseWrapper) -> None:
    """Give the claim connection the caller's tenant, where the backend keeps one on the
    connection: django-tenants' (``set_tenant``, whose ``search_path`` each cursor sets).
    A claim made in another schema than the caller's work would never be completed by it, or
    would meet another tenant's record. Copied before every claim, since one thread serves
    one tenant after another."""
    tenant = getattr(caller, "tenant", None)
    set_tenant = getattr(claim, "set_tenant", None)
    if tenant is None or set_tenant is None:
        return
    public = getattr(caller, "include_public_schema", True)
    if getattr(claim, "tenant", None) is not tenant or (
        getattr(claim, "include_public_schema", True) != public
    ):
        set_tenant(tenant, public)


def _whole_seconds(duration: timedelta) -> int:
    return max(1, math.ceil(duration.total_seconds()))


def separate(alias: str) -> bool:
    """Whether claim-side statements on ``alias`` go to the second connection now."""
    return of(alias).separate_claims and in_callers_transaction(connections[alias])


def _close_together(connection: BaseDatabaseWrapper) -> None:
    # Whoever closes the caller's connection (connections.close_all(), a test runner
    # dropping its database, Celery after a task) closes its second one too (whichever it
    # is by then).
    close = connection.close

    def close_both() -> None:
        try:
            close()
        finally:
            second: BaseDatabaseWrapper | None = getattr(connection, _ATTRIBUTE, None)
            if second is not None:
                second.close()

    connection.close = close_both  # type: ignore[method-assign]


@contextmanager
def claiming(alias: str) -> Iterator[datetime | None]:
    """Run the enclosed claim-side statements where they commit at once.

    Where the caller's connection is inside a transaction, ``connections[alias]`` is this
    thread's second connection for the duration (so the store's statements, the ORM and
    ``transaction.atomic(using=alias)`` all use it); elsewhere nothing changes.

    Yields the time after which a claim statement must write nothing (see :func:`_bounded`),
    or ``None`` where no watchdog bounds the block.
    """
    if not separate(alias):
        yield None
        return
    connection = connections[alias]
    claim = _second_connection(connection)
    _follow_tenant(connection, claim)
    connections[alias] = claim
    try:
        with _bounded(claim, app_settings.CLAIM_TIMEOUT) as deadline, _retry.bounded():
            yield deadline
    finally:
        connections[alias] = connection


@contextmanager
def _bounded(claim: BaseDatabaseWrapper, timeout: timedelta) -> Iterator[datetime | None]:
    """Interrupt the claim connection's statements when the block outlasts ``timeout``.

    Yields the block's deadline (``None`` on MySQL and MariaDB). The watchdog's close may
    cut the answer of a statement that committed a moment before it. A claim's insert or
    takeover that reaches the server after the deadline therefore writes nothing (its guard
    compares the server's clock with the deadline): what the close can still cut is only a
    statement that reached the server before the deadline and took more than the second
    until the close to commit and answer.

    On PostgreSQL a statement waiting for the server (a row lock) is cancelled; a client
    waiting in a pooler's queue for a server connection (PgBouncer ignores a cancel request
    for it) has its connection closed a second later, which ends the wait and leaves nothing
    for the pooler to run. Either way the statement raises, the claim fails closed, and the
    connection is replaced on its next use. (MySQL and MariaDB bound their statements with
    ``read_timeout``, in :func:`_claim_settings`.)
    """
    if not of(claim.alias).watchdog:
        yield None
        return
    # Aware and in UTC whatever USE_TZ says: it is compared with the server's clock.
    deadline = datetime.now(dt_timezone.utc) + timeout
    # The block's end and the watchdog's acts take turns: a watchdog that fires late never
    # cancels or closes what the next block runs on the same connection.
    turn = threading.Lock()
    finished = threading.Event()

    def interrupt() -> None:
        with turn:
            raw = claim.connection
            if raw is None or finished.is_set():
                return
            # psycopg 3.2+ (psycopg2 has cancel() only); a cancel that cannot be sent is
            # left to the close below.
            cancel = getattr(raw, "cancel_safe", None)
            with contextlib.suppress(Exception):
                cancel(timeout=1) if cancel is not None else raw.cancel()
        logger.warning(
            "a claim connection to %r gave no answer within CLAIM_TIMEOUT (%s): its "
            "statement was cancelled and the claim fails closed",
            claim.alias,
            timeout,
        )
        if not finished.wait(1):
            with turn:
                if not finished.is_set():
                    raw.close()

    timer = threading.Timer(timeout.total_seconds(), interrupt)
    timer.daemon = True
    timer.start()
    try:
        yield deadline
    finally:
        with turn:
            finished.set()
        timer.cancel()


def discard_broken(alias: str) -> bool:
    """After a claim-side statement failed: close the connection it ran on when that
    connection is broken (a terminated backend, a restarted server) and may be replaced;
    ``True`` when a retry would run on a fresh one. The claim's own connection (inside a
    caller's transaction) is always replaced. The caller's connection is kept when it still
    answers (the statement failed for its own reasons), and always inside a transaction
    (closing it would end the caller's transaction)."""
    if separate(alias):
        claims = app_settings.CLAIM_DATABASE
        claim = (
            connections[claims]
            if claims is not None
            else getattr(connections[alias], _ATTRIBUTE, None)
        )
    else:
        claim = connections[alias]
    if claim is None or claim.in_atomic_block:
        return False
    if claim.connection is None:  # never connected (the connect failed): nothing to close
        return True
    if claim is not connections[alias]:
        # The claim's own connection (or CLAIM_DATABASE's): replaced, never probed. A probe
        # through a pooler whose queue made the claim fail would wait in that queue, with
        # no CLAIM_TIMEOUT to bound it.
        claim.close()
        return True
    try:
        usable = claim.is_usable()
    except Exception:  # a driver that cannot even ask (MySQLdb on a half-made connection)
        usable = False
    if usable:
        return False
    claim.close()
    return True


#: Where a protected view is inside the request's transaction, and the ways out.
_VIEWS_LEFT_IN = (
    "A protected view is inside one only where it stays in ATOMIC_REQUESTS' transaction: "
    "under ASGI, a class-based view or a django-ninja path that protects some of its "
    "methods only (Django wraps the view before the request's method can reach the "
    "package), and a view reached through a per-request URLconf. Decorate the class's "
    "dispatch (method_decorator(idempotent(...), name='dispatch')) so that every method "
    "reaches the engine, give a ninja path's plain operations a path of their own, or put "
    "transaction.non_atomic_requests on the view."
)


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
    declared = recovery_policy(policy)
    if declared.resumable:
        raise ImproperlyConfigured(
            f"{where} uses the recovery policy 'resume' inside a transaction of the caller's "
            f"on {alias!r}. Its steps must each commit as they finish, so that a later "
            "attempt finds them after a crash; inside the caller's transaction they would "
            f"commit only with it. Call it outside transaction.atomic(). {_VIEWS_LEFT_IN}"
        )
    if not of(alias).separate_claims and declared.durable_claim:
        raise ImproperlyConfigured(
            f"{where} uses the recovery policy {policy!r} inside a transaction on the SQLite "
            f"database {alias!r}. SQLite cannot commit the claim on its own while that "
            "transaction is open, so the policy could not hold across a crash. Call it "
            "outside transaction.atomic(), or use PostgreSQL or MariaDB. "
            f"{_VIEWS_LEFT_IN}"
        )
    level = of(alias).snapshot_isolation(connection)
    if level is not None:
        raise ImproperlyConfigured(
            f"{where} runs inside a {level.upper()} transaction on {alias!r}: its snapshot "
            "cannot see a claim committed on its own, so the operation could never "
            "complete. Call it in a READ COMMITTED transaction (Django's default) or "
            "outside transaction.atomic()."
        )


def close_idle(**kwargs: Any) -> None:
    """``request_started`` / ``request_finished`` receiver: close the second connections as
    Django closes its own (``CONN_MAX_AGE``, unusable after an error)."""
    if not _made:
        return
    for connection in connections.all(initialized_only=True):
        second: BaseDatabaseWrapper | None = getattr(connection, _ATTRIBUTE, None)
        if second is not None:
            second.close_if_unusable_or_obsolete()


def close_unused_connections() -> None:
    """Close this thread's connections where ``CONN_MAX_AGE`` says so, as Django does at the
    end of a request: for the threads that run a tool call or an async task's delivery and
    outlive it (the SDK's, asgiref's), which no request's end reaches."""
    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:
            continue
        try:
            connection.close_if_unusable_or_obsolete()
        except Exception:  # a driver that cannot tell (MySQLdb after a failed connect)
            connection.close()
