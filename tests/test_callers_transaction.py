"""The claim commits on its own, whatever transaction the caller is in.

Table-driven over the caller's transaction state (none, ``atomic()``, nested savepoints,
``ATOMIC_REQUESTS``) by entry point (decorator, mixin, ``@api_view``, ninja, ``run_once``,
``@idempotent_task``) by recovery policy (``"retry"``, ``"fail"``). For each:

- the claim is visible from another connection before the work runs, the work and the
  completion commit with the caller, and a retry replays;
- after a crash inside the work (``SimulatedCrash``: the process's transaction is gone, as
  after a kill) and the lease's end, the policy keeps its promise: ``"retry"`` runs once more
  with the same downstream key and commits one local effect, ``"fail"`` never runs again;
- a duplicate from another connection while the first attempt holds its claim gets ``409`` /
  ``InProgress`` at once, never a wait on the first attempt's transaction.

The body and the entry points: ``tests/testapp/txn_views.py``. PostgreSQL and MariaDB (each
attempt has its own connection); ``make test-poolers`` runs this module through PgBouncer in
transaction mode and Django's pool.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections, transaction
from django.test import Client
from django.utils import timezone

from django_idempotency import InProgress, run_once
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key, postgres_only
from tests.testapp import txn_views
from tests.testapp.models import Charge, ProviderCall

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

ENTRIES = ["decorator", "run-once"] + (["task"] if txn_views.HAS_CELERY else [])
if settings.HAS_DRF:
    ENTRIES += ["mixin", "api-view"]
if settings.HAS_NINJA:
    ENTRIES += ["ninja"]
CALLERS = ["none", "atomic", "nested", "atomic-requests"]
POLICIES = list(txn_views.POLICIES)


@contextmanager
def caller(state: str) -> Iterator[None]:
    """The caller's transaction state around one request."""
    with ExitStack() as stack:
        if state == "atomic-requests":
            connection.settings_dict["ATOMIC_REQUESTS"] = True
            stack.callback(connection.settings_dict.__setitem__, "ATOMIC_REQUESTS", False)
        elif state in ("atomic", "nested"):
            stack.enter_context(transaction.atomic())
            if state == "nested":
                stack.enter_context(transaction.atomic())
                stack.enter_context(transaction.atomic())
        yield


class Caller:
    """A logged-in client that posts one operation's key to one entry point."""

    def __init__(self, user: Any, entry: str, policy: str, key: str | None = None) -> None:
        self.client = Client()
        self.client.force_login(user)
        self.path = f"/txn/{entry}/{policy}/"
        self.key = key or new_key()

    def post(self, test: str = "") -> Any:
        headers = {"Idempotency-Key": self.key}
        if test:
            headers["X-Test"] = test
        return self.client.post(self.path, "{}", content_type="application/json", headers=headers)

    def twin(self) -> Caller:
        """The same caller and key on a client of its own (for another thread)."""
        other = Caller.__new__(Caller)
        other.client = Client()
        other.client.cookies = self.client.cookies
        other.path, other.key = self.path, self.key
        return other


def record() -> IdempotencyRecord:
    (only,) = IdempotencyRecord.objects.all()
    return only


