"""A server connection's first claim is the claim's statement sent as text.

The claim's function (migration 0011) keeps its plans for the life of the server
connection, but its first call on one loads PL/pgSQL and compiles it: about a millisecond
that a connection serving one request (Django's default ``CONN_MAX_AGE = 0``, every
request under ASGI) would pay on every claim. So a connection's first claim sends the
function's own statement as text (``postgresql.claim_text``, read from the migration), and
the later ones call the function. Both forms must give the same rows, relax the same
commits and refuse the same late writes.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, connections

from django_idempotency import _store
from django_idempotency._store import claiming
from django_idempotency._vendors.postgresql import (
    CLAIM,
    CLAIM_ARGUMENTS,
    CLAIM_MIGRATION,
    claim_text,
)
from django_idempotency.models import IdempotencyRecord
from tests.helpers import libpq_trace, simple_queries
from tests.test_claim_statement import NOW, UTC, claim_request, complete

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's claim function"),
    pytest.mark.django_db(transaction=True),
]
FORMS = ["text", "function"]


def call(form: str, request: Any, now: datetime, deadline: datetime | None = None) -> list[Any]:
    params = [request.account, request.operation, request.key, request.request_hash]
    params += [request.fingerprint_version, request.recovery_policy, now, request.lease]
    params += [request.ttl, deadline, claiming._relaxed_commit(request.recovery_policy)]
    with connection.cursor() as cursor:
        if form == "text":
            cursor.execute(claim_text(), dict(zip(CLAIM_ARGUMENTS, params, strict=True)))
        else:
            cursor.execute(CLAIM, params)
        return list(cursor.fetchall())


def test_the_text_is_the_functions_statement_with_each_argument_bound_and_cast() -> None:
    text = claim_text()
    named = set(re.findall(r"%\((p_[a-z_]+)\)s::", text))
    assert named == set(CLAIM_ARGUMENTS)
    assert "p_" not in re.sub(r"%\(p_[a-z_]+\)s", "", text)  # no argument left unbound
    # The function the database holds is the one the text was read from.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_functiondef('django_idempotency_record_claim'::regproc)")
        (definition,) = cursor.fetchone()
    migration = __import__(CLAIM_MIGRATION, fromlist=["CLAIM_FUNCTION"])
    body = migration.CLAIM_FUNCTION.split("RETURN QUERY", 1)[1].rsplit("END", 1)[0].strip()
    assert body in definition


@pytest.mark.skipif(
    connection.settings_dict["OPTIONS"].get("prepare_threshold") is not None,
    reason="with prepared statements every claim calls the function",
)
def test_a_connections_first_claim_is_text_and_the_next_ones_call_the_function() -> None:
    connection.close()
    with libpq_trace() as lines:
        first = _store.claim(claim_request(), NOW)
        second = _store.claim(claim_request(key="x"), NOW)
    assert first.claimed
    assert second.claimed
    queries = simple_queries(lines)
    assert queries[0].startswith('"WITH late AS MATERIALIZED')
    assert queries[1].startswith('"SELECT * FROM django_idempotency_record_claim(')
    # A new server connection: text again.
    connection.close()
    with libpq_trace() as lines:
        assert not _store.claim(claim_request(key="x"), NOW).claimed
    queries = simple_queries(lines)
    assert queries[0].startswith('"WITH late AS MATERIALIZED')
    assert IdempotencyRecord.objects.count() == 2


@pytest.mark.parametrize("completed", [False, True], ids=["in progress", "completed"])
def test_both_forms_hand_back_the_same_record_in_the_way(completed: bool) -> None:
    request = claim_request()
    rows = call("text", request, NOW)
    assert len(rows) == 1
    assert rows[0][1] is None
    if completed:
        complete(_store.fetch(request))  # type: ignore[arg-type]
    assert call("text", request, NOW) == call("function", request, NOW)
    assert IdempotencyRecord.objects.filter(key=request.key).count() == 1


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("policy", ["retry", "fail", "resume"])
def test_each_form_relaxes_the_commit_of_a_new_retry_claim_only(form: str, policy: str) -> None:
    """The commit of a new "retry" claim only, and of nothing else: a replay of any policy
    leaves the transaction's setting as it was."""
    request = claim_request(recovery_policy=policy)
    settings = []
    with connection.cursor() as cursor:
        for _ in range(2):  # the new claim, then the record in the way
            cursor.execute("BEGIN")
            call(form, request, NOW)
            cursor.execute("SHOW synchronous_commit")
            settings.append(cursor.fetchone()[0])
            cursor.execute("COMMIT")
    assert settings == (["off", "on"] if policy == "retry" else ["on", "on"])
    assert IdempotencyRecord.objects.filter(key=request.key).count() == 1


@pytest.mark.parametrize("form", FORMS)
def test_each_form_writes_nothing_past_its_deadline(form: str) -> None:
    request = claim_request()
    past = datetime.now(UTC) - timedelta(seconds=1)
    rows = call(form, request, NOW, deadline=past)
    assert rows == [(None,) * 11]  # the guard's row only
    assert not IdempotencyRecord.objects.filter(key=request.key).exists()
    future = datetime.now(UTC) + timedelta(seconds=30)
    assert call(form, request, NOW, deadline=future)[0][0] is not None


def test_a_first_claim_past_its_deadline_raises_and_writes_nothing() -> None:
    connection.close()
    request = claim_request()
    with pytest.raises(OperationalError, match="after CLAIM_TIMEOUT"):
        _store.claim(request, NOW, deadline=datetime.now(UTC) - timedelta(seconds=1))
    assert not IdempotencyRecord.objects.filter(key=request.key).exists()


@pytest.mark.parametrize("form", FORMS)
def test_a_hostile_key_is_a_value_in_either_form(form: str) -> None:
    key = "k'); DROP TABLE django_idempotency_record; -- %s %(p_key)s $1"
    request = claim_request(key=key)
    assert call(form, request, NOW)[0][0] is not None
    assert call(form, request, NOW)[0][1] == "in_progress"
    assert IdempotencyRecord.objects.get().key == key
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM django_idempotency_record")
        assert cursor.fetchone()[0] == 1
