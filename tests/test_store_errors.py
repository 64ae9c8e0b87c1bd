"""Errors on the product's own statements answer 503 / StoreUnavailable, never a 500, and
leave no record in progress for an attempt that never reached the work.

- a terminated backend, on the claim (autocommit) and inside a caller's transaction (where
  the isolation check is the first statement);
- the completion failing after the work ran: the work rolls back, the claim is released;
- the connection lost after the claim, before the work's transaction or in its first
  statement (a node of a cluster killed, a backend terminated): ``503``, the claim released
  when nothing ran (or, once the work started, given back where the policy keeps it);
- prepared statements through PgBouncer before 1.21 in transaction mode: the engine stops
  preparing on that database, says why once, and no call fails twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.test import Client, override_settings

from django_idempotency import StoreUnavailable, _store, run_once
from django_idempotency._store import statements
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import is_completion, new_key, postgres_only
from tests.testapp.models import Charge, ProviderCall

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]
on_postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="backends and PgBouncer: PostgreSQL's"
)
IDENTITY = {"account": "consumer:mail", "operation": "mail.send"}


def effect(calls: list[str], tag: str) -> str:
    calls.append(tag)
    Charge.objects.create(account="consumer", amount=1, currency="EUR")
    return tag


def terminate(alias: str = "default") -> None:
    """End the server backend of ``alias``'s connection, as an administrator or a failover
    would: ``pg_terminate_backend`` on PostgreSQL, ``KILL`` on MariaDB, from another
    connection."""
    mysql = connections[alias].vendor == "mysql"
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT CONNECTION_ID()" if mysql else "SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    with connections["provider"].cursor() as cursor:
        cursor.execute("KILL %s" if mysql else "SELECT pg_terminate_backend(%s)", [pid])


@on_postgresql
def test_a_terminated_backend_on_the_claim_is_store_unavailable_and_the_next_call_runs():
    calls: list[str] = []
    assert Charge.objects.count() == 0  # the connection is open
    terminate()
    with pytest.raises(StoreUnavailable):
        run_once(effect, calls, "a", **IDENTITY, key="k-1")
    assert calls == []
    # The broken connection was let go: the next call connects afresh and runs.
    assert run_once(effect, calls, "b", **IDENTITY, key="k-1") == "b"
    assert calls == ["b"]
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


@on_postgresql
def test_a_terminated_backend_inside_a_callers_transaction_is_store_unavailable():
    calls: list[str] = []
    with transaction.atomic():
        Charge.objects.count()  # the caller's transaction is under way
        terminate()
        with pytest.raises(StoreUnavailable):
            run_once(effect, calls, "a", **IDENTITY, key="k-1")
        transaction.set_rollback(True)
    assert calls == []
    connection.close()
    assert IdempotencyRecord.objects.count() == 0


def failing_completion(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
    """An execute wrapper: the engine's fenced completion fails as a lost connection would."""
    if is_completion(sql):
        raise OperationalError("the server closed the connection during the completion")
    return execute(sql, params, many, context)


def test_a_completion_that_fails_rolls_the_work_back_releases_and_is_store_unavailable():
    calls: list[str] = []
    with connection.execute_wrapper(failing_completion), pytest.raises(StoreUnavailable):
        run_once(effect, calls, "a", **IDENTITY, key="k-1")
    assert calls == ["a"]
    assert Charge.objects.count() == 0  # rolled back with the completion
    assert IdempotencyRecord.objects.count() == 0  # released: a retry runs afresh
    assert run_once(effect, calls, "b", **IDENTITY, key="k-1") == "b"
    assert Charge.objects.count() == 1


def charging(user: Any) -> Any:
    """A logged-in client's POST of one charge to ``/charges/``, with one key throughout."""
    client = Client()
    client.force_login(user)
    key = new_key()

    def post() -> Any:
        return client.post(
            "/charges/",
            {"amount": 5, "currency": "EUR"},
            content_type="application/json",
            headers={"Idempotency-Key": key},
        )

    return post


