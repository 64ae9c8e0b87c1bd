"""The record's state transitions as database statements.

Every guarantee rests on the database: the unique constraint on ``(account, operation, key)``
picks the single winner of a claim, and row-level conditional updates fence completion by the
lease token. Nothing here relies on process memory or a local lock.

The hot path is fixed statements, built once per database: the claim (one statement whatever
the key's state), the fenced completion, the release. The ORM compiles none of them per
request. The rare paths (an expired record, a stale lease) take one conditional statement
more.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, TypeVar

from django.conf import settings
from django.db import IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from django_idempotency import _storable, crypto, states
from django_idempotency._retry import is_retryable, retrying
from django_idempotency.conf import app_settings
from django_idempotency.models import IdempotencyRecord
from django_idempotency.states import COMPLETED, FAILED, IN_PROGRESS

__all__ = [
    "COMPLETED",
    "FAILED",
    "IN_PROGRESS",
    "ClaimRequest",
    "ClaimResult",
    "RecordState",
    "claim",
    "fetch",
    "finish",
    "is_retryable",
    "release",
    "retrying",
]

T = TypeVar("T")
logger = logging.getLogger("django_idempotency")

_STATE_COLUMNS = (
    "id",
    "status",
    "lease_token",
    "lease_expires_at",
    "expires_at",
    "request_hash",
    "fingerprint_version",
    "recovery_attempts",
    "response_status",
    "response_headers",
    "response_body",
)


@dataclass(frozen=True)
class RecordState:
    """What the engine needs to know of a record after a claim attempt or a fetch."""

    id: int
    status: str
    lease_token: uuid.UUID | None
    lease_expires_at: datetime | None
    expires_at: datetime
    request_hash: str
    fingerprint_version: str
    recovery_attempts: int
    response_status: int | None
    response_headers: list[list[str]]
    response_body: bytes | None
    #: Why its stored outcome cannot be read back (sealed with a key no configured key is,
    #: damaged); ``None`` when it can. Within its TTL such a record is refused, never run
    #: again.
    unreadable: crypto.Unreadable | None = None

    @classmethod
    def from_row(
        cls, row: tuple[Any, ...], columns: tuple[str, ...] = _STATE_COLUMNS
    ) -> RecordState:
        """The state from a row of ``columns`` (every state column unless told otherwise;
        a column not read is empty: no lease token, no recovery attempts)."""
        values = dict(zip(columns, row, strict=True))
        values.setdefault("lease_token", None)
        values.setdefault("recovery_attempts", 0)
        token = values["lease_token"]
        if token is not None and not isinstance(token, uuid.UUID):
            token = uuid.UUID(str(token))
        headers, body, unreadable = _stored_response(
            values["status"],
            values["response_status"],
            values["response_headers"],
            values["response_body"],
        )
        values.update(
            response_headers=headers,
            lease_token=token,
            response_body=body,
            lease_expires_at=_aware(values["lease_expires_at"]),
            expires_at=_aware(values["expires_at"]),
            unreadable=unreadable,
        )
        return cls(**values)

    @classmethod
    def in_the_way(cls, row: tuple[Any, ...]) -> RecordState:
        """The state from PostgreSQL's claim: a row of ``_EXISTING_COLUMNS``, its times in
        seconds since the epoch, read on every replay."""
        record_id, status, lease_expires_at, expires_at, request_hash, version = row[:6]
        headers, body, unreadable = _stored_response(status, row[6], row[7], row[8])
        return cls(
            record_id,
            status,
            None,
            None if lease_expires_at is None else _from_epoch(lease_expires_at),
            _from_epoch(expires_at),
            request_hash,
            version,
            0,
            row[6],
            headers,
            body,
            unreadable,
        )

    def replaceable_by(self, request: ClaimRequest) -> bool:
        """Whether ``request`` may replace this record (see ``states.REPLACEABLE``)."""
        return states.REPLACEABLE.test(
            vars(self),
            now=request.now,
            hash=request.request_hash,
            version=request.fingerprint_version,
        )


def _stored_response(
    status: str, response_status: Any, headers: Any, body: Any
) -> tuple[list[list[str]], bytes | None, crypto.Unreadable | None]:
    """A record's stored headers and body as the replay uses them, and why they cannot be
    read back, if they cannot: sealed with no configured key that opens them, headers that
    are not ``[name, value]`` pairs, or a done record without a status to answer."""
    if status == IN_PROGRESS:
        return [], None, None  # nothing is stored yet
    if isinstance(headers, str):
        try:
            headers = json.loads(headers)  # the headers as text (a raw cursor, not jsonb)
        except (ValueError, RecursionError):
            return [], None, crypto.Unreadable(None, "the stored headers are not JSON")
    if isinstance(headers, str):  # sealed (django_idempotency.crypto)
        headers, body, unreadable = crypto.opened(headers, body)
        if unreadable is not None:
            return [], None, unreadable
    if not _storable.header_pairs(headers):
        return [], None, crypto.Unreadable(None, "the stored headers are not [name, value] pairs")
    if response_status.__class__ is not int or not 100 <= response_status <= 599:
        return [], None, crypto.Unreadable(None, "the record holds no valid response status")
    if body is None:  # every outcome stores bytes, if only b"null"
        return [], None, crypto.Unreadable(None, "the record holds no response body")
    return headers or [], _bytes(body), None


def _bytes(body: Any) -> bytes | None:
    return body if body is None or body.__class__ is bytes else bytes(body)


def _aware(value: Any) -> Any:
    # A raw cursor gives SQLite's and MySQL's datetimes as stored (naive, in UTC); the ORM
    # would have made them aware. PostgreSQL's come aware already.
    if value is None or (isinstance(value, datetime) and value.tzinfo is not None):
        return value
    if isinstance(value, str):
        value = parse_datetime(value)
    if isinstance(value, datetime) and settings.USE_TZ and timezone.is_naive(value):
        return timezone.make_aware(value, dt_timezone.utc)
    return value


@dataclass(slots=True)
class ClaimRequest:
    """Everything one claim attempt writes."""

    account: str
    operation: str
    key: str
    request_hash: str
    fingerprint_version: str
    recovery_policy: str
    now: datetime
    lease: timedelta
    ttl: timedelta

    def new_row(self, token: uuid.UUID) -> dict[str, Any]:
        """The columns of a freshly claimed record."""
        return {
            "account": self.account,
            "operation": self.operation,
            "key": self.key,
            "request_hash": self.request_hash,
            "fingerprint_version": self.fingerprint_version,
            "status": IN_PROGRESS,
            "lease_token": token,
            "lease_expires_at": self.now + self.lease,
            "recovery_policy": self.recovery_policy,
            "recovery_attempts": 0,
            "response_status": None,
            "response_headers": [],
            "response_body": None,
            "created_at": self.now,
            "completed_at": None,
            "expires_at": self.now + self.ttl,
        }


@dataclass(frozen=True)
class ClaimResult:
    """The outcome of a claim: ``claimed`` when this attempt now owns the record."""

    state: RecordState
    claimed: bool

    @property
    def took_over_stale_lease(self) -> bool:
        """A claim that replaced an in-progress record whose lease had run out."""
        return self.claimed and self.state.recovery_attempts > 0


# -- fixed statements -------------------------------------------------------------------------


def _prepares(connection: BaseDatabaseWrapper) -> bool:
    """Whether the engine's statements run prepared on this connection.

    PostgreSQL with ``OPTIONS["prepare_threshold"]`` set (Django leaves it ``None``: no
    prepared statements, which PgBouncer in transaction mode needs before 1.21), unless
    Django is logging queries (``DEBUG``, ``CaptureQueriesContext``, ``assertNumQueries``):
    its log reads a statement's text with its values from a client-side cursor only.
    """
    return (
        connection.settings_dict["OPTIONS"].get("prepare_threshold") is not None
        and connection.vendor == "postgresql"
        and not connection.queries_logged
        and connection.alias not in _refused
    )


#: Aliases whose connections refused a prepared statement (a pooler that does not keep
#: them: PgBouncer before 1.21 in transaction mode): the engine prepares nothing there any
#: more, in this process.
_refused: set[str] = set()


def _stop_preparing(alias: str, raw: Any, error: Exception) -> None:
    """Prepare nothing more on ``alias``'s connections, and say why, once."""
    raw.prepare_threshold = None
    if alias not in _refused:
        _refused.add(alias)
        logger.warning(
            "the database %r refused a prepared statement (%s): a pooler in front of it "
            "does not keep them (PgBouncer before 1.21 in transaction mode). The engine's "
            "statements are no longer prepared on it; remove OPTIONS['prepare_threshold'], "
            "or set max_prepared_statements in PgBouncer 1.21+.",
            alias,
            type(error).__name__,
        )


