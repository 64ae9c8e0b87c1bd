"""The state machine's predicates agree in their three renderings, on every case.

Each predicate of ``django_idempotency.states`` renders as a ``Q`` (the ORM's queries), as
SQL (the engine's fixed statements) and as a Python test of a fetched row. One table of
records covers every combination of status, lease (none, past, now, future), expiry (past,
now, future), hash and fingerprint version; for each predicate the three must select the
same records.
"""

from __future__ import annotations

import itertools
import uuid
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

import pytest
from django.db import connection

from django_idempotency import states
from django_idempotency.models import IdempotencyRecord, RecordStatus

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=dt_timezone.utc)
MOMENTS = {"past": NOW - timedelta(seconds=1), "now": NOW, "future": NOW + timedelta(seconds=1)}
HASH, VERSION = "a" * 64, "v1"

PREDICATES = {
    "LIVE_LEASE": states.LIVE_LEASE,
    "STALE_LEASE": states.STALE_LEASE,
    "EXPIRED": states.EXPIRED,
    "STALE": states.STALE,
    "SAME_REQUEST": states.SAME_REQUEST,
    "REPLACEABLE": states.REPLACEABLE,
}
PARAMS = {"now": NOW, "hash": HASH, "version": VERSION}


@pytest.fixture
def every_case(db: Any) -> list[IdempotencyRecord]:
    leases = [None, *MOMENTS.values()]
    records = []
    combinations = itertools.product(
        states.STATUSES, leases, MOMENTS.values(), (HASH, "b" * 64), (VERSION, "v2")
    )
    for n, (status, lease, expires, request_hash, version) in enumerate(combinations):
        records.append(
            IdempotencyRecord(
                account="user:1",
                operation="op",
                key=f"k{n}",
                status=status,
                lease_token=uuid.uuid4() if status == states.IN_PROGRESS else None,
                lease_expires_at=lease,
                expires_at=expires,
                request_hash=request_hash,
                fingerprint_version=version,
                created_at=NOW - timedelta(hours=1),
            )
        )
    IdempotencyRecord.objects.bulk_create(records)
    return list(IdempotencyRecord.objects.all())


def _by_sql(predicate: states.Predicate) -> set[int]:
    quote = connection.ops.quote_name
    params = {
        name: connection.ops.adapt_datetimefield_value(value) if name == "now" else value
        for name, value in PARAMS.items()
    }
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id FROM {quote(IdempotencyRecord._meta.db_table)}"
            f" WHERE {predicate.sql(quote)}",
            params,
        )
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.parametrize("name", sorted(PREDICATES))
def test_q_sql_and_python_agree_on_every_case(name, every_case):
    predicate = PREDICATES[name]
    by_python = {
        record.pk
        for record in every_case
        if predicate.test(
            {f.attname: getattr(record, f.attname) for f in IdempotencyRecord._meta.fields},
            **PARAMS,
        )
    }
    by_q = set(IdempotencyRecord.objects.filter(predicate.q(**PARAMS)).values_list("pk", flat=True))
    assert by_q == by_python
    assert _by_sql(predicate) == by_python
    # A predicate that selected nothing, or everything, would prove nothing.
    assert 0 < len(by_python) < len(every_case)


def test_the_predicates_mean_what_their_names_say():
    row = {
        "status": states.IN_PROGRESS,
        "lease_expires_at": NOW,
        "expires_at": NOW,
        "request_hash": HASH,
        "fingerprint_version": VERSION,
    }
    assert states.STALE_LEASE.test(row, now=NOW)  # a lease ending now has run out
    assert not states.LIVE_LEASE.test(row, now=NOW)
    assert states.EXPIRED.test(row, now=NOW)
    assert not states.STALE.test(row, now=NOW)  # past its TTL: the purge's, not recovery's
    assert states.REPLACEABLE.test(row, now=NOW, hash="other", version=VERSION)
    live = {**row, "lease_expires_at": NOW + timedelta(seconds=1)}
    assert not states.EXPIRED.test(live, now=NOW)  # a live lease keeps even an expired record
    assert not states.REPLACEABLE.test(live, now=NOW, hash=HASH, version=VERSION)
    young_stale = {**row, "expires_at": NOW + timedelta(hours=1)}
    assert states.REPLACEABLE.test(young_stale, now=NOW, hash=HASH, version=VERSION)
    assert not states.REPLACEABLE.test(young_stale, now=NOW, hash="other", version=VERSION)
    assert states.REPLACEABLE.test(young_stale, now=NOW, hash="other", version="v2")


def test_the_statuses_are_defined_once():
    assert tuple(RecordStatus.values) == states.STATUSES
    assert {states.COMPLETED, states.FAILED} == states.DONE
    # Every status is reached by some transition, and leaves by one unless it is final.
    reached = {to for _from, to in states.TRANSITIONS}
    assert set(states.STATUSES) <= reached
    assert {start for start, _to in states.TRANSITIONS} >= {None, *states.STATUSES}


def test_a_record_in_the_way_is_replaceable_exactly_when_replaceable_says_so() -> None:
    """``RecordState.replaceable_by`` answers a done record within its TTL (every replay)
    without evaluating ``REPLACEABLE``: on every case the two agree."""
    from django_idempotency._context import Operation
    from django_idempotency._store import RecordState

    leases = [None, *MOMENTS.values()]
    combinations = itertools.product(
        states.STATUSES, leases, MOMENTS.values(), (HASH, "b" * 64), (VERSION, "v2")
    )
    operation = Operation(
        "default", "user:1", "op", "k", HASH, VERSION, "retry", timedelta(1), timedelta(2)
    )
    checked = 0
    for status, lease, expires, request_hash, version in combinations:
        state = RecordState(
            id=1,
            status=status,
            lease_token=None,
            lease_expires_at=lease,
            expires_at=expires,
            request_hash=request_hash,
            fingerprint_version=version,
            recovery_attempts=0,
            response_status=None,
            response_headers=[],
            response_body=None,
        )
        expected = states.REPLACEABLE.test(vars(state), now=NOW, hash=HASH, version=VERSION)
        assert state.replaceable_by(operation, NOW) == expected, vars(state)
        checked += 1
    assert checked == len(states.STATUSES) * 4 * 3 * 2 * 2