def test_over_http_a_completion_that_fails_is_a_503_and_the_retry_runs(user):
    post = charging(user)
    with connection.execute_wrapper(failing_completion):
        failed = post()
    assert failed.status_code == 503
    assert failed.json()["code"] == "idempotency_store_unavailable"
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0
    assert post().status_code == 201
    assert Charge.objects.count() == 1


@pytest.fixture
def bounced_with_prepared_statements() -> Iterator[str]:
    """The alias ``claims`` through a PgBouncer 1.18 in transaction mode (two server
    connections), with every engine statement prepared: ``DATABASE`` on it."""
    import shutil

    if shutil.which("pgbouncer") is None and not __import__("os").path.exists(
        "/usr/sbin/pgbouncer"
    ):
        pytest.skip("PgBouncer is not installed (CI installs it)")
    from tests.poolers import pgbouncer

    settings = connections["claims"].settings_dict
    upstream = int(connections["default"].settings_dict["PORT"] or 5432)
    saved = (
        settings["PORT"],
        dict(settings["OPTIONS"]),
        settings.get("DISABLE_SERVER_SIDE_CURSORS"),
    )
    with pgbouncer(upstream, pool_size=2) as bouncer:
        connections["claims"].close()
        settings["PORT"] = str(bouncer.port)
        settings["OPTIONS"] = {**settings["OPTIONS"], "prepare_threshold": 0}
        settings["DISABLE_SERVER_SIDE_CURSORS"] = True
        statements.refused.discard("claims")
        try:
            with override_settings(IDEMPOTENCY={"DATABASE": "claims"}):
                yield "claims"
        finally:
            connections["claims"].close()
            settings["PORT"], settings["OPTIONS"], settings["DISABLE_SERVER_SIDE_CURSORS"] = saved
            statements.refused.discard("claims")


@on_postgresql
def test_prepared_statements_through_an_old_pgbouncer_stop_and_nothing_is_left_in_progress(
    bounced_with_prepared_statements, caplog
):
    caplog.set_level(logging.WARNING, logger="django_idempotency")
    alias = bounced_with_prepared_statements
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker(thread: int) -> None:
        try:
            for n in range(15):

                def work(tag: str) -> str:
                    Charge.objects.using(alias).create(account="consumer", amount=1, currency="EUR")
                    return tag

                try:
                    run_once(work, f"{thread}-{n}", **IDENTITY, key=f"k-{thread}-{n}")
                    outcome = "ran"
                except StoreUnavailable:
                    outcome = "refused"
                with lock:
                    outcomes.append(outcome)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == 45, outcomes
    # At most the first statement of each connection fails, inside its transaction (a
    # completion); everything else ran, and nothing is left in progress.
    assert outcomes.count("refused") <= 3, outcomes
    assert not IdempotencyRecord.objects.filter(status=RecordStatus.IN_PROGRESS).exists()
    completed = IdempotencyRecord.objects.filter(status=RecordStatus.COMPLETED).count()
    assert completed == outcomes.count("ran") == Charge.objects.count()
    assert "claims" in statements.refused
    assert caplog.text.count("refused a prepared statement") == 1