def _cursor(alias: str) -> Any:
    """A cursor for the fixed statements below.

    Django's own, which writes the values into the statement's text (client-side binding),
    unless the connection allows prepared statements (:func:`_prepares`). Then a cursor that
    binds them on the server, so that psycopg prepares each of these statements once it has
    run ``prepare_threshold`` times on the connection, and the server no longer parses and
    plans it on every request (the claim: about 0.2 ms). Django's own cursors do not prepare
    (they bind client-side unless ``OPTIONS["server_side_binding"]`` is set): this is the
    engine's statements only. Wrapped as Django wraps its cursors: its error classes, its
    execute wrappers, its thread check and its health check.
    """
    connection = connections[alias]
    if not _prepares(connection):
        return connection.cursor()
    # As Django's cursor() does; no query log to keep here (see _prepares).
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        return connection.make_cursor(_binding_cursor(connection.alias)(connection.connection))


@functools.lru_cache(maxsize=8)
def _binding_cursor(alias: str) -> Any:
    """Django's server-binding cursor class for ``alias``, made to survive a table changed
    under it and a pooler that does not keep prepared statements.

    A connection keeps what it prepared. When a migration changes the type of a column a
    statement returns, PostgreSQL refuses that statement on the connection from then on
    ("cached plan must not change result type"). Outside a transaction (the claim's place)
    the cursor then drops the connection's prepared statements (``DEALLOCATE ALL``, which
    psycopg sees and forgets its own) and runs the statement once more, prepared anew.
    Inside one, the transaction is lost either way; its rollback makes psycopg drop them.
    """
    # Imported when first needed: the modules need psycopg, which only PostgreSQL does.
    from django.db.backends.postgresql.base import ServerBindingCursor
    from psycopg import errors, pq

    base: Any = ServerBindingCursor  # psycopg's Cursor, which django-stubs does not type

    class PreparingCursor(base):  # type: ignore[misc]
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            try:
                return super().execute(query, params, **kwargs)
            except errors.FeatureNotSupported:
                if self.connection.info.transaction_status != pq.TransactionStatus.IDLE:
                    raise
                self.connection.execute("DEALLOCATE ALL")
                return super().execute(query, params, **kwargs)
            except (errors.InvalidSqlStatementName, errors.DuplicatePreparedStatement) as exc:
                # The statement was prepared on another server connection than the one it
                # ran on: a pooler hands them out per transaction. Outside a transaction it
                # runs again unprepared; inside one the transaction is lost either way.
                _stop_preparing(alias, self.connection, exc)
                if self.connection.info.transaction_status != pq.TransactionStatus.IDLE:
                    raise
                return super().execute(query, params, prepare=False, **kwargs)

    return PreparingCursor


