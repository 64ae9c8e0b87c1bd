"""The record's state transitions as database statements.

Every guarantee rests on the database: the unique constraint on ``(account, operation, key)``
picks the single winner of a claim, and row-level conditional updates fence completion by the
lease token. Nothing here relies on process memory or a local lock.
"""

from __future__ import annotations

import functools
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, OperationalError, connections, transaction
from django.db.models import F, Field, Q

from django_idempotency.conf import app_settings
from django_idempotency.models import IdempotencyRecord, RecordStatus

# The statements below compare against the stored strings; RecordStatus names them too.
IN_PROGRESS = "in_progress"
COMPLETED = "completed"
FAILED = "failed"
assert {IN_PROGRESS, COMPLETED, FAILED} == set(RecordStatus.values)

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

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> RecordState:
        values = dict(zip(_STATE_COLUMNS, row, strict=True))
        headers = values["response_headers"]
        if isinstance(headers, str):
            headers = json.loads(headers)
        token = values["lease_token"]
        if token is not None and not isinstance(token, uuid.UUID):
            token = uuid.UUID(str(token))
        body = values["response_body"]
        values.update(
            response_headers=headers or [],
            lease_token=token,
            response_body=bytes(body) if body is not None else None,
        )
        return cls(**values)

    @classmethod
    def from_instance(cls, record: IdempotencyRecord) -> RecordState:
        return cls.from_row(tuple(getattr(record, name) for name in _STATE_COLUMNS))


@dataclass(frozen=True)
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


def _table() -> str:
    return IdempotencyRecord._meta.db_table


@functools.lru_cache(maxsize=8)
def _postgres_claim_sql(alias: str, columns: tuple[str, ...]) -> str:
    """The claim statement, built once per database: it depends only on the table."""
    connection = connections[alias]
    quote = connection.ops.quote_name
    table = _table()
    fields = {f.column: f for f in IdempotencyRecord._meta.concrete_fields}
    # Cast every value: they come through a SELECT, not VALUES, so PostgreSQL cannot take
    # their types from the target columns.
    values = ", ".join(f"CAST(%({c})s AS {fields[c].db_type(connection)})" for c in columns)
    takeover = (
        "(t.expires_at <= EXCLUDED.created_at AND "
        " (t.status <> 'in_progress' OR t.lease_expires_at <= EXCLUDED.created_at))"
        " OR (t.status = 'in_progress' AND t.lease_expires_at <= EXCLUDED.created_at"
        "     AND (t.request_hash = EXCLUDED.request_hash"
        "          OR t.fingerprint_version <> EXCLUDED.fingerprint_version))"
    )
    # The same condition on the stored row, with the claim's own values as parameters.
    replaceable = (
        "COALESCE((expires_at <= %(now)s AND"
        " (status <> 'in_progress' OR lease_expires_at <= %(now)s))"
        " OR (status = 'in_progress' AND lease_expires_at <= %(now)s"
        "     AND (request_hash = %(hash)s OR fingerprint_version <> %(version)s)), false)"
    )
    updates = [f"{quote(c)} = EXCLUDED.{quote(c)}" for c in columns if c != "recovery_attempts"]
    # Attempts count the takeovers of a stale lease; a fresh start after expiry resets them.
    updates.append(
        "recovery_attempts = CASE WHEN t.expires_at <= EXCLUDED.created_at THEN 0 "
        "ELSE t.recovery_attempts + 1 END"
    )
    returning = ", ".join(
        "response_headers::text" if c == "response_headers" else quote(c) for c in _STATE_COLUMNS
    )
    # ``live``: a record this claim may not replace (a completed one inside its TTL, a live
    # lease). Then nothing is inserted: the INSERT's ON CONFLICT would lock that row (it
    # locks the conflicting row even when its WHERE is false), so a replay would take a
    # transaction id, write WAL, flush it at commit and queue behind concurrent replays.
    return (
        f"WITH live AS (SELECT {returning} FROM {quote(table)}"
        f" WHERE account = %(account)s AND operation = %(operation)s AND key = %(key)s"
        f" AND NOT {replaceable}),"
        f" claim AS ("
        f" INSERT INTO {quote(table)} AS t ({', '.join(quote(c) for c in columns)})"
        f" SELECT {values} WHERE NOT EXISTS (SELECT 1 FROM live)"
        f" ON CONFLICT (account, operation, key) DO UPDATE SET {', '.join(updates)}"
        f" WHERE {takeover}"
        f" RETURNING {returning})"
        f" SELECT {returning} FROM claim UNION ALL SELECT {returning} FROM live"
    )


def _postgres_claim(alias: str, request: ClaimRequest, token: uuid.UUID) -> RecordState | None:
    # One statement claims a new key, takes over an expired record or a stale lease of the
    # same request, or hands back the existing row. The unique index picks the winner.
    row = request.new_row(token)
    params = {**row, "response_headers": json.dumps(row["response_headers"])}
    params.update(now=request.now, hash=request.request_hash, version=request.fingerprint_version)
    with connections[alias].cursor() as cursor:
        cursor.execute(_postgres_claim_sql(alias, tuple(row)), params)
        result = cursor.fetchone()
    return RecordState.from_row(result) if result is not None else None