def dies_after_the_claim(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The backend of the caller's connection is terminated right after a claim committed,
    before anything else runs: the statements that follow (reading a resumable operation's
    steps, a recovery policy's closing) find it gone. The list counts the terminations."""
    fired: list[int] = []
    real = _store.claim

    def claim_then_die(op: Any, now: Any) -> Any:
        result = real(op, now)
        if result.claimed and not fired:
            fired.append(1)
            terminate()
        return result

    monkeypatch.setattr(_store, "claim", claim_then_die)
    return fired


@on_postgresql
def test_resume_whose_steps_cannot_be_read_is_store_unavailable_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
):
    fired = dies_after_the_claim(monkeypatch)
    calls: list[str] = []
    with pytest.raises(StoreUnavailable):
        run_once(effect, calls, "a", **IDENTITY, key="k-1", recovery="resume")
    assert fired == [1]
    assert calls == []
    connection.close()
    # A fresh claim has no steps to keep: released, so the retry runs at once.
    assert IdempotencyRecord.objects.count() == 0
    assert run_once(effect, calls, "b", **IDENTITY, key="k-1", recovery="resume") == "b"


@on_postgresql
@pytest.mark.parametrize("policy", ["fail", "tests.testapp.views.recover_by_asking_provider"])
def test_a_recovery_that_cannot_store_its_outcome_is_store_unavailable(
    policy, monkeypatch: pytest.MonkeyPatch
):
    from django.utils import timezone

    from django_idempotency.exceptions import SimulatedCrash

    def crash() -> str:
        raise SimulatedCrash

    with pytest.raises(SimulatedCrash):
        run_once(crash, **IDENTITY, key="k-2", recovery=policy)
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now())
    fired = dies_after_the_claim(monkeypatch)
    calls: list[str] = []
    with pytest.raises(StoreUnavailable):
        run_once(effect, calls, "a", **IDENTITY, key="k-2", recovery=policy)
    assert fired == [1]
    assert calls == []


def test_under_fail_a_completion_that_fails_keeps_the_claim_for_the_policy():
    """The body ran (its external calls may have happened): under "fail" the claim is
    kept, its lease given back, and the next attempt gets the unknown outcome, never a
    second run."""
    from django_idempotency import OutcomeUnknown

    calls: list[str] = []
    with connection.execute_wrapper(failing_completion), pytest.raises(StoreUnavailable):
        run_once(effect, calls, "a", **IDENTITY, key="k-3", recovery="fail")
    assert IdempotencyRecord.objects.get().status == RecordStatus.IN_PROGRESS
    with pytest.raises(OutcomeUnknown):
        run_once(effect, calls, "b", **IDENTITY, key="k-3", recovery="fail")
    assert calls == ["a"]
    assert Charge.objects.count() == 0


@on_postgresql
def test_over_http_a_recovery_that_cannot_store_its_outcome_is_a_503(
    user, monkeypatch: pytest.MonkeyPatch
):
    import uuid
    from datetime import timedelta

    from django.utils import timezone

    now = timezone.now()
    key = new_key()
    IdempotencyRecord.objects.create(
        account=f"user:{user.pk}",
        operation="charges.create-fail",
        key=key,
        request_hash="x" * 64,
        fingerprint_version="another-version",
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=now - timedelta(seconds=5),
        recovery_policy="fail",
        expires_at=now + timedelta(hours=1),
    )
    fired = dies_after_the_claim(monkeypatch)
    client = Client()
    client.force_login(user)
    answer = client.post(
        "/charges/fail-policy/",
        {"amount": 5, "currency": "EUR"},
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )
    assert fired == [1]
    assert answer.status_code == 503
    assert answer.json()["code"] == "idempotency_store_unavailable"
    assert Charge.objects.count() == 0


#: What a server says when it refuses a transaction to be retried: PostgreSQL's
#: serialization failure; MariaDB's deadlock (also a Galera certification conflict) and its
#: "record has changed since last read" (``innodb_snapshot_isolation``, on by default from
#: MariaDB 11.6).
CONFLICTS = (
    [
        "SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213",
        "SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = 1020",
    ]
    if connection.vendor == "mysql"
    else ["DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$"]
)


def conflict(calls: list[str], refusal: str = CONFLICTS[0]) -> str:
    """The work writes, then the database refuses its transaction as a conflict: what a
    Galera certification conflict (error 1213) or a deadlock is to the work's own
    statement."""
    effect(calls, "conflicted")
    with connection.cursor() as cursor:
        cursor.execute(refusal)
    return "unreachable"


@pytest.mark.parametrize("refusal", CONFLICTS)
def test_a_conflict_in_the_work_is_store_unavailable_and_the_retry_runs_once(refusal: str):
    """The database asks for the transaction to be retried: a refusal to retry (503 with
    Retry-After over HTTP), the work rolled back and the claim released, never the work's
    error (a 500)."""
    calls: list[str] = []
    with pytest.raises(StoreUnavailable) as refused:
        run_once(conflict, calls, refusal, **IDENTITY, key="k-conflict")
    assert isinstance(refused.value.__cause__, OperationalError)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.filter(key="k-conflict").exists()
    assert run_once(effect, calls, "retried", **IDENTITY, key="k-conflict") == "retried"
    assert calls == ["conflicted", "retried"]
    assert Charge.objects.count() == 1