def _table(alias: str) -> str:
    return str(connections[alias].ops.quote_name(IdempotencyRecord._meta.db_table))


def _prepared(alias: str, name: str, value: Any) -> Any:
    field = IdempotencyRecord._meta.get_field(name)
    assert isinstance(field, Field)
    return field.get_db_prep_save(value, connections[alias])


def _prepared_row(alias: str, row: dict[str, Any]) -> dict[str, Any]:
    return {name: _prepared(alias, name, value) for name, value in row.items()}


def _returning(alias: str) -> str:
    quote = connections[alias].ops.quote_name
    return ", ".join(quote(c) for c in _STATE_COLUMNS)


# What the claim hands back of a record in its way, in this order (RecordState.in_the_way):
# what a replay, a conflict and the decision to take it over read. A claim that inserted
# reads nothing back but the id and the lease token: it wrote every other column itself.
_EXISTING_COLUMNS = (
    "id",
    "status",
    "lease_expires_at",
    "expires_at",
    "request_hash",
    "fingerprint_version",
    "response_status",
    "response_headers",
    "response_body",
)

_TIMES = frozenset({"lease_expires_at", "expires_at"})


def _from_epoch(seconds: float) -> datetime:
    """A time the claim read as seconds since the epoch (a double), to the microsecond.

    The double is the one nearest the stored microseconds, which lies within half a
    microsecond of them until the year 2106: rounding to the microsecond (as
    ``fromtimestamp`` does) gives them back exactly. Aware, or naive in the default time
    zone under ``USE_TZ = False``, as Django reads a ``timestamptz`` (and as the claim's
    own clock is).
    """
    moment = datetime.fromtimestamp(seconds, dt_timezone.utc)
    if settings.USE_TZ:
        return moment
    return timezone.make_naive(moment, timezone.get_default_timezone())


