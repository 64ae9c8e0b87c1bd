"""A record as the engine reads it back: its state, and its stored outcome opened and checked.

A stored outcome that cannot be read back (sealed with a key no configured key is, damaged
headers, no valid status or body) comes back as no outcome and the reason, never as an
exception: the caller refuses such a record within its TTL (``RecordUnreadable``), and never
runs its operation again.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from django_idempotency import _storable, crypto, states
from django_idempotency.states import IN_PROGRESS

if TYPE_CHECKING:
    from django_idempotency._context import Operation

__all__ = ["EXISTING_COLUMNS", "STATE_COLUMNS", "TIMES", "ClaimResult", "RecordState"]

STATE_COLUMNS = (
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
    "recovery_policy",
)

# What the claim hands back of a record in its way, in this order (RecordState.in_the_way):
# what a replay, a conflict and the decision to take it over read. A claim that inserted
# reads nothing back but the id and the lease token: it wrote every other column itself.
EXISTING_COLUMNS = (
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

#: The columns PostgreSQL's claim reads as seconds since the epoch (``from_epoch``).
TIMES = frozenset({"lease_expires_at", "expires_at"})


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
    #: The recovery policy the record was claimed under (its stored name); ``None`` where
    #: it was not read (PostgreSQL's claim hands a record in its way back without it). A
    #: stale lease taken over keeps it until its recovery decided (``_recovery.deciding``).
    recovery_policy: str | None = None

    @classmethod
    def from_row(
        cls, row: tuple[Any, ...], columns: tuple[str, ...] = STATE_COLUMNS
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
        """The state from PostgreSQL's claim: a row of ``EXISTING_COLUMNS``, its times in
        seconds since the epoch, read on every replay."""
        record_id, status, lease_expires_at, expires_at, request_hash, version = row[:6]
        headers, body, unreadable = _stored_response(status, row[6], row[7], row[8])
        return cls(
            record_id,
            status,
            None,
            None if lease_expires_at is None else from_epoch(lease_expires_at),
            from_epoch(expires_at),
            request_hash,
            version,
            0,
            row[6],
            headers,
            body,
            unreadable,
        )

    def replaceable_by(self, operation: Operation, now: datetime) -> bool:
        """Whether a claim of ``operation`` at ``now`` may replace this record (see
        ``states.REPLACEABLE``)."""
        if self.status != IN_PROGRESS and self.expires_at > now:
            # Done and within its TTL (every replay): neither expired nor a stale lease, so
            # REPLACEABLE is false without evaluating it (tests/test_states.py holds the two
            # to the same answer).
            return False
        return states.REPLACEABLE.test(
            vars(self),
            now=now,
            hash=operation.request_hash,
            version=operation.fingerprint_version,
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


@dataclass(frozen=True)
class ClaimResult:
    """The outcome of a claim: ``claimed`` when this attempt now owns the record."""

    state: RecordState
    claimed: bool
    #: A claim that replaced an in-progress record whose lease had run out.
    took_over_stale_lease: bool = field(init=False)

    def __post_init__(self) -> None:
        # Computed once, here: the engine reads it on every claim.
        stale = self.claimed and self.state.recovery_attempts > 0
        object.__setattr__(self, "took_over_stale_lease", stale)

    @classmethod
    def inserted(
        cls, op: Operation, now: datetime, token: uuid.UUID, record_id: int
    ) -> ClaimResult:
        """The claim of a record it has just inserted (nothing read back but its id)."""
        state = RecordState(
            id=record_id,
            status=IN_PROGRESS,
            lease_token=token,
            lease_expires_at=later(now, op.lease),
            expires_at=later(now, op.ttl),
            request_hash=op.request_hash,
            fingerprint_version=op.fingerprint_version,
            recovery_attempts=0,
            response_status=None,
            response_headers=[],
            response_body=None,
            recovery_policy=op.recovery_policy,
        )
        return cls(state, claimed=True)


def later(now: datetime, duration: timedelta) -> datetime:
    """``duration`` after ``now`` in elapsed time. A naive ``now`` (``USE_TZ = False``) is
    local time in the default time zone, where a wall-clock sum would be an hour off
    across a daylight saving change: the sum is made in UTC and given back as local time.

    When daylight saving time ends the clock reads an hour twice, and a naive time cannot
    say which pass it is of. A moment of the second pass would compare before every
    reading of the end of the first, and a lease or a TTL ending there would be over up to
    an hour early: it is given back as the same reading after the repeated hour (up to an
    hour late, never early)."""
    if timezone.is_aware(now):
        return now + duration
    zone = timezone.get_default_timezone()
    elapsed = timezone.make_aware(now, zone).astimezone(dt_timezone.utc) + duration
    local = elapsed.astimezone(zone)
    first, second = local.replace(fold=0).utcoffset(), local.utcoffset()
    repeated = timedelta(0)
    if local.fold and first is not None and second is not None and first > second:
        repeated = first - second
    return local.replace(tzinfo=None, fold=0) + repeated


def from_epoch(seconds: float) -> datetime:
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