def end_lease() -> None:
    """What the passing of the lease does: the attempt's lease is over."""
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("state", CALLERS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_the_claim_is_visible_elsewhere_and_completes_with_the_caller(user, entry, state, policy):
    client = Caller(user, entry, policy)
    with caller(state):
        first = client.post()
    assert first.status_code == 201, first.content
    assert json.loads(first.content)["seen"] is True  # another connection saw the claim
    assert record().status == RecordStatus.COMPLETED
    with caller(state):
        retry = client.post()
    assert retry.status_code == 201
    assert json.loads(retry.content) == json.loads(first.content)
    assert Charge.objects.count() == 1
    assert ProviderCall.objects.count() == 1


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("state", CALLERS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_after_a_crash_the_policy_keeps_its_promise(user, entry, state, policy):
    client = Caller(user, entry, policy)
    with pytest.raises(SimulatedCrash), caller(state):
        client.post("crash")
    # The crashed attempt's transaction is gone; its claim is not.
    assert record().status == RecordStatus.IN_PROGRESS
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 1
    with caller(state):
        early = client.post()
    assert early.status_code == 409  # the lease still runs: nobody else may run it
    end_lease()
    with caller(state):
        answer = client.post()
    calls = list(ProviderCall.objects.values_list("key", flat=True))
    if policy == "retry":
        assert answer.status_code == 201, answer.content
        assert Charge.objects.count() == 1
        assert len(calls) == 2
        assert len(set(calls)) == 1  # one downstream key: the provider can deduplicate
        assert record().status == RecordStatus.COMPLETED
    else:
        assert answer.status_code == 500, answer.content
        assert json.loads(answer.content)["code"] == "idempotency_outcome_unknown"
        assert Charge.objects.count() == 0
        assert len(calls) == 1  # never run again
        assert record().status == RecordStatus.FAILED
    with caller(state):
        again = client.post()
    assert again.status_code == answer.status_code
    assert Charge.objects.count() == (1 if policy == "retry" else 0)
    assert ProviderCall.objects.count() == len(calls)


def _in_thread(call: Callable[[], Any]) -> Any:
    """``call()`` on a thread of its own (so on a connection of its own); bounded."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            result.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    # A duplicate that waited on the first attempt's transaction would wait until the body
    # returned, and the body waits here: the join would time out.
    thread.join(timeout=10)
    assert not thread.is_alive(), "the duplicate waited for the first attempt's transaction"
    return result[0]


@pytest.mark.parametrize("state", CALLERS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_duplicate_is_refused_at_once_while_the_first_holds_the_claim(user, entry, state):
    client = Caller(user, entry, "retry")
    duplicates: list[Any] = []
    txn_views.during = lambda: duplicates.append(_in_thread(client.twin().post))
    try:
        with caller(state):
            first = client.post()
    finally:
        txn_views.during = None
    (duplicate,) = duplicates
    assert duplicate.status_code == 409, duplicate.content
    assert first.status_code == 201
    assert Charge.objects.count() == 1
    assert ProviderCall.objects.count() == 1


def test_an_outer_rollback_leaves_the_claim_as_a_crash_would(user):
    client = Caller(user, "run-once", "retry")
    answers = []

    def operation_then_failure() -> None:
        with transaction.atomic():
            answers.append(client.post())
            raise RuntimeError("the caller's transaction rolls back after the operation")

    with pytest.raises(RuntimeError):
        operation_then_failure()
    assert answers[0].status_code == 201
    # The work and the completion rolled back with the caller; the claim is held until its
    # lease runs out, then recovered by its policy.
    assert Charge.objects.count() == 0
    assert record().status == RecordStatus.IN_PROGRESS
    assert client.post().status_code == 409
    end_lease()
    assert client.post().status_code == 201
    assert Charge.objects.count() == 1


IDENTITY = {"account": "consumer:txn", "operation": "txn.same", "key": "m-1"}


def _ship() -> str:
    Charge.objects.create(account="consumer", amount=1, currency="EUR")
    return "shipped"


def test_the_same_key_twice_in_one_transaction_runs_once():
    # A batch that holds one message twice: the second call sees the first one's outcome,
    # which only the caller's transaction can see yet.
    with transaction.atomic():
        assert run_once(_ship, **IDENTITY) == "shipped"
        assert run_once(_ship, **IDENTITY) == "shipped"
    assert Charge.objects.count() == 1
    assert record().status == RecordStatus.COMPLETED


def test_a_stale_lease_of_this_transactions_own_key_never_waits_on_itself():
    # The first call completed the record inside the caller's transaction (its row locked by
    # it) and the lease ran out since: the second call answers from the caller's own view,
    # where a takeover on the second connection would wait for the caller forever.
    results: list[Any] = []

    def batch() -> None:
        try:
            with transaction.atomic():
                results.append(run_once(_ship, **IDENTITY, lease=1))
                time.sleep(1.2)
                results.append(run_once(_ship, **IDENTITY, lease=1))
        finally:
            connections.close_all()

    worker = threading.Thread(target=batch)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "the second call waited on its own transaction's lock"
    assert results == ["shipped", "shipped"]
    assert Charge.objects.count() == 1


def _run_once_elsewhere() -> Any:
    """``run_once(_ship, **IDENTITY)`` on a connection of its own (``_in_thread``), where a
    lock wait turns into an error after 2 s: what it returned, or what it raised."""

    def attempt() -> Any:
        with connection.cursor() as cursor:
            if connection.vendor == "mysql":
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 2")
            else:
                cursor.execute("SET lock_timeout = '2s'")
        return run_once(_ship, **IDENTITY)

    return _in_thread(attempt)


def test_a_replay_inside_a_callers_transaction_holds_up_no_other_retry():
    # The caller's transaction meets the key completed, and goes on. Meanwhile a retry of
    # the key on another connection is answered at once: the replay inside the transaction
    # locked nothing that lasts until the caller's commit (its claim ran on the second
    # connection, in autocommit).
    assert run_once(_ship, **IDENTITY) == "shipped"
    with transaction.atomic():
        assert run_once(_ship, **IDENTITY) == "shipped"
        answer = _run_once_elsewhere()
    assert answer == "shipped"
    assert Charge.objects.count() == 1
    assert record().status == RecordStatus.COMPLETED


def test_a_duplicate_after_the_completion_inside_a_callers_transaction_is_refused_at_once():
    # run_once completes inside the caller's transaction: the completion's UPDATE holds
    # the record's row lock until the caller commits. A duplicate on another connection
    # meanwhile gets InProgress at once from the claim that committed on its own, never a
    # wait on that lock (a claim that locks the row in its way would wait here: an
    # INSERT ... ON DUPLICATE KEY UPDATE on MariaDB did).
    with transaction.atomic():
        assert run_once(_ship, **IDENTITY) == "shipped"
        answer = _run_once_elsewhere()
    assert isinstance(answer, InProgress), answer
    assert run_once(_ship, **IDENTITY) == "shipped"  # after the caller's commit: a replay
    assert Charge.objects.count() == 1
    assert record().status == RecordStatus.COMPLETED


@pytest.mark.parametrize("policy", POLICIES)
def test_a_protected_view_calling_run_once_for_a_sub_operation(user, policy):
    client = Caller(user, "view-run-once", policy)
    with pytest.raises(SimulatedCrash):
        client.post("crash")
    # Both claims committed on their own: the view's, and the sub-operation's inside it.
    statuses = set(IdempotencyRecord.objects.values_list("operation", "status"))
    assert statuses == {
        (f"txn.view_run_once.{policy}", RecordStatus.IN_PROGRESS),
        ("txn.run_once", RecordStatus.IN_PROGRESS),
    }
    assert ProviderCall.objects.count() == 1
    end_lease()
    answer = client.post()
    if policy == "retry":
        assert answer.status_code == 201, answer.content
        assert json.loads(answer.content)["seen"] is True
        assert Charge.objects.count() == 1
        assert ProviderCall.objects.count() == 2
    else:
        assert answer.status_code == 500
        assert json.loads(answer.content)["code"] == "idempotency_outcome_unknown"
        assert Charge.objects.count() == 0
        assert ProviderCall.objects.count() == 1


SNAPSHOT_LEVELS = (
    ["REPEATABLE READ", "SERIALIZABLE"]
    if connection.vendor == "postgresql"
    else ["REPEATABLE READ"]
)


@pytest.mark.parametrize("level", SNAPSHOT_LEVELS)
def test_a_snapshot_transaction_is_refused_on_postgresql(level):
    calls: list[int] = []

    def attempt() -> None:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
            run_once(lambda: calls.append(1), **IDENTITY)

    if connection.vendor == "postgresql":
        with pytest.raises(ImproperlyConfigured, match=level):
            attempt()
        assert calls == []
        assert not IdempotencyRecord.objects.exists()
    else:
        # InnoDB's UPDATE reads the latest committed row whatever the isolation level.
        attempt()
        attempt()
        assert calls == [1]
        assert record().status == RecordStatus.COMPLETED


ASKED: list[str] = []


def ask_the_provider(record: IdempotencyRecord) -> dict[str, str]:
    ASKED.append(record.key)
    return {"shipped": "per the provider"}


@pytest.mark.skipif(connection.vendor != "mysql", reason="PostgreSQL refuses REPEATABLE READ")
def test_a_recovery_inside_a_repeatable_read_transaction_reads_the_takeover():
    """MariaDB under ``REPEATABLE READ`` (accepted there: its ``UPDATE`` reads the newest
    row): the caller's transaction read before ``run_once`` and took its snapshot, then the
    crashed attempt's lease ran out. The takeover commits on the claim's own connection;
    the recovery callable is asked, and its answer stored, rather than the takeover being
    taken for a lost lease (read from the caller's snapshot: the callable was never asked,
    and every retry found the record held by a lease nobody ran under). Counted: the body's
    runs, the callable's calls."""
    ASKED.clear()
    runs: list[str] = []
    key = new_key()
    identity = {**IDENTITY, "key": key, "recovery": ask_the_provider}

    def ship() -> Any:
        runs.append("ran")
        raise SimulatedCrash("the process dies after its external call")

    with pytest.raises(SimulatedCrash):
        run_once(ship, **identity)
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    try:
        for _ in range(2):
            with transaction.atomic():
                assert IdempotencyRecord.objects.filter(key=key).exists()  # the snapshot
                expired = threading.Thread(target=_expired_elsewhere, args=(key,))
                expired.start()
                expired.join(timeout=10)
                assert run_once(ship, **identity) == {"shipped": "per the provider"}
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    assert (runs, ASKED) == (["ran"], [key])
    assert record().status == RecordStatus.COMPLETED


def _expired_elsewhere(key: str) -> None:
    """The lease of ``key``'s record runs out, committed on another connection."""
    try:
        IdempotencyRecord.objects.filter(key=key, status=RecordStatus.IN_PROGRESS).update(
            lease_expires_at=timezone.now() - timedelta(seconds=1)
        )
    finally:
        connections.close_all()


def _seen_elsewhere_inside() -> dict[str, Any]:
    return txn_views.work("")


def test_autocommit_turned_off_is_a_callers_transaction_too():
    transaction.set_autocommit(False)
    try:
        result = run_once(_seen_elsewhere_inside, **IDENTITY)
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert result["seen"] is True  # the claim committed on its own
    assert record().status == RecordStatus.COMPLETED
    assert Charge.objects.count() == 1


@pytest.mark.skipif(not txn_views.HAS_CELERY, reason="needs Celery")
def test_an_eager_task_inside_a_protected_operation_claims_on_its_own():
    with transaction.atomic():
        outcome = txn_views.task_fail.apply(args=("t-1", ""))
    result: Any = outcome.result
    assert result["seen"] is True
    assert IdempotencyRecord.objects.get(key="t-1").status == RecordStatus.COMPLETED
    assert ProviderCall.objects.count() == 1


@pytest.mark.skipif(connection.vendor != "postgresql", reason="pg_terminate_backend")
def test_a_terminated_second_connection_is_replaced():
    with transaction.atomic():
        run_once(_ship, **IDENTITY)
    second = connection._django_idempotency_autonomous  # type: ignore[attr-defined]
    pid = second.connection.info.backend_pid
    with connections["provider"].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    failures = 0
    for key in ("m-2", "m-3"):
        try:
            with transaction.atomic():
                run_once(_ship, **{**IDENTITY, "key": key})
        except Exception:
            failures += 1  # the first use of the dead connection fails, as Django's own do
    assert failures <= 1
    assert IdempotencyRecord.objects.filter(key="m-3", status=RecordStatus.COMPLETED).exists()