# The columns PostgreSQL's claim writes: an expression written into the statement, or None
# for a value bound under the column's own name (or written, when it is the same for every
# request of an operation and a plain word: see _postgres_claim_sql). The lease token is
# drawn by the server, the lease's and the record's ends are the claim's time plus the
# intervals written into the statement ({lease}, {ttl}). The columns it leaves out are NULL.
_CLAIM_COLUMNS: dict[str, str | None] = {
    "account": None,
    "operation": None,
    "key": None,
    "request_hash": None,
    "fingerprint_version": None,
    "status": f"'{IN_PROGRESS}'",
    "lease_token": "gen_random_uuid()",
    "lease_expires_at": "%(created_at)s + {lease}",
    "recovery_policy": None,
    "recovery_attempts": "0",
    "response_headers": "'[]'::jsonb",
    "created_at": None,
    "expires_at": "%(created_at)s + {ttl}",
}


def _interval(value: timedelta) -> str:
    # In microseconds: exact, and a time span that no daylight-saving change stretches.
    return f"interval '{value // _MICROSECOND} microseconds'"


_MICROSECOND = timedelta(microseconds=1)


# A value that may be written into the statement as a string literal as it is: no quote, no
# backslash, no percent sign (the statement is a template of placeholders).
_WRITABLE = re.compile(r"[A-Za-z0-9_.:-]{1,255}")


@functools.lru_cache(maxsize=512)
def _postgres_claim_sql(
    alias: str,
    operation: str,
    fingerprint_version: str,
    recovery_policy: str,
    lease: timedelta,
    ttl: timedelta,
) -> str:
    """The claim: insert a new key, or hand back the existing row, in one statement.

    The INSERT runs only when no row holds the key (``NOT EXISTS``): a replay or a conflict
    then writes nothing, takes no transaction id (not even the id sequence's, which an
    attempted insert would advance) and waits for nobody. Two new claims racing for one key
    meet in ``ON CONFLICT DO NOTHING``, which does not lock the winner's row. The outer
    SELECT hands back the row in the way, from the statement's snapshot. Its first row tells
    which happened: a NULL status is the claim's own insert.

    psycopg writes every value into the text it sends, once per placeholder. What is the
    same for every request of an operation is written into the statement instead, which is
    built once per operation (when its name, fingerprint version and recovery policy are
    plain words: ``_WRITABLE``; otherwise they are bound too): the constants of a new
    record, its lease token (drawn by the server), the lease's and the record's intervals.
    What is bound is the key, the account, the request's hash and the time. (Binding each
    value once, in a one-row ``VALUES``, costs the server some 40 µs more to plan than it
    saves psycopg.)

    Under the recovery policy ``"retry"`` the claim's commit does not wait for its WAL
    flush: the view's own commit, which follows, flushes the claim with it, so a server
    crash can lose a claim only together with the view's work, and an absent claim is what
    ``"retry"`` does anyway. The claim is visible to every other claim at once either way.
    """
    quote = connections[alias].ops.quote_name
    table = _table(alias)
    written = {
        column: f"'{value}'"
        for column, value in (
            ("operation", operation),
            ("fingerprint_version", fingerprint_version),
            ("recovery_policy", recovery_policy),
        )
        if _WRITABLE.fullmatch(value)
    }

    def value_of(column: str) -> str:
        # A bound string is cast to text: bound on the server (prepared statements), a value
        # the statement uses twice must have one type, and the SELECT list gives it none.
        cast = "" if column == "created_at" else "::text"
        return written.get(column, f"%({column})s{cast}")

    columns = ", ".join(quote(column) for column in _CLAIM_COLUMNS)
    values = ", ".join(
        expression.format(lease=_interval(lease), ttl=_interval(ttl))
        if expression
        else value_of(column)
        for column, expression in _CLAIM_COLUMNS.items()
    )
    identity = " AND ".join(f"{quote(c)} = {value_of(c)}" for c in ("account", "operation", "key"))
    # The two times as seconds since the epoch: a double loads in C, where a timestamptz
    # costs Django's loader a zone lookup and a parse in Python (about 15 µs each on a
    # replay). date_part() is a double computed from the stored microseconds; extract()
    # would be exact but numeric, which costs the server some 20 µs more a statement.
    existing = ", ".join(
        f"date_part('epoch', {quote(c)})" if c in _TIMES else quote(c) for c in _EXISTING_COLUMNS
    )
    nulls = ", ".join("NULL" for _ in _EXISTING_COLUMNS[1:])
    durable = recovery_policy != "retry"
    flush = "NULL" if durable else "set_config('synchronous_commit', 'off', true)"
    returned = f"{quote('id')}, {quote('lease_token')}"
    return (
        f"WITH claim AS (INSERT INTO {table} ({columns}) SELECT {values}"
        f" WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE {identity})"
        f" ON CONFLICT (account, operation, key) DO NOTHING RETURNING {returned})"
        f" SELECT {quote('id')}, {nulls}, {quote('lease_token')}, {flush} FROM claim"
        # The outer SELECT shares the INSERT's snapshot, so it never sees the row the claim
        # inserted: no guard is needed to keep the two branches apart.
        f" UNION ALL SELECT {existing}, NULL, NULL FROM {table} WHERE {identity}"
    )