# -- the connection lost between the claim and the work --------------------------------------

#: Where the cut connection first fails. MariaDB and MySQL begin the work's transaction with
#: a round trip (``SET autocommit=0``), which fails before the body starts: nothing ran.
#: psycopg begins it with the body's first statement, which fails: the body had started.
BODY_STARTS = connection.vendor == "postgresql"


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_a_connection_lost_after_the_claim_is_store_unavailable_never_the_works_error(
    policy, monkeypatch: pytest.MonkeyPatch
):
    """The server side of the caller's connection ends right after its claim committed (a
    Galera node killed, a backend terminated): ``StoreUnavailable``, never the driver's
    error; the work's transaction did not commit. Where nothing ran, the claim is released
    whatever the policy, and the next call runs at once; where the body had started, its
    lease is given back under "fail", whose retry gets the unknown outcome."""
    from django_idempotency import OutcomeUnknown

    fired = dies_after_the_claim(monkeypatch)
    calls: list[str] = []
    with pytest.raises(StoreUnavailable) as refused:
        run_once(effect, calls, "a", **IDENTITY, key="k-lost", recovery=policy)
    assert fired == [1]
    assert refused.value.ran is BODY_STARTS
    assert calls == (["a"] if BODY_STARTS else [])
    monkeypatch.undo()
    connection.close()
    assert Charge.objects.count() == 0  # the work's transaction never committed
    if BODY_STARTS and policy == "fail":
        record = IdempotencyRecord.objects.get()
        assert record.status == RecordStatus.IN_PROGRESS  # given back, for the policy
        with pytest.raises(OutcomeUnknown):
            run_once(effect, calls, "b", **IDENTITY, key="k-lost", recovery=policy)
        assert calls == ["a"]
        return
    assert IdempotencyRecord.objects.count() == 0  # released: no record left in progress
    assert run_once(effect, calls, "b", **IDENTITY, key="k-lost", recovery=policy) == "b"
    assert calls == [*(["a"] if BODY_STARTS else []), "b"]
    assert Charge.objects.count() == 1


def test_over_http_a_connection_lost_after_the_claim_is_a_503_and_the_retry_runs_once(
    user, monkeypatch: pytest.MonkeyPatch
):
    """The same over HTTP: ``503 idempotency_store_unavailable`` with ``Retry-After``, never
    the view's ``500``; the provider was called only where the view had started; the retry
    charges once."""
    from django_idempotency import _problems

    fired = dies_after_the_claim(monkeypatch)
    post = charging(user)
    lost = post()
    assert fired == [1]
    assert lost.status_code == 503
    assert lost.headers["Retry-After"]
    assert lost.json()["code"] == "idempotency_store_unavailable"
    assert lost.json()["detail"] == _problems.store_unavailable_detail(BODY_STARTS)
    monkeypatch.undo()
    connection.close()
    assert ProviderCall.objects.using("provider").count() == (1 if BODY_STARTS else 0)
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0  # released under "retry"
    assert post().status_code == 201
    replay = post()
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert ProviderCall.objects.using("provider").count() == (2 if BODY_STARTS else 1)


def broken_work(calls: list[str]) -> str:
    """The work's own statement fails for its own sake (a statement timeout, say): not a
    lost connection."""
    effect(calls, "broken")
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM no_such_table")
    return "unreachable"


def test_the_works_own_error_stays_its_own():
    """A failure of the work's statement that is not the connection's stays the work's
    error (the view's ``500``), its work rolled back and the claim released."""
    from django.db import ProgrammingError

    calls: list[str] = []
    with pytest.raises(ProgrammingError):
        run_once(broken_work, calls, **IDENTITY, key="k-broken")
    assert calls == ["broken"]
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0
