"""The claim statement's details: what it binds, what it reads.

PostgreSQL's claim is one call of a server-side function with every value bound; it reads a
record in its way with its times as seconds since the epoch. Each of these must give
the same record, and the same state, as the plain reading would.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_idempotency import _store, states
from django_idempotency._context import Operation
from django_idempotency._store import claiming
from django_idempotency._store.records import from_epoch
from django_idempotency._vendors.postgresql import CLAIM
from django_idempotency.models import IdempotencyRecord
from tests.helpers import needs_drf, new_key

UTC = timezone.utc
postgresql_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="PostgreSQL's one-statement claim"
)


NOW = datetime(2026, 12, 2, 9, 31, 7, 123457, tzinfo=UTC)


def claim_request(**overrides: object) -> Operation:
    values: dict[str, object] = {
        "alias": "default",
        "account": "user:1",
        "operation": "charge.create",
        "key": uuid.uuid4().hex,
        "request_hash": "a" * 64,
        "fingerprint_version": "v1",
        "recovery_policy": "retry",
        "lease": timedelta(seconds=61, microseconds=3),
        "ttl": timedelta(days=3, microseconds=999_999),
    }
    values.update(overrides)
    return Operation(**values)  # type: ignore[arg-type]


def complete(
    state: _store.RecordState, now: datetime = datetime(2026, 12, 2, 9, 31, 8, tzinfo=UTC)
) -> None:
    assert state.lease_token is not None
    assert _store.complete(
        "default",
        state.id,
        state.lease_token,
        status=states.COMPLETED,
        response_status=201,
        response_headers=[["Content-Type", "application/json"]],
        response_body=b"{}",
        now=now,
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("complete_first", [False, True], ids=["in progress", "completed"])
def test_the_record_in_the_way_reads_as_the_record_itself(complete_first):
    request = claim_request()
    first = _store.claim(request, NOW)
    assert first.claimed
    if complete_first:
        complete(first.state)
    again = _store.claim(request, NOW)
    assert not again.claimed
    stored = _store.fetch(request)
    assert stored is not None
    # The claim reads the times as doubles: to the microsecond, the stored ones.
    assert again.state.expires_at == stored.expires_at == NOW + request.ttl
    assert again.state.lease_expires_at == stored.lease_expires_at
    if not complete_first:
        assert stored.lease_expires_at == NOW + request.lease
    assert again.state.status == stored.status
    assert again.state.request_hash == stored.request_hash
    assert again.state.response_headers == stored.response_headers
    assert again.state.response_body == stored.response_body


@pytest.mark.django_db(transaction=True)
def test_a_new_claim_holds_the_lease_token_that_was_stored():
    result = _store.claim(claim_request(), NOW)
    assert result.claimed
    token = result.state.lease_token
    assert isinstance(token, uuid.UUID)
    record = IdempotencyRecord.objects.get(pk=result.state.id)
    assert record.lease_token == token
    assert record.lease_expires_at == result.state.lease_expires_at
    assert record.expires_at == result.state.expires_at
    # The completion is fenced by that token: it is the owner's.
    complete(result.state)
    assert IdempotencyRecord.objects.get(pk=result.state.id).status == states.COMPLETED


@pytest.mark.django_db(transaction=True)
def test_two_claims_draw_two_lease_tokens():
    first = _store.claim(claim_request(), NOW)
    second = _store.claim(claim_request(), NOW)
    assert first.claimed
    assert second.claimed
    assert first.state.lease_token != second.state.lease_token


HOSTILE_NAMES = [
    "it's",  # a quote
    "100% sure",  # a percent sign: the statement is a template
    "back\\slash",
    "%(key)s",  # a placeholder of the statement's own
    "'; DELETE FROM django_idempotency_record; --",
    "ünïcödé",
]


@postgresql_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_an_operation_name_that_is_not_a_plain_word_is_bound_not_written(name):
    others = _store.claim(claim_request(operation="other"), NOW)
    request = claim_request(operation=name, fingerprint_version=name, recovery_policy="fail")
    with CaptureQueriesContext(connection) as queries:
        first = _store.claim(request, NOW)
    assert first.claimed
    # Every value is bound to the claim's function: its statement is the same for every
    # operation, and no name is ever part of it.
    assert CLAIM.count("%s") == 11
    assert "'" not in CLAIM
    again = _store.claim(request, NOW)
    assert not again.claimed
    assert again.state.id == first.state.id
    record = IdempotencyRecord.objects.get(pk=first.state.id)
    assert (record.operation, record.fingerprint_version) == (name, name)
    # Nothing else was touched, and the statement ran once.
    assert IdempotencyRecord.objects.filter(pk=others.state.id).exists()
    assert IdempotencyRecord.objects.count() == 2
    assert len(queries.captured_queries) == 1


@pytest.mark.parametrize(
    "moment",
    [
        datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
        datetime(2026, 12, 2, 9, 31, 7, 999_999, tzinfo=UTC),
        datetime(2038, 1, 19, 3, 14, 8, 500_001, tzinfo=UTC),
        datetime(2105, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
    ],
)
def test_a_time_read_as_seconds_since_the_epoch_comes_back_to_the_microsecond(moment):
    # What PostgreSQL's date_part('epoch', ...) gives: the double nearest the microseconds.
    microseconds = (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    assert from_epoch(microseconds / 1e6) == moment


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize(
    "path",
    ["/charges/", pytest.param("/api/charges/", marks=needs_drf)],
    ids=["decorator", "mixin"],
)
def test_a_view_already_called_takes_changed_settings_up(api, settings, path):
    # What a view's options resolve to is kept between requests: only as long as the
    # settings are the same ones.
    assert api.post(path, {"amount": 1, "currency": "EUR"}, key=new_key()).status_code == 201
    settings.IDEMPOTENCY = {"LEASE": timedelta(seconds=7), "TTL": timedelta(hours=5)}
    key = new_key()
    assert api.post(path, {"amount": 1, "currency": "EUR"}, key=key).status_code == 201
    record = IdempotencyRecord.objects.get(key=key)
    assert record.expires_at - record.created_at == timedelta(hours=5)
    if path != "/charges/":
        return  # the viewset's own code reads request.idempotency: it must stay protected
    settings.IDEMPOTENCY = {"METHODS": ["PUT"]}
    unprotected = new_key()
    assert api.post(path, {"amount": 1, "currency": "EUR"}, key=unprotected).status_code == 201
    assert not IdempotencyRecord.objects.filter(key=unprotected).exists()


@pytest.mark.django_db(transaction=True)
def test_without_time_zones_the_record_in_the_way_reads_as_the_record_itself(settings):
    # USE_TZ = False: Django reads a timestamptz as a naive time in TIME_ZONE, and the
    # claim's clock is naive too; the claim's own reading must be the same (an aware one
    # made every replay compare aware with naive: a TypeError).
    settings.TIME_ZONE = "America/New_York"
    settings.USE_TZ = False
    request, naive = claim_request(), NOW.replace(tzinfo=None)
    first = _store.claim(request, naive)
    assert first.claimed
    complete(first.state, now=datetime(2026, 12, 2, 9, 31, 8))
    again = _store.claim(request, naive)
    assert not again.claimed
    stored = _store.fetch(request)
    assert stored is not None
    assert again.state.expires_at == stored.expires_at == naive + request.ttl
    assert again.state.expires_at.tzinfo is None
    assert not again.state.replaceable_by(request, naive)


@pytest.fixture
def slow_writes():
    """The record table's writes take 0.3 s each (a trigger): the deadline of a guarded
    statement can pass between its guard and its end."""
    table = IdempotencyRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION idempotency_test_slow() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END $$"
        )
        cursor.execute(
            f"CREATE TRIGGER idempotency_test_slow BEFORE INSERT OR UPDATE ON {table}"
            " FOR EACH ROW EXECUTE FUNCTION idempotency_test_slow()"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER idempotency_test_slow ON {table}")
            cursor.execute("DROP FUNCTION idempotency_test_slow()")


@postgresql_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("statement", ["insert", "takeover"])
def test_a_guarded_statement_whose_deadline_passes_while_it_writes_says_one_thing(
    statement, slow_writes
):
    """The server's clock is read once: a guarded claim that wrote never also reports that it
    was late (its caller reads the first row only, in whatever order they come)."""
    request = claim_request()
    token = uuid.uuid4()
    now = datetime.now(UTC)
    if statement == "takeover":
        _store.claim(request, now - timedelta(days=2))  # a claim expired since
        expired = IdempotencyRecord.objects.get()
    deadline = datetime.now(UTC) + timedelta(milliseconds=100)
    params: Any
    if statement == "insert":
        sql = CLAIM
        params = [request.account, request.operation, request.key, "a" * 64, "v1", "retry"]
        params += [now, request.lease, request.ttl, deadline, True]
    else:
        sql = claiming._takeover_sql("default", True)
        row = _store.statements.claim_row(request, token, now)
        params = {c: row[c] for c in claiming._TAKEOVER_COLUMNS}
        params.update(id=expired.pk, now=now, hash="a" * 64, version="v1", deadline=deadline)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    assert datetime.now(UTC) > deadline  # the deadline passed while it wrote
    assert len(rows) == 1, rows
    assert rows[0][0] is not None  # it wrote: the record's id, no refusal
    assert IdempotencyRecord.objects.count() == 1


def call_claim(cursor: Any, request: Operation, now: datetime) -> list[tuple[Any, ...]]:
    params: list[Any] = [request.account, request.operation, request.key, request.request_hash]
    params += [request.fingerprint_version, request.recovery_policy, now]
    # Whether the claim's commit may skip its flush: the policy's declaration says.
    relaxed = claiming._relaxed_commit(request.recovery_policy)
    params += [request.lease, request.ttl, None, relaxed]
    cursor.execute(CLAIM, params)
    return list(cursor.fetchall())


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_claim_through_the_function_takes_a_transaction_id_only_when_it_inserts():
    """A replay or a conflict writes nothing: no transaction id, not even for the call of the
    function around the statement."""
    request = claim_request()
    assigned = []
    with connection.cursor() as cursor:
        for _ in range(3):
            cursor.execute("BEGIN")
            rows = call_claim(cursor, request, NOW)
            cursor.execute("SELECT pg_current_xact_id_if_assigned() IS NOT NULL")
            assigned.append((len(rows), cursor.fetchone()[0]))
            cursor.execute("COMMIT")
    assert assigned == [(1, True), (1, False), (1, False)]
    assert IdempotencyRecord.objects.filter(key=request.key).count() == 1