def _inserted(request: ClaimRequest, token: uuid.UUID, record_id: int) -> RecordState:
    """The state of the record a claim has just inserted (nothing read back but its id)."""
    return RecordState(
        id=record_id,
        status=IN_PROGRESS,
        lease_token=token,
        lease_expires_at=request.now + request.lease,
        expires_at=request.now + request.ttl,
        request_hash=request.request_hash,
        fingerprint_version=request.fingerprint_version,
        recovery_attempts=0,
        response_status=None,
        response_headers=[],
        response_body=None,
    )


def _insert_or_existing(alias: str, request: ClaimRequest) -> tuple[RecordState, bool] | None:
    """Insert the claim, or find the record in its way: ``(state, inserted)``.

    ``None`` when the conflicting record was not visible (committed after the statement's
    snapshot, or released meanwhile).
    """
    connection = connections[alias]
    if connection.vendor == "postgresql":
        # PostgreSQL takes these values as they are (psycopg adapts them): no per-field
        # preparation, which only the other backends need (strings for SQLite's times).
        params: dict[str, Any] = {
            "account": request.account,
            "operation": request.operation,
            "key": request.key,
            "request_hash": request.request_hash,
            "fingerprint_version": request.fingerprint_version,
            "recovery_policy": request.recovery_policy,
            "created_at": request.now,
        }
        sql = _postgres_claim_sql(
            alias,
            request.operation,
            request.fingerprint_version,
            request.recovery_policy,
            request.lease,
            request.ttl,
        )
        with _cursor(alias) as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
        if row is None:
            return None
        if row[1] is None:  # no status: the row is the claim's own insert
            token = row[-2]
            if token.__class__ is not uuid.UUID:
                token = uuid.UUID(str(token))
            return _inserted(request, token, row[0]), True
        return RecordState.in_the_way(row), False
    # Elsewhere: an insert, and the record in its way read when the unique constraint
    # refused it. In autocommit (the claim's usual place) a refused INSERT leaves nothing to
    # roll back on SQLite or MariaDB, so no transaction is opened for it (on MariaDB that
    # saves three round trips); inside an atomic block a savepoint keeps the block usable.
    token = uuid.uuid4()
    row = _prepared_row(alias, request.new_row(token))
    try:
        with (
            (
                transaction.atomic(using=alias)
                if connection.in_atomic_block
                else contextlib.nullcontext()
            ),
            connection.cursor() as cursor,
        ):
            cursor.execute(_insert_sql(alias, tuple(row)), row)
            record_id = int(cursor.lastrowid)
    except IntegrityError:
        state = fetch(alias, request.account, request.operation, request.key)
        return None if state is None else (state, False)
    return _inserted(request, token, record_id), True


