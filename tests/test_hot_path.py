"""The hot path's statements, what a replay does not do, and the defects the one-statement
claim fixed (engine v2)."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency import _outcomes, _store, states
from django_idempotency._context import Operation
from django_idempotency._store import claiming
from django_idempotency.models import IdempotencyAuditRecord, IdempotencyRecord, RecordStatus
from tests.helpers import ApiClient, in_thread, new_key
from tests.testapp import views
from tests.testapp.models import Charge

CHARGE = {"amount": 1000, "currency": "EUR"}
# PostgreSQL's single-statement claim; MariaDB's portable claim inserts first, and a duplicate
# INSERT waits for a row lock held on the record in its way.
postgresql_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="PostgreSQL's one-statement claim"
)
WAIT = 30
# PostgreSQL's claim: one call of its function (migration 0011), or, a server connection's
# first claim, the function's statement as text (tests/test_claim_text.py).
CLAIM_CALL = "SELECT * FROM DJANGO_IDEMPOTENCY_RECORD_CLAIM("
CLAIM_TEXT = "WITH LATE AS MATERIALIZED ("


def record_statements(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if "django_idempotency_record" in q["sql"]]


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_first_request_claims_and_completes_with_one_statement_each(api):
    with CaptureQueriesContext(connection) as queries:
        assert api.post("/charges/", CHARGE, key=new_key()).status_code == 201
    statements = record_statements(queries)
    assert len(statements) == 2, statements
    assert statements[0].lstrip().upper().startswith((CLAIM_CALL, CLAIM_TEXT, "INSERT INTO"))
    options = connection.settings_dict["OPTIONS"]
    if connection.vendor == "postgresql" and options.get("prepare_threshold") is None:
        # The completion carries the transaction's COMMIT (tests/test_commit_with_completion.py).
        assert statements[1].startswith('WITH done AS (UPDATE "django_idempotency_record"')
        assert statements[1].endswith("; COMMIT")
    else:
        assert statements[1].lstrip().upper().startswith("UPDATE")
    assert Charge.objects.count() == 1


@postgresql_only
@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("status", ["completed", "in_progress"])
def test_a_replay_or_a_conflict_is_one_statement_and_no_transaction(api, status):
    key = new_key()
    if status == "completed":
        assert api.post("/charges/", CHARGE, key=key).status_code == 201
    else:
        _in_flight(api, key)
    statements: list[str] = []

    def sent(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        # Every statement sent, a failed one included (Django's query log on MariaDB keeps
        # no INSERT that the unique key refused: counted there, two statements looked
        # like one).
        statements.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(sent):
        answer = api.post("/charges/", CHARGE, key=key)
    assert answer.status_code == (201 if status == "completed" else 409)
    # The session lookup and the claim; no SAVEPOINT, no write.
    on_records = [s for s in statements if "django_idempotency_record" in s]
    assert len(on_records) == 1, statements
    assert not [s for s in statements if s.upper().startswith(("SAVEPOINT", "UPDATE", "DELETE"))]


@pytest.mark.skipif(connection.vendor == "sqlite", reason="needs concurrent connections")
@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("replays", [False, True], ids=["new-key", "completed-key"])
def test_a_storm_on_one_key_claims_it_once(user, replays):
    # Sixteen connections claim one key at the same instant (a new key, or one completed
    # already): one claim, one charge, every other answer a 409 or the replay. On MariaDB
    # these are racing INSERTs that the unique key refuses, each then reading the winner.
    key = new_key()
    if replays:
        assert ApiClient(user).post("/charges/", CHARGE, key=key).status_code == 201
    start = threading.Barrier(16, timeout=WAIT)

    def send(_: int) -> tuple[int, str]:
        client = ApiClient(user)
        try:
            start.wait()
            answer = client.post("/charges/", CHARGE, key=key)
            return int(answer.status_code), answer.headers.get("Idempotent-Replayed", "")
        finally:
            connections.close_all()

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, range(16), timeout=WAIT))
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {201, 409}, answers
    if replays:
        assert answers == [(201, "true")] * 16
    else:
        assert [a for a in answers if a == (201, "")] == [(201, "")]
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


def _in_flight(api: Any, key: str) -> None:
    """A record of ``key`` held by a live lease, as a running original leaves it."""
    now = timezone.now()
    user_id = api.client.session["_auth_user_id"]
    IdempotencyRecord.objects.create(
        account=f"user:{user_id}",
        operation="POST charges/",
        key=key,
        request_hash="0" * 64,
        fingerprint_version="other",
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=now + timedelta(minutes=5),
        expires_at=now + timedelta(hours=1),
    )


@postgresql_only
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_replay_waits_for_nobody(api):
    """A row lock on the record (another retry, the purge, an operator) never delays a replay:
    the claim reads the row in its way, it does not lock it."""
    key = new_key()
    assert api.post("/charges/", CHARGE, key=key).status_code == 201
    locked, release = threading.Event(), threading.Event()

    def hold() -> bool:
        with transaction.atomic():
            list(IdempotencyRecord.objects.select_for_update().filter(key=key))
            locked.set()
            return release.wait(WAIT)

    with ThreadPoolExecutor(max_workers=1) as pool:
        holder = pool.submit(in_thread(hold))
        assert locked.wait(WAIT)
        with connection.cursor() as cursor:
            # A claim that waited for the lock would fail here rather than hang the test.
            cursor.execute("SET lock_timeout = '2s'")
        answer = api.post("/charges/", CHARGE, key=key)
        still_held = not release.is_set()
        release.set()
        assert holder.result(WAIT) is True
    assert answer.status_code == 201
    assert answer.headers["Idempotent-Replayed"] == "true"
    assert still_held
    assert Charge.objects.count() == 1


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_recovery_callable_that_raises_gives_the_lease_back(api):
    """Before engine v2 the key stayed locked for a whole new lease: a retry got 409s."""
    views.RECOVERY_ASKED.clear()
    key = "raise-" + new_key()
    now = timezone.now()
    user_id = api.client.session["_auth_user_id"]
    IdempotencyRecord.objects.create(
        account=f"user:{user_id}",
        operation="charges.create-callable",
        key=key,
        request_hash="0" * 64,
        fingerprint_version="other",  # another fingerprint version: the same request
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=now - timedelta(seconds=1),
        expires_at=now + timedelta(hours=1),
        recovery_policy="tests.testapp.views.recover_by_asking_provider",
    )
    for attempt in (1, 2):
        with pytest.raises(ConnectionError):
            api.post("/charges/callable-policy/", CHARGE, key=key)
        record = IdempotencyRecord.objects.get()
        assert record.status == RecordStatus.IN_PROGRESS
        assert record.lease_expires_at <= timezone.now()  # stale again: asked again at once
        assert record.recovery_attempts == attempt
    assert [key, key] == views.RECOVERY_ASKED
    assert Charge.objects.count() == 0


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_every_path_of_the_claim_archives_the_expired_record_it_replaces(settings, monkeypatch):
    """The claim looks again when the record in its way vanished; that second look, too,
    copies an expired record to the audit trail before replacing it (before engine v2 the
    retry branch replaced it without a copy)."""
    settings.IDEMPOTENCY = {"AUDIT": True}
    now = timezone.now()
    expired = IdempotencyRecord.objects.create(
        account="user:1",
        operation="op",
        key="k",
        request_hash="a" * 64,
        status=RecordStatus.COMPLETED,
        response_status=201,
        expires_at=now - timedelta(seconds=1),
    )
    looks = {"insert": 0, "fetch": 0}
    real_insert, real_fetch = claiming._insert_or_existing, claiming.fetch

    def first_sees_nothing(*args: Any) -> Any:
        looks["insert"] += 1
        return None if looks["insert"] == 1 else real_insert(*args)

    def vanished_once(*args: Any) -> Any:
        looks["fetch"] += 1
        return None if looks["fetch"] == 1 else real_fetch(*args)

    monkeypatch.setattr(claiming, "_insert_or_existing", first_sees_nothing)
    monkeypatch.setattr(claiming, "fetch", vanished_once)
    result = _store.claim(
        Operation(
            alias="default",
            account="user:1",
            operation="op",
            key="k",
            request_hash="b" * 64,
            fingerprint_version="v1",
            recovery_policy="retry",
            lease=timedelta(seconds=60),
            ttl=timedelta(hours=1),
        ),
        now,
    )
    assert result.claimed
    assert looks["insert"] == 2
    (copy,) = IdempotencyAuditRecord.objects.all()
    assert (copy.record_id, copy.request_hash, copy.reason) == (expired.pk, "a" * 64, "replaced")


@postgresql_only
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_retry_claim_commits_before_the_view_runs_and_is_seen_at_once(api):
    """The claim of a "retry" operation does not wait for its WAL flush, but it is committed
    and visible to every other connection before the view runs."""
    seen: list[int] = []
    key = new_key()

    def look() -> None:
        with connections["provider"].cursor() as cursor:
            cursor.execute("SELECT count(*) FROM django_idempotency_record WHERE key = %s", [key])
            seen.append(cursor.fetchone()[0])

    with ThreadPoolExecutor(max_workers=1) as pool:
        original = api.post

        def post_and_look() -> Any:
            return original("/charges/", CHARGE, key=key, headers={"X-Test": "sleep-start:0.5"})

        future = pool.submit(in_thread(post_and_look))
        deadline = timezone.now() + timedelta(seconds=WAIT)
        while not seen or seen[-1] == 0:
            look()
            assert timezone.now() < deadline
        assert future.result(WAIT).status_code == 201
    assert seen[-1] == 1
    assert Charge.objects.count() == 1


@pytest.mark.parametrize(
    "stored",
    [
        [["Content-Type", "application/json"], ["Location", "/charges/1/"]],
        [["Location", "/charges/1/"], ["Content-Type", "text/plain"]],
        [["content-type", "application/json"]],
        [["Content-Type", "application/json"], ["Content-Type", "text/csv"]],
        [["Location", "/charges/1/"]],
        [],
    ],
    ids=["first", "second", "lower-case", "twice", "none", "no headers"],
)
def test_a_replay_has_exactly_the_stored_headers_in_their_spelling(stored):

    state = _store.RecordState(
        id=1,
        status=states.COMPLETED,
        lease_token=None,
        lease_expires_at=None,
        expires_at=timezone.now(),
        request_hash="a" * 64,
        fingerprint_version="v1",
        recovery_attempts=0,
        response_status=201,
        response_headers=stored,
        response_body=b"{}",
    )
    response = _outcomes.replay_response(state)
    expected: dict[str, tuple[str, str]] = {}
    for name, value in stored:  # the last of a name wins, as when they were set one by one
        expected[name.lower()] = (name, value)
    expected["idempotent-replayed"] = ("Idempotent-Replayed", "true")
    assert {name.lower(): (name, value) for name, value in response.items()} == expected
    assert response.content == b"{}"
    assert response.status_code == 201
