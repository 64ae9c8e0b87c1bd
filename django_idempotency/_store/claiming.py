"""The claim: a new key inserted, or the record in its way handed back, and a replaceable
record (expired, or a stale lease of the same request) taken over; and the completion that
ends a claim with its outcome, the other statement of every first request.

The database's unique constraint on ``(account, operation, key)`` picks the single winner,
never a read before a write. Each statement is its own short transaction: a duplicate sees
the claim at once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
import uuid
import weakref
from collections.abc import Callable
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

from django.db import DataError, IntegrityError, OperationalError, connections, transaction
from django.db.models import Case, F, Value, When
from django.db.models.functions import Length
from django.utils import timezone

from django_idempotency import _policies, _retry, crypto, states
from django_idempotency._context import Operation
from django_idempotency._store.owner import forget_steps, refuse_too_large
from django_idempotency._store.records import STATE_COLUMNS, ClaimResult, RecordState
from django_idempotency._store.statements import (
    claim_row,
    cursor,
    owned_by,
    prepared_row,
    returning,
    table,
)
from django_idempotency._vendors import of
from django_idempotency._vendors.postgresql import (
    CLAIM,
    CLAIM_ARGUMENTS,
    LATE,
    ON_TIME,
    claim_text,
    refusal,
)
from django_idempotency.conf import app_settings
from django_idempotency.models import IdempotencyRecord

__all__ = ["adopt_legacy", "begin_riding", "claim", "complete", "fetch"]

logger = logging.getLogger("django_idempotency")

# Why a claim bounded by a deadline (see claim) wrote nothing.
_LATE = "the claim reached the database after CLAIM_TIMEOUT, on the database server's clock"

# How often one claim looks again when the record in its way vanished (was released) or was
# committed after its statement's snapshot; each look is one statement.
_LOOKS = 3


def claim(op: Operation, now: datetime, deadline: datetime | None = None) -> ClaimResult:
    """Claim ``op``'s record at ``now``, each statement its own short transaction.

    A new key: one statement inserts it. An existing key: the same statement hands its row
    back, and nothing is written, unless the record is replaceable (expired, or a stale lease
    of the same request), which takes one conditional statement more. A record whose outcome
    cannot be read back is refused by the caller, never replaced within its TTL.

    ``deadline`` (PostgreSQL, a claim that a watchdog bounds): an insert or a takeover that
    reaches the server after it (on the server's clock) writes nothing, and the claim raises
    ``OperationalError``; so does a claim that would send its takeover after it.
    """
    # One bound for the whole claim, its retries included (see _Held).
    started = time.monotonic()
    # retrying()'s loop, kept here: the claim is on every request's path.
    for attempt in range(_retry.ATTEMPTS):
        try:
            if op.legacy is not None:  # a rare name, which an earlier release spelled so
                adopt_legacy(op)
            return _claim(op, now, started, deadline)
        except OperationalError as exc:
            _retry.pause_or_raise(exc, attempt)
    raise AssertionError("unreachable")


def _claim(op: Operation, now: datetime, started: float, deadline: datetime | None) -> ClaimResult:
    held: _Held | None = None  # made only when a batch is in the way
    look = 0
    while look < _LOOKS:
        look += 1
        found = _insert_or_existing(op, now, deadline)
        if isinstance(found, ClaimResult):
            return found
        state = found or fetch(op)
        if state is None:
            continue  # released meanwhile: try the insert again
        if not state.replaceable_by(op, now):
            return ClaimResult(state=state, claimed=False)
        if deadline is not None and datetime.now(dt_timezone.utc) >= deadline:
            raise OperationalError(_LATE)
        token = uuid.uuid4()
        current = _take_over(op, now, token, state, deadline) or fetch(op)
        if current is not None:
            claimed = current.lease_token == token
            if not claimed and states.EXPIRED.test(vars(current), now=now):
                # Another transaction held the expired row and replaced nothing (the
                # rotation resealing its response, a purge's batch): never replay it, look
                # again once it lets go, for at most CLAIM_TIMEOUT. (A stale lease held so
                # is refused at once: its owner is completing inside its caller's
                # transaction.)
                held = held or _Held(started)
                if held.wait():
                    look -= 1  # waiting for a batch is not a look
                    # The claim is made now, not before the wait: its lease is counted
                    # from here.
                    now = timezone.now()
                    continue
                break
            if claimed and states.EXPIRED.test(vars(state), now=now):
                # An expired record replaced by a new operation: an earlier operation's
                # steps (recovery "resume") are not this one's.
                forget_steps(op.alias, state.id)
            return ClaimResult(state=current, claimed=claimed)
    raise IntegrityError("the idempotency record kept vanishing or changing during one claim")


# How long before CLAIM_TIMEOUT the wait for a batch gives up: inside a caller's
# transaction a watchdog interrupts the claim connection's statements at CLAIM_TIMEOUT
# (_autonomous._bounded), and the looks after a pause must end before it.
_MARGIN = 0.3


class _Held:
    """The pauses of one claim while a batch holds the expired record in its way: doubling
    from 10 ms to 200 ms, until shortly before ``CLAIM_TIMEOUT`` from the claim's start."""

    __slots__ = ("deadline", "pause")

    def __init__(self, started: float) -> None:
        self.deadline = started + app_settings.CLAIM_TIMEOUT.total_seconds() - _MARGIN
        self.pause = 0.01

    def wait(self) -> bool:
        """Pause, or ``False`` when the bound would pass first."""
        if time.monotonic() + self.pause > self.deadline:
            return False
        time.sleep(self.pause)
        self.pause = min(self.pause * 2, 0.2)
        return True


#: The driver's connections whose first claim was sent (as text, :func:`claim_text`): the
#: next ones call the claim's function, whose plans the server keeps for the connection.
_function_called: weakref.WeakSet[Any] = weakref.WeakSet()


def _prepares(connection: Any) -> bool:
    # With prepared statements (a connection kept for many requests) the call is prepared.
    return connection.settings_dict["OPTIONS"].get("prepare_threshold") is not None


@functools.lru_cache(maxsize=64)
def _relaxed_commit(recovery_policy: str) -> bool:
    """Whether the claim's commit need not wait for its WAL flush (the policy's claim need
    not be durable: ``"retry"``, whose claim may be lost only with the work it guards)."""
    return not _policies.recovery_policy(recovery_policy).durable_claim


def _insert_or_existing(
    op: Operation, now: datetime, deadline: datetime | None = None
) -> ClaimResult | RecordState | None:
    """Insert the claim (its ``ClaimResult``), or find the record in its way (its state).

    ``None`` when the conflicting record was not visible (committed after the statement's
    snapshot, or released meanwhile).
    """
    if of(op.alias).claim_function:
        # One call of the claim's function, its values bound as they are (psycopg adapts
        # them). Its plans are the server's, kept per connection; with prepare_threshold the
        # one-line call is prepared too (_cursor).
        params: list[Any] = [
            op.account,
            op.operation,
            op.key,
            op.request_hash,
            op.fingerprint_version,
            op.recovery_policy,
            now,
            _elapsed(op.lease),
            _elapsed(op.ttl),
            deadline,
            _relaxed_commit(op.recovery_policy),
        ]
        connection = connections[op.alias]
        with _cursor(op.alias) as statement:
            raw = connection.connection
            if raw in _function_called or _prepares(connection):
                statement.execute(CLAIM, params)
            else:
                # The server connection's first claim: the function's statement as text
                # (claim_text), which spares a connection that serves one request (Django's
                # default CONN_MAX_AGE = 0, ASGI) loading PL/pgSQL and compiling the function.
                statement.execute(claim_text(), dict(zip(CLAIM_ARGUMENTS, params, strict=True)))
                _function_called.add(raw)
            row = statement.fetchone()
        if row is None:
            return None
        if row[0] is None:  # the guard's row: the insert reached the server too late
            raise OperationalError(_LATE)
        if row[1] is None:  # no status: the row is the claim's own insert
            token = row[-2]
            if token.__class__ is not uuid.UUID:
                token = uuid.UUID(str(token))
            return ClaimResult.inserted(op, now, token, row[0])
        return RecordState.in_the_way(row)
    # Elsewhere: an insert, and the record in its way read when the unique constraint
    # refused it. In autocommit (the claim's usual place) a refused INSERT leaves nothing to
    # roll back on SQLite or MariaDB, so no transaction is opened for it (on MariaDB that
    # saves three round trips); inside an atomic block a savepoint keeps the block usable.
    connection = connections[op.alias]
    token = uuid.uuid4()
    row = claim_row(op, token, now)
    try:
        with (
            (
                transaction.atomic(using=op.alias)
                if connection.in_atomic_block
                else contextlib.nullcontext()
            ),
            connection.cursor() as statement,
        ):
            statement.execute(_insert_sql(op.alias, tuple(row)), row)
            record_id = int(statement.lastrowid)
    except IntegrityError:
        return fetch(op)
    return ClaimResult.inserted(op, now, token, record_id)


@functools.lru_cache(maxsize=8)
def _insert_sql(alias: str, columns: tuple[str, ...]) -> str:
    quote = connections[alias].ops.quote_name
    values = ", ".join(f"%({c})s" for c in columns)
    names = ", ".join(quote(c) for c in columns)
    return f"INSERT INTO {table(alias)} ({names}) VALUES ({values})"


def _elapsed(duration: timedelta) -> str:
    """``duration`` as an interval of elapsed time for PostgreSQL's claim function, which
    adds it to the claim's moment: ``N microseconds``, with no day part. A day of an
    interval is a calendar day in the session's time zone (``TIME_ZONE`` under ``USE_TZ =
    False``), an hour short or long across a daylight saving change; the portable claim
    makes the same sum in elapsed time (``records.later``)."""
    return f"{duration // _MICROSECOND} microseconds"


_MICROSECOND = timedelta(microseconds=1)


# -- the takeover of a replaceable record --------------------------------------------------

_TAKEOVER_COLUMNS = (
    "request_hash",
    "fingerprint_version",
    "status",
    "lease_token",
    "lease_expires_at",
    "recovery_policy",
    "response_status",
    "response_headers",
    "response_body",
    "created_at",
    "completed_at",
    "expires_at",
)


@functools.lru_cache(maxsize=16)
def _takeover_sql(alias: str, guarded: bool = False) -> str:
    """Replace a record, fenced by ``states.REPLACEABLE`` evaluated on the row itself.

    The row is taken only when nobody holds it (``FOR UPDATE SKIP LOCKED``): a holder is a
    racing takeover, or an owner completing it inside a transaction of its caller's that has
    not committed yet, and the claim must never wait for either. Matching nothing, the claim
    reads the record and answers it as it stands (in progress: ``409`` / ``InProgress``).
    """
    quote = connections[alias].ops.quote_name
    # A stale lease keeps the policy it was claimed under: the crashed attempt's recovery is
    # that policy's to decide (_recovery.deciding), and the owner records its own policy
    # once it is to run (Claim.record_policy). An expired record starts afresh under the
    # claim's. First among the assignments: MySQL reads a column assigned before it in the
    # same SET as its new value.
    assignments = [
        f"{quote('recovery_policy')} = CASE WHEN {states.EXPIRED.sql(quote)}"
        f" THEN %(recovery_policy)s ELSE {quote('recovery_policy')} END"
    ]
    # Attempts count the takeovers of a stale lease; a fresh start after expiry resets them.
    # Read before the status, the lease and the TTL are assigned, as the policy is: after
    # them, MySQL found every record replaced not expired, and an expired record's
    # replacement was taken for a stale lease taken over, which met its recovery policy
    # ("fail" closed a new request without running it).
    assignments.append(
        f"{quote('recovery_attempts')} = CASE WHEN {states.EXPIRED.sql(quote)} THEN 0"
        f" ELSE {quote('recovery_attempts')} + 1 END"
    )
    assignments += [f"{quote(c)} = %({c})s" for c in _TAKEOVER_COLUMNS if c != "recovery_policy"]
    sql = (
        f"UPDATE {table(alias)} SET {', '.join(assignments)}"
        f" WHERE {quote('id')} = %(id)s AND {states.REPLACEABLE.sql(quote)}"
    )
    if of(alias).takeover_returning:
        # MySQL refuses a subquery on the table it updates: _replace locks there first.
        sql += (
            f" AND {quote('id')} IN (SELECT {quote('id')} FROM {table(alias)}"
            f" WHERE {quote('id')} = %(id)s FOR UPDATE SKIP LOCKED)"
        )
        if not guarded:
            return f"{sql} RETURNING {returning(alias)}"
        # A takeover that reaches the server late replaces nothing, and says so (never read
        # as a row somebody holds).
        sql = (
            f"WITH {LATE}, taken AS ({sql}{ON_TIME} RETURNING {returning(alias)})"
            f" SELECT * FROM taken{refusal(len(STATE_COLUMNS))}"
        )
    return sql


@functools.lru_cache(maxsize=8)
def _lock_free_sql(alias: str) -> str:
    quote = connections[alias].ops.quote_name
    return (
        f"SELECT {quote('id')} FROM {table(alias)} WHERE {quote('id')} = %s FOR UPDATE SKIP LOCKED"
    )


def _take_over(
    op: Operation,
    now: datetime,
    token: uuid.UUID,
    state: RecordState,
    deadline: datetime | None = None,
) -> RecordState | None:
    """Replace ``state``'s record if it is still replaceable and nobody holds its row.

    Returns the new state where the statement can return it (PostgreSQL), else ``None``:
    the caller reads the outcome. ``OperationalError`` when the guard of a ``deadline``
    refused it (see :func:`claim`).
    """
    row = claim_row(op, token, now)
    params = {c: row[c] for c in _TAKEOVER_COLUMNS}
    params.update(
        id=state.id, now=row["created_at"], hash=op.request_hash, version=op.fingerprint_version
    )
    if deadline is not None:
        params["deadline"] = deadline
    if not app_settings.AUDIT:
        return _replace(op.alias, params)
    # With the audit trail on, an expired record is copied before it is replaced, in the same
    # transaction: the copy locks the row first, so of two racing claims one copies it and
    # replaces it, and the other then finds it no longer replaceable. The copy is of the row
    # the statement replaces (its id), and a replacement refused raises: the copy goes with
    # it (a record is copied once, when replaced).
    with transaction.atomic(using=op.alias):
        read = IdempotencyRecord.objects.using(op.alias).filter(pk=state.id)
        read.archive_expired(op.account, op.operation, op.key, now=now)
        return _replace(op.alias, params)


def _replace(alias: str, params: dict[str, Any]) -> RecordState | None:
    if of(alias).takeover_returning:
        with cursor(alias) as statement:
            statement.execute(_takeover_sql(alias, "deadline" in params), params)
            result = statement.fetchone()
        if result is None:
            return None  # held by another transaction, or no longer replaceable
        if result[0] is None:  # the guard's row: the takeover reached the server too late
            raise OperationalError(_LATE)
        return RecordState.from_row(result)
    connection = connections[alias]
    with transaction.atomic(using=alias), connection.cursor() as statement:
        if connection.features.has_select_for_update_skip_locked:
            statement.execute(_lock_free_sql(alias), [params["id"]])
            if statement.fetchone() is None:
                return None  # held by another transaction: left to it
        statement.execute(_takeover_sql(alias), params)
    return None


# -- a record an earlier release wrote ------------------------------------------------------


def adopt_legacy(op: Operation) -> None:
    """Give the record that an earlier release wrote under ``op.legacy``'s spelling of its
    names (see ``_storable.legacy_names``) today's spelling, so that the claim finds it as
    it finds any record: replayed, in progress, or replaced once expired.

    One conditional statement, made only for the names whose spelling changed. The lengths
    are compared as well: MariaDB's collations pad, and would match ``'t1'`` for ``'t1 '``.
    A record of today's spelling already in the way (an earlier release's server writing
    beside this one's) keeps its place, and the other is left to its expiry.
    """
    assert op.legacy is not None
    account, operation = op.legacy[:2]
    changes: dict[str, Any] = {"account": op.account, "operation": op.operation}
    if len(op.legacy) > 2:  # the earlier release hashed the request with its spelling
        changes["request_hash"] = Case(
            When(request_hash=op.legacy[2], then=Value(op.request_hash)),
            default=F("request_hash"),
        )
    written = (
        IdempotencyRecord.objects.using(op.alias)
        .annotate(account_length=Length("account"), operation_length=Length("operation"))
        .filter(
            account=account,
            operation=operation,
            key=op.key,
            account_length=len(account),
            operation_length=len(operation),
        )
    )
    # One statement: in autocommit it needs no transaction of its own (a refused UPDATE
    # leaves nothing to roll back); inside a caller's block a savepoint keeps it usable.
    inside = connections[op.alias].in_atomic_block
    try:
        with transaction.atomic(using=op.alias) if inside else contextlib.nullcontext():
            adopted = written.update(**changes)
    except IntegrityError:
        logger.warning(
            "a record of %s written by an earlier release was left under its old spelling: "
            "a record of today's spelling is in its way",
            op.operation,
        )
        return
    if adopted:
        logger.info("adopted a record of %s written by an earlier release", op.operation)


# -- reading a record ------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _fetch_sql(alias: str) -> str:
    quote = connections[alias].ops.quote_name
    identity = " AND ".join(f"{quote(c)} = %s" for c in ("account", "operation", "key"))
    return f"SELECT {returning(alias)} FROM {table(alias)} WHERE {identity}"


def fetch(op: Operation) -> RecordState | None:
    """The current state of ``op``'s record, or ``None`` when there is none."""
    with cursor(op.alias) as statement:
        statement.execute(_fetch_sql(op.alias), [op.account, op.operation, op.key])
        row = statement.fetchone()
    return RecordState.from_row(row) if row is not None else None


# -- the completion ------------------------------------------------------------------------
# The other statement of every first request, beside the claim: the owner's other
# statements (the release, the give-back, the steps) are in .owner.


@functools.lru_cache(maxsize=8)
def _carries_commit(alias: str) -> bool:
    return of(alias).carries_commit(connections[alias])


def _commits_here(connection: Any) -> bool:
    """Whether the completion may carry the transaction's ``COMMIT`` (:func:`complete`).

    Where the vendor's driver allows it (:meth:`.Vendor.carries_commit`: PostgreSQL through
    psycopg 3) and the statements are sent as text with their values (Django's default: no
    ``server_side_binding``, no ``prepare_threshold``); and with one atomic block open,
    which commits when it ends: inside a caller's transaction (a second block), or with
    autocommit off, the COMMIT is the caller's.
    """
    options = connection.settings_dict["OPTIONS"]
    return (
        len(connection.atomic_blocks) == 1
        and connection.commit_on_exit
        and options.get("prepare_threshold") is None
        and not options.get("server_side_binding")
        and _carries_commit(connection.alias)
    )


def begin_riding(connection: Any) -> Any:
    """Where the completion will carry the ``COMMIT`` (:func:`_commits_here`), have the
    block's ``BEGIN`` ride with its first statement (:class:`_BeginRider`, installed among
    the connection's execute wrappers): a first request's transaction then takes the round
    trips of its statements only. Returns the rider, which the caller removes from
    ``connection.execute_wrappers`` if it is still there when the block ends (the block
    sent no statement), or ``None``."""
    if not _commits_here(connection):
        return None
    raw = connection.connection
    if getattr(raw, "_autocommit", None) is not raw.autocommit:
        return None  # a psycopg that keeps its flag elsewhere (see _BeginRider): its BEGIN
    rider = _BeginRider(connection)
    connection.execute_wrappers.append(rider)
    return rider


class _BeginRider:
    """Django's execute wrapper that sends a transaction's ``BEGIN`` with its first
    statement, as one text of two statements (psycopg sends a text without parameters by
    the simple query protocol, which takes several), instead of a round trip of its own.

    It wraps one statement, the first of the block, and then leaves the connection's
    wrappers. It does nothing (psycopg then sends its ``BEGIN`` alone, as it always does)
    for ``executemany``, a server-side cursor, a statement not given as text, inside
    psycopg's pipeline mode, while Django logs its queries (``DEBUG``,
    ``CaptureQueriesContext``: the log reads the text psycopg sent), outside an atomic
    block (a rider an interrupted block left behind), or when the body installed execute
    wrappers of its own (they come after this one, and would see the ``BEGIN`` in the
    statement's text; the wrappers installed before the block see the statement as Django
    sends it).

    psycopg sends no ``BEGIN`` of its own while its connection is in autocommit: the
    connection is put there for the statement only. Once the statement has begun the
    transaction, the connection is left as psycopg's own ``BEGIN`` leaves it, out of
    autocommit: psycopg's setter refuses the change inside a transaction, so the flag is
    set where the setter keeps it (:func:`begin_riding` rides only where that is
    ``_autocommit``). Left in autocommit, Django would declare the block's server-side
    cursors ``WITH HOLD`` (PostgreSQL refuses one ``FOR UPDATE``, and runs one still open
    to its end at the ``COMMIT``), and psycopg would autocommit every statement after a
    rollback on the driver (a caller's wrapper retrying a statement) inside the still open
    block. A statement that never reached the server (refused by the client, or a text the
    server cannot parse) leaves the connection as it found it.

    The ``BEGIN`` carries the transaction characteristics (isolation level, read only,
    deferrable) psycopg's connection has when the statement is sent, as psycopg's own would.
    """

    __slots__ = ("connection",)

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def __call__(
        self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any
    ) -> Any:
        wrappers = self.connection.execute_wrappers
        last = wrappers[-1] is self if wrappers else False
        if self in wrappers:  # the first statement only (a wrapper may run it again)
            wrappers.remove(self)
        raw: Any = self.connection.connection
        cursor = context["cursor"].cursor
        if (
            not last
            or not self.connection.in_atomic_block  # left behind by an interrupted block
            or self.connection.queries_logged  # the log reads the text psycopg sent
            or many
            or sql.__class__ is not str
            or cursor.__class__ is not raw.cursor_factory
            or raw.pgconn.transaction_status != _IDLE
            or raw.pgconn.pipeline_status  # psycopg's pipeline mode: one statement a query
        ):
            return execute(sql, params, many, context)
        # The BEGIN psycopg itself would send now: the transaction characteristics the
        # connection has when the transaction begins (a body may set them before its first
        # statement), not those it had when the block was entered.
        begin = "BEGIN"
        if raw.isolation_level is not None:
            begin += f" ISOLATION LEVEL {raw.isolation_level.name.replace('_', ' ')}"
        if raw.read_only is not None:
            begin += " READ ONLY" if raw.read_only else " READ WRITE"
        if raw.deferrable is not None:
            begin += " DEFERRABLE" if raw.deferrable else " NOT DEFERRABLE"
        raw.autocommit = True
        try:
            result = execute(f"{begin}; {sql}", params, many, context)
        finally:
            if raw.pgconn.transaction_status == _IDLE:
                raw.autocommit = False  # the BEGIN never reached the server
            else:
                # The transaction is open (or the connection lost): out of autocommit, as
                # psycopg's own BEGIN leaves it.
                raw._autocommit = False
        cursor.nextset()  # the statement's own result, after the BEGIN's
        return result


def _cursor(alias: str) -> Any:
    # Without OPTIONS["prepare_threshold"] (Django's default) statements.cursor() answers
    # Django's own cursor: taken here at once, on every first request's path.
    connection = connections[alias]
    if not _prepares(connection):
        return connection.cursor()
    return cursor(alias)


@functools.lru_cache(maxsize=8)
def _complete_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    stored = ("status", "response_status", "response_headers", "response_body", "completed_at")
    cleared = ("lease_token", "lease_expires_at")
    assignments = [f"{q(c)} = %s" for c in stored] + [f"{q(c)} = NULL" for c in cleared]
    assignments[2] += of(alias).headers_cast  # the headers come as JSON text
    return f"UPDATE {table(alias)} SET {', '.join(assignments)} WHERE {owned_by(q)}"


@functools.lru_cache(maxsize=8)
def _complete_and_commit_sql(alias: str) -> str:
    # The completion and the transaction's COMMIT in one round trip (_commits_here).
    # The fence holds as the UPDATE's row count did: when the UPDATE finds no row of this
    # lease, the division by zero fails the statement before the COMMIT is reached, the
    # transaction is left aborted, and the atomic block rolls the work back.
    update = _complete_sql(alias)
    return f"WITH done AS ({update} RETURNING 1) SELECT 1 / count(*) FROM done; COMMIT"


_DIVISION_BY_ZERO = "22012"
# psycopg's pq.TransactionStatus: no transaction open; a statement failed inside one.
_IDLE = 0
_ABORTED = 3


def complete(
    alias: str,
    record_id: int,
    token: uuid.UUID,
    *,
    status: str,
    response_status: int,
    response_headers: list[list[str]],
    response_body: bytes,
    now: datetime,
    commit: bool = False,
) -> bool:
    """Store the outcome, fenced by the lease token (:func:`.statements.owned_by`), on the
    caller's connection, in its transaction. ``False``: the lease was lost.

    ``commit``: where the connection allows it (:func:`_commits_here`: PostgreSQL on
    Django's defaults, the completion inside the only atomic block), the transaction's
    ``COMMIT`` goes in the same round trip, and the block finds nothing left to commit when
    it ends. A lost lease leaves the transaction aborted, for that block to roll back.
    """
    if app_settings.ENCRYPTION_KEYS:
        headers, body = crypto.seal_response(response_headers, response_body)
    else:
        headers, body = response_headers, response_body
    vendor = of(alias)
    if vendor.packet_limit_sql is not None:  # a server that caps a statement's size
        refuse_too_large(alias, body, json.dumps(headers))
    if vendor.native_values:
        # As the JSON field would store it (json.dumps), without its per-call preparation;
        # psycopg adapts the rest, the token included, as it is.
        params: list[Any] = [status, response_status, json.dumps(headers), body, now, token]
    else:
        row = prepared_row(
            alias,
            {
                "response_headers": headers,
                "response_body": body,
                "completed_at": now,
                "lease_token": token,
            },
        )
        params = [status, response_status, row["response_headers"], row["response_body"]]
        params += [row["completed_at"], row["lease_token"]]
    # The fence's values in owned_by's order: the record, the token, still in progress.
    params.insert(5, record_id)
    params.append(states.IN_PROGRESS)
    connection = connections[alias]
    if commit and _commits_here(connection):
        with connection.cursor() as statement:
            try:
                statement.execute(_complete_and_commit_sql(alias), params)
            except DataError as exc:
                # The fence's division by zero leaves the transaction aborted (the COMMIT
                # skipped). The same error from the COMMIT itself (a deferred trigger of
                # the work's) ends the transaction: that is the commit failing, not a lost
                # lease.
                if (
                    getattr(exc.__cause__, "sqlstate", None) == _DIVISION_BY_ZERO
                    and connection.connection.info.transaction_status == _ABORTED
                ):
                    return False
                raise
            return True
    with _cursor(alias) as statement:
        statement.execute(_complete_sql(alias), params)
        return int(statement.rowcount) > 0