@functools.lru_cache(maxsize=8)
def _insert_sql(alias: str, columns: tuple[str, ...]) -> str:
    quote = connections[alias].ops.quote_name
    values = ", ".join(f"%({c})s" for c in columns)
    names = ", ".join(quote(c) for c in columns)
    return f"INSERT INTO {_table(alias)} ({names}) VALUES ({values})"


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


@functools.lru_cache(maxsize=8)
def _takeover_sql(alias: str) -> str:
    """Replace a record, fenced by ``states.REPLACEABLE`` evaluated on the row itself.

    The row is taken only when nobody holds it (``FOR UPDATE SKIP LOCKED``): a holder is a
    racing takeover, or an owner completing it inside a transaction of its caller's that has
    not committed yet, and the claim must never wait for either. Matching nothing, the claim
    reads the record and answers it as it stands (in progress: ``409`` / ``InProgress``).
    """
    connection = connections[alias]
    quote = connection.ops.quote_name
    assignments = [f"{quote(c)} = %({c})s" for c in _TAKEOVER_COLUMNS]
    # Attempts count the takeovers of a stale lease; a fresh start after expiry resets them.
    assignments.append(
        f"{quote('recovery_attempts')} = CASE WHEN {states.EXPIRED.sql(quote)} THEN 0"
        f" ELSE {quote('recovery_attempts')} + 1 END"
    )
    sql = (
        f"UPDATE {_table(alias)} SET {', '.join(assignments)}"
        f" WHERE {quote('id')} = %(id)s AND {states.REPLACEABLE.sql(quote)}"
    )
    if connection.vendor == "postgresql":
        # MySQL refuses a subquery on the table it updates: _take_over locks there first.
        sql += (
            f" AND {quote('id')} IN (SELECT {quote('id')} FROM {_table(alias)}"
            f" WHERE {quote('id')} = %(id)s FOR UPDATE SKIP LOCKED)"
            f" RETURNING {_returning(alias)}"
        )
    return sql


@functools.lru_cache(maxsize=8)
def _lock_free_sql(alias: str) -> str:
    quote = connections[alias].ops.quote_name
    return (
        f"SELECT {quote('id')} FROM {_table(alias)} WHERE {quote('id')} = %s FOR UPDATE SKIP LOCKED"
    )


def _take_over(
    alias: str, request: ClaimRequest, token: uuid.UUID, state: RecordState
) -> RecordState | None:
    """Replace ``state``'s record if it is still replaceable.

    Returns the new state where the statement can return it (PostgreSQL), else ``None``:
    the caller reads the outcome.
    """
    connection = connections[alias]
    row = _prepared_row(alias, request.new_row(token))
    params = {c: row[c] for c in _TAKEOVER_COLUMNS}
    params.update(
        id=state.id,
        now=row["created_at"],
        hash=request.request_hash,
        version=request.fingerprint_version,
    )
    if connection.vendor == "postgresql":
        with _cursor(alias) as cursor:
            cursor.execute(_takeover_sql(alias), params)
            result = cursor.fetchone()
        return RecordState.from_row(result) if result is not None else None
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        if connection.features.has_select_for_update_skip_locked:
            cursor.execute(_lock_free_sql(alias), [state.id])
            if cursor.fetchone() is None:
                return None  # held by another transaction: left to it
        cursor.execute(_takeover_sql(alias), params)
    return None


def _take_over_archiving(
    alias: str, request: ClaimRequest, token: uuid.UUID, state: RecordState
) -> RecordState | None:
    # With the audit trail on, an expired record is copied before it is replaced, in the same
    # transaction: the copy locks the row first, so of two racing claims one copies it and
    # replaces it, and the other then finds it no longer replaceable.
    with transaction.atomic(using=alias):
        IdempotencyRecord.objects.using(alias).archive_expired(
            request.account, request.operation, request.key, now=request.now
        )
        return _take_over(alias, request, token, state)


# How often one claim looks again when the record in its way vanished (was released) or was
# committed after its statement's snapshot; each look is one statement.
_LOOKS = 3