def _portable_claim(alias: str, request: ClaimRequest, token: uuid.UUID) -> RecordState | None:
    # A savepoint-guarded insert, then a conditional takeover, then a read of the winner.
    row = request.new_row(token)
    manager = IdempotencyRecord.objects.using(alias)
    try:
        with transaction.atomic(using=alias):
            return RecordState.from_instance(manager.create(**row))
    except IntegrityError:
        pass
    now = request.now
    identity = manager.filter(account=request.account, operation=request.operation, key=request.key)
    expired = Q(expires_at__lte=now) & (~Q(status=IN_PROGRESS) | Q(lease_expires_at__lte=now))
    # A stale lease is taken over only by the same request: the same hash, or a hash made by
    # another fingerprint version, which cannot be compared.
    stale = Q(status=IN_PROGRESS, lease_expires_at__lte=now) & (
        Q(request_hash=request.request_hash) | ~Q(fingerprint_version=request.fingerprint_version)
    )
    fresh = {k: v for k, v in row.items() if k not in ("account", "operation", "key")}
    with transaction.atomic(using=alias):
        if identity.filter(expired).update(**fresh) == 0:
            fresh.pop("recovery_attempts")
            identity.filter(stale).update(**fresh, recovery_attempts=_plus_one())
    return fetch(alias, request.account, request.operation, request.key)


def _plus_one() -> Any:
    return F("recovery_attempts") + 1


# Deadlock and serialization failures: the database rolled the statement back and asks for a
# retry (PostgreSQL SQLSTATEs; MySQL/MariaDB error numbers).
_RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})
_RETRYABLE_MYSQL_ERRORS = frozenset({1213, 1205})
_CLAIM_ATTEMPTS = 5


def _retryable(exc: OperationalError) -> bool:
    cause = exc.__cause__
    if getattr(cause, "sqlstate", None) in _RETRYABLE_SQLSTATES:
        return True
    args: tuple[Any, ...] = getattr(cause, "args", ())
    return bool(args) and args[0] in _RETRYABLE_MYSQL_ERRORS


def claim(alias: str, request: ClaimRequest) -> ClaimResult:
    """Claim ``(account, operation, key)`` in one short transaction of its own."""
    for attempt in range(_CLAIM_ATTEMPTS):
        try:
            return _claim_once(alias, request)
        except OperationalError as exc:
            # InnoDB can pick a concurrent duplicate insert as a deadlock victim; the claim
            # is one short transaction, so running it again is safe.
            if not _retryable(exc) or attempt == _CLAIM_ATTEMPTS - 1:
                raise
            time.sleep(random.uniform(0.001, 0.01) * (attempt + 1))
    raise AssertionError("unreachable")


def _claim_once(alias: str, request: ClaimRequest) -> ClaimResult:
    token = uuid.uuid4()
    connection = connections[alias]
    attempt = _postgres_claim if connection.vendor == "postgresql" else _portable_claim
    state = _archiving(attempt, alias, request, token)
    if state is None:
        # The conflicting row was committed after our statement's snapshot was taken;
        # a fresh read sees it.
        state = fetch(alias, request.account, request.operation, request.key)
    if state is None:
        # It was released (deleted) in the meantime: try once more from the start.
        state = attempt(alias, request, token) or fetch(
            alias, request.account, request.operation, request.key
        )
    if state is None:
        raise IntegrityError("the idempotency record vanished twice during one claim")
    return ClaimResult(state=state, claimed=state.lease_token == token)


def _archiving(
    attempt: Callable[[str, ClaimRequest, uuid.UUID], RecordState | None],
    alias: str,
    request: ClaimRequest,
    token: uuid.UUID,
) -> RecordState | None:
    if not app_settings.AUDIT:
        return attempt(alias, request, token)
    # With the audit trail on, an expired record this claim replaces is first copied to it,
    # in the same transaction: the copy locks the expired row, so a racing claim of the same
    # key waits for this one and then finds nothing expired to copy.
    with transaction.atomic(using=alias):
        IdempotencyRecord.objects.using(alias).archive_expired(
            request.account, request.operation, request.key, now=request.now
        )
        return attempt(alias, request, token)


def fetch(alias: str, account: str, operation: str, key: str) -> RecordState | None:
    """The current state of a record, or ``None`` when there is none."""
    row = (
        IdempotencyRecord.objects.using(alias)
        .filter(account=account, operation=operation, key=key)
        .values_list(*_STATE_COLUMNS)
        .first()
    )
    return RecordState.from_row(row) if row is not None else None


def _owned(alias: str, record_id: int, token: uuid.UUID) -> Any:
    return IdempotencyRecord.objects.using(alias).filter(
        pk=record_id, lease_token=token, status=IN_PROGRESS
    )


@functools.lru_cache(maxsize=8)
def _finish_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    stored = ("status", "response_status", "response_headers", "response_body", "completed_at")
    cleared = ("lease_token", "lease_expires_at")
    assignments = [f"{q(c)} = %s" for c in stored] + [f"{q(c)} = NULL" for c in cleared]
    return (
        f"UPDATE {q(_table())} SET {', '.join(assignments)}"
        f" WHERE {q('id')} = %s AND {q('lease_token')} = %s AND {q('status')} = %s"
    )


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
    """Store the outcome, fenced by the lease token. ``False``: the lease was lost.

    One statement built once: the ORM's UPDATE costs more to compile than to run.
    """
    connection = connections[alias]

    def prepared(name: str, value: Any) -> Any:
        field = IdempotencyRecord._meta.get_field(name)
        assert isinstance(field, Field)
        return field.get_db_prep_save(value, connection)

    params = [
        status,
        response_status,
        prepared("response_headers", response_headers),
        prepared("response_body", response_body),
        prepared("completed_at", now),
        record_id,
        prepared("lease_token", token),
        IN_PROGRESS,
    ]
    with connection.cursor() as cursor:
        cursor.execute(_finish_sql(alias), params)
        return int(cursor.rowcount) > 0


def release(alias: str, record_id: int, token: uuid.UUID) -> bool:
    """Delete a claim this attempt still owns, so that a retry runs afresh."""
    deleted, _ = _owned(alias, record_id, token).delete()
    return bool(deleted)