def claim(alias: str, request: ClaimRequest) -> ClaimResult:
    """Claim ``(account, operation, key)``, each statement its own short transaction.

    A new key: one statement inserts it. An existing key: the same statement hands its row
    back, and nothing is written, unless the record is replaceable (expired, or a stale lease
    of the same request), which takes one conditional statement more.
    """
    return retrying(lambda: _claim(alias, request))


def _claim(alias: str, request: ClaimRequest) -> ClaimResult:
    for _look in range(_LOOKS):
        found = _insert_or_existing(alias, request)
        if found is None:
            found_state = fetch(alias, request.account, request.operation, request.key)
            if found_state is None:
                continue  # released meanwhile: try the insert again
            found = (found_state, False)
        state, inserted = found
        if inserted:
            return ClaimResult(state=state, claimed=True)
        # A record whose outcome cannot be read back is refused by the caller, never replaced
        # within its TTL: it is replaceable only as any record is (expired, or a stale lease).
        if not state.replaceable_by(request):
            return ClaimResult(state=state, claimed=False)
        token = uuid.uuid4()
        take_over = _take_over_archiving if app_settings.AUDIT else _take_over
        taken = take_over(alias, request, token, state)
        current = taken or fetch(alias, request.account, request.operation, request.key)
        if current is not None:
            claimed = current.lease_token == token
            if claimed and states.EXPIRED.test(vars(state), now=request.now):
                # An expired record replaced by a new operation: an earlier operation's
                # steps (recovery "resume") are not this one's.
                forget_steps(alias, state.id)
            return ClaimResult(state=current, claimed=claimed)
    raise IntegrityError("the idempotency record kept vanishing during one claim")


@functools.lru_cache(maxsize=8)
def _fetch_sql(alias: str) -> str:
    quote = connections[alias].ops.quote_name
    identity = " AND ".join(f"{quote(c)} = %s" for c in ("account", "operation", "key"))
    return f"SELECT {_returning(alias)} FROM {_table(alias)} WHERE {identity}"


def fetch(alias: str, account: str, operation: str, key: str) -> RecordState | None:
    """The current state of a record, or ``None`` when there is none."""
    with _cursor(alias) as cursor:
        cursor.execute(_fetch_sql(alias), [account, operation, key])
        row = cursor.fetchone()
    return RecordState.from_row(row) if row is not None else None


def _owned_by(quote: Callable[[str], str]) -> str:
    """The fence of every owner's statement: this record, this lease token, still in progress.

    Its parameters, in order: the record's id, the token, ``IN_PROGRESS``.
    """
    return f"{quote('id')} = %s AND {quote('lease_token')} = %s AND {quote('status')} = %s"


@functools.lru_cache(maxsize=8)
def _finish_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    stored = ("status", "response_status", "response_headers", "response_body", "completed_at")
    cleared = ("lease_token", "lease_expires_at")
    assignments = [f"{q(c)} = %s" for c in stored] + [f"{q(c)} = NULL" for c in cleared]
    if connections[alias].vendor == "postgresql":
        assignments[2] += "::jsonb"  # the headers come as JSON text
    return f"UPDATE {_table(alias)} SET {', '.join(assignments)} WHERE {_owned_by(q)}"


def finish(
    alias: str,
    record_id: int,
    token: uuid.UUID,
    *,
    status: str,
    response_status: int,
    response_headers: list[list[str]],
    response_body: bytes,
    now: datetime,
) -> bool:
    """Store the outcome, fenced by the lease token. ``False``: the lease was lost."""
    headers, body = crypto.seal_response(response_headers, response_body)
    connection = connections[alias]
    if connection.vendor == "postgresql":
        # As the JSON field would store it (json.dumps), without its per-call preparation;
        # psycopg adapts the rest as it is.
        params: list[Any] = [
            status,
            response_status,
            json.dumps(headers),
            body,
            now,
            record_id,
            token,
        ]
    else:
        params = [
            status,
            response_status,
            _prepared(alias, "response_headers", headers),
            _prepared(alias, "response_body", body),
            _prepared(alias, "completed_at", now),
            record_id,
            _prepared(alias, "lease_token", token),
        ]
    params.append(IN_PROGRESS)
    with _cursor(alias) as cursor:
        cursor.execute(_finish_sql(alias), params)
        return int(cursor.rowcount) > 0


@functools.lru_cache(maxsize=8)
def _release_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    return f"DELETE FROM {_table(alias)} WHERE {_owned_by(q)}"


def release(alias: str, record_id: int, token: uuid.UUID) -> bool:
    """Delete a claim this attempt still owns, so that a retry runs afresh."""
    with _cursor(alias) as cursor:
        cursor.execute(
            _release_sql(alias), [record_id, _prepared(alias, "lease_token", token), IN_PROGRESS]
        )
        return int(cursor.rowcount) > 0


@functools.lru_cache(maxsize=8)
def _give_back_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    return f"UPDATE {_table(alias)} SET {q('lease_expires_at')} = %s WHERE {_owned_by(q)}"


def give_back(alias: str, record_id: int, token: uuid.UUID, now: datetime) -> bool:
    """End this attempt's lease at ``now`` without releasing the record.

    For a recovery that could not decide (its callable raised): the record stays in
    progress with a stale lease, so the next retry, or the recovery job, asks again at once
    instead of after a whole new lease.
    """
    params = [
        _prepared(alias, "lease_expires_at", now),
        record_id,
        _prepared(alias, "lease_token", token),
        IN_PROGRESS,
    ]
    with _cursor(alias) as cursor:
        cursor.execute(_give_back_sql(alias), params)
        return int(cursor.rowcount) > 0


# -- steps of resumable operations ------------------------------------------------------------


def _step_table(alias: str) -> str:
    from django_idempotency.models import IdempotencyStep

    return str(connections[alias].ops.quote_name(IdempotencyStep._meta.db_table))


@functools.lru_cache(maxsize=8)
def _record_step_sql(alias: str) -> str:
    """One statement records a step, fenced by the owner's lease token.

    The row of the record is read ``FOR SHARE``: a takeover (an ``UPDATE`` of that row) waits
    for the step's transaction, so a step either commits before the takeover, and the new
    owner reads it, or finds the record no longer its own and records nothing.
    """
    connection = connections[alias]
    q = connection.ops.quote_name
    columns = ", ".join(q(c) for c in ("record_id", "name", "result", "created_at"))
    lock = " FOR SHARE" if connection.features.has_select_for_update else ""
    if lock and connection.vendor == "mysql":
        lock = " LOCK IN SHARE MODE"
    return (
        f"INSERT INTO {_step_table(alias)} ({columns})"
        f" SELECT {q('id')}, %s, %s, %s FROM {_table(alias)} WHERE {_owned_by(q)}{lock}"
    )


def record_step(
    alias: str, record_id: int, token: uuid.UUID, name: str, result: str, now: datetime
) -> bool:
    """Record a step's result for the record this attempt owns; ``False``: the lease was lost."""
    from django_idempotency.models import IdempotencyStep

    created = IdempotencyStep._meta.get_field("created_at")
    assert isinstance(created, Field)
    params = [
        name,
        result,
        created.get_db_prep_save(now, connections[alias]),
        record_id,
        _prepared(alias, "lease_token", token),
        IN_PROGRESS,
    ]
    with _cursor(alias) as cursor:
        cursor.execute(_record_step_sql(alias), params)
        return int(cursor.rowcount) > 0


@functools.lru_cache(maxsize=8)
def _recorded_steps_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    return (
        f"SELECT {q('name')}, {q('result')} FROM {_step_table(alias)} WHERE {q('record_id')} = %s"
    )


def recorded_steps(alias: str, record_id: int) -> dict[str, str]:
    """The steps recorded for a record so far: ``{name: result as JSON text}``."""
    with _cursor(alias) as cursor:
        cursor.execute(_recorded_steps_sql(alias), [record_id])
        return {str(name): str(result) for name, result in cursor.fetchall()}


def forget_steps(alias: str, record_id: int) -> None:
    """Delete the steps of a record that an expired record's replacement starts afresh."""
    q = connections[alias].ops.quote_name
    with _cursor(alias) as cursor:
        cursor.execute(f"DELETE FROM {_step_table(alias)} WHERE {q('record_id')} = %s", [record_id])
