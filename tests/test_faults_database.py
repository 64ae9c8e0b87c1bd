"""Database faults under a real gunicorn server, on a private PostgreSQL server of our own.

The request's backend is terminated (``pg_terminate_backend``) during the view's work and
between the fenced completion UPDATE and the COMMIT; the server is restarted between a
claim and its retry, and stopped while a request runs; statements time out in the view, in
the claim and in the completion. In every case: the answer is a problem+json ``503`` or a
``500``, never a success that was not committed; the claim is released, or it is still
claimed and the retry after the lease recovers it; and the provider charges once.

The shared server on 127.0.0.1:5432 is never touched: ``tests/pg_instance.py`` starts a
throwaway one, and effects are counted through a direct connection to it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from django_idempotency._problems import store_unavailable_detail
from tests import poolers
from tests.helpers import (
    FAIL_PATH,
    RETRY_PATH,
    Caller,
    assert_problem,
    postgres_only,
    settle,
    sleep_past_lease,
    unavailable,
)
from tests.helpers import (
    FAULTS_CHARGE as CHARGE,
)
from tests.live import DISCONNECTED, Answer, gunicorn, request
from tests.pg_instance import PostgresInstance, available, postgres_instance

pytestmark = [
    postgres_only,
    pytest.mark.skipif(not available(), reason="needs PostgreSQL 15 binaries and runuser"),
]

OPERATION = "faults.charge"
TABLES = (
    "testapp_charge, testapp_providercharge, testapp_providercall, django_idempotency_step, "
    "django_idempotency_record"
)
# Set on the private database while a test needs it; the test's own connections never wait.
STATEMENT_TIMEOUT_MS = 500


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresInstance]:
    with postgres_instance() as instance:
        yield instance


@pytest.fixture(scope="module")
def server(pg: PostgresInstance) -> Iterator[str]:
    # CONN_MAX_AGE is 0: every request opens its own connection, so the workers outlive
    # restarts of the database server.
    # Under TEST_DB=pgbouncer a PgBouncer of its own stands between the workers and it.
    with poolers.server_env(pg.server_env()) as env, gunicorn(workers=2, extra_env=env) as url:
        yield url


@pytest.fixture(autouse=True)
def clean(pg: PostgresInstance) -> Iterator[None]:
    if not pg.running():
        pg.start()
    pg.execute(f"TRUNCATE {TABLES}")
    yield
    if not pg.running():
        pg.start()
    pg.execute("ALTER DATABASE faults RESET statement_timeout", dbname="postgres")


@pytest.fixture
def signals(tmp_path: Path) -> tuple[Path, Path]:
    """Two files: the view touches (or writes its pid to) the first, then waits for the second."""
    return tmp_path / "reached", tmp_path / "go"


def effects(pg: PostgresInstance, caller: Caller, operation: str = OPERATION) -> tuple[int, ...]:
    """(local charges, provider charges, provider calls) of one caller's operation."""
    downstream = caller.downstream_key(operation)
    return (
        pg.scalar("SELECT count(*) FROM testapp_charge WHERE account = %s", [caller.tenant]),
        pg.scalar("SELECT count(*) FROM testapp_providercharge WHERE key = %s", [downstream]),
        pg.scalar("SELECT count(*) FROM testapp_providercall WHERE key = %s", [downstream]),
    )


def record(pg: PostgresInstance, caller: Caller) -> dict[str, Any] | None:
    rows = pg.query(
        "SELECT status, lease_expires_at, recovery_attempts, lease_expires_at - now()"
        " FROM django_idempotency_record WHERE account = %s AND key = %s",
        [caller.tenant, caller.key],
    )
    if not rows:
        return None
    status, lease_expires_at, attempts, lease_left = rows[0]
    return {
        "status": status,
        "lease_expires_at": lease_expires_at,
        "recovery_attempts": attempts,
        "lease_left": lease_left,
    }


# Longer than FIRST_REQUEST_SECONDS: a first request sent again after an outage still reaches
# the view before the test gives up on it.
REACHED_SECONDS = 45


def wait_for(path: Path, seconds: float = REACHED_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"the view never reached {path.name}"
        time.sleep(0.01)


# How long a test's first request is sent again while the store is still unreachable.
FIRST_REQUEST_SECONDS = 30


def first_request(
    server: str, path: str, headers: dict[str, str], reached: Path | None = None
) -> Answer:
    """A test's first request, sent again while the claim fails closed before the view runs.

    After an earlier test's outage, a worker's Django pool (``postgres-pool``) may still be
    backing off between reconnection attempts (psycopg-pool doubles its delay after each
    failure, so a long outage on a loaded machine leaves it idle for seconds after the server
    is back). Its request then answers ``503 idempotency_store_unavailable`` and runs nothing:
    the fault a test is about has not happened yet, so the request is sent again, as a client
    would. A ``503`` once the view has started (it touched ``reached``) is the test's answer,
    and every test counts the provider's calls: a second run would show.
    """
    deadline = time.monotonic() + FIRST_REQUEST_SECONDS
    while True:
        answer = request(server, "POST", path, CHARGE, headers, timeout=30)
        before_the_view = reached is None or not reached.exists()
        if not (unavailable(answer) and before_the_view) or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


def send(
    pool: ThreadPoolExecutor, server: str, caller: Caller, directives: str, reached: Path
) -> Future[Answer]:
    return pool.submit(first_request, server, RETRY_PATH, caller.headers(directives), reached)


def terminate(pg: PostgresInstance, pid_file: Path) -> None:
    pid = int(pid_file.read_text())
    assert pg.scalar("SELECT pg_terminate_backend(%s)", [pid]) is True


def assert_recovers_with_one_charge(server: str, pg: PostgresInstance, caller: Caller) -> None:
    """Whatever the fault left (released, or claimed with a lease), a client that keeps
    retrying gets the operation done once, within the lease."""
    state = record(pg, caller)
    if state is not None:
        assert state["status"] == "in_progress"
        assert state["lease_left"].total_seconds() <= 2.5  # the view's lease, not forever
        sleep_past_lease()
    answer = settle(server, RETRY_PATH, caller.headers())
    assert answer.status == 201
    assert not answer.replayed
    assert effects(pg, caller) == (1, 1, 2)  # two calls with one downstream key, one charge
    # Another worker's pool may still be reconnecting after the outage (psycopg-pool backs
    # off between attempts): its 503 fails closed, and the client retries until the replay.
    replay = settle(server, RETRY_PATH, caller.headers())
    assert replay.replayed
    assert replay.body == answer.body
    assert effects(pg, caller) == (1, 1, 2)  # the replay ran nothing


# -- pg_terminate_backend ----------------------------------------------------------------


@pytest.mark.parametrize(
    "stage",
    [
        # During the view's work, after the provider call: the view's next query fails.
        "after-provider",
        # Between the fenced completion UPDATE (status 'completed', not yet committed) and
        # the COMMIT, which fails: nothing of the attempt is kept.
        "completion",
    ],
)
def test_backend_terminated(server, pg, signals, stage):
    """Django drops the broken connection when the view's transaction cannot roll back, so
    the release runs on a fresh connection, and the key is free again. The answer is the
    store's 503 with Retry-After either way, saying that the view ran: a lost connection is
    the store's failure, not the view's (its own query failed, or the completion's commit
    did)."""
    reached, go = signals
    caller = Caller.new()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = send(pool, server, caller, f"pid-{stage}:{reached},wait-{stage}:{go}", reached)
        wait_for(reached)
        terminate(pg, reached)
        go.touch()
        answer = pending.result(timeout=30)
    assert_problem(answer, 503, "idempotency_store_unavailable")
    assert answer.headers["retry-after"]
    assert answer.json()["detail"] == store_unavailable_detail(True)
    assert effects(pg, caller) == (0, 1, 1)
    assert record(pg, caller) is None  # released
    assert_recovers_with_one_charge(server, pg, caller)


# -- restarts and outages ----------------------------------------------------------------


def test_restart_between_the_claim_and_the_retry(server, pg):
    """A worker dies after the provider call, then the database restarts: the claim was
    committed before the view ran, so it survives the restart and the retry recovers it."""
    caller = Caller.new()
    answer = first_request(server, RETRY_PATH, caller.headers("kill-after-provider"))
    assert answer is DISCONNECTED
    pg.restart()
    state = record(pg, caller)
    assert state is not None
    assert state["status"] == "in_progress"
    assert_recovers_with_one_charge(server, pg, caller)
    assert (record(pg, caller) or {}).get("recovery_attempts") == 1


def test_restart_between_a_fail_policy_claim_and_its_retry(server, pg):
    caller = Caller.new()
    headers = caller.headers("kill-after-provider")
    assert first_request(server, FAIL_PATH, headers) is DISCONNECTED
    pg.restart()
    sleep_past_lease()
    assert_problem(settle(server, FAIL_PATH, caller.headers()), 500, "idempotency_outcome_unknown")
    assert effects(pg, caller, "faults.charge-fail") == (0, 1, 1)


def test_database_down_while_a_request_runs(server, pg, signals):
    """While the server is down every protected request fails closed with ``503`` and runs
    nothing; the request caught mid-view, whose connection is lost, answers ``503`` too (its
    view ran) and cannot release its claim, which the retry recovers once the server is back
    and the lease has run out."""
    reached, go = signals
    caller, bystander = Caller.new(), Caller.new()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = send(
            pool,
            server,
            caller,
            f"touch-after-provider:{reached},wait-after-provider:{go}",
            reached,
        )
        wait_for(reached)
        pg.stop()
        for who in (bystander, caller):
            down = request(server, "POST", RETRY_PATH, CHARGE, who.headers())
            assert_problem(down, 503, "idempotency_store_unavailable")
            assert down.headers["retry-after"]
        go.touch()
        answer = pending.result(timeout=30)
    assert_problem(answer, 503, "idempotency_store_unavailable")
    assert answer.json()["detail"] == store_unavailable_detail(True)
    pg.start()
    assert effects(pg, bystander) == (0, 0, 0)
    assert record(pg, bystander) is None
    assert effects(pg, caller) == (0, 1, 1)
    state = record(pg, caller)
    assert state is not None  # the release failed with the server down
    assert state["status"] == "in_progress"
    assert_recovers_with_one_charge(server, pg, caller)


# -- statement timeouts ------------------------------------------------------------------


def test_statement_timeout_in_the_view(server, pg):
    caller = Caller.new()
    directives = "statement-timeout-after-provider:200,pg-sleep-after-provider:5"
    answer = first_request(server, RETRY_PATH, caller.headers(directives))
    assert answer.status == 500
    assert effects(pg, caller) == (0, 1, 1)
    assert record(pg, caller) is None  # the connection survived: the claim was released
    assert_recovers_with_one_charge(server, pg, caller)


# ALTER DATABASE ... SET statement_timeout reaches new sessions only, and a pooler keeps its
# server sessions: through one, these two tests would not set the timeout they test.
direct_sessions_only = pytest.mark.skipif(
    os.environ.get("TEST_DB") in poolers.POOLED_MODES,
    reason="sets statement_timeout per database, which pooled server sessions never pick up",
)


@direct_sessions_only
def test_statement_timeout_in_the_claim_fails_closed(server, pg):
    """A claim that waits on a lock (here the test's lock on the table; in production a long
    transaction or a migration) times out: ``503``, nothing runs, and the replay works once
    the lock is gone. A row lock would not do: a replay reads the record without locking it."""
    caller = Caller.new()
    first = first_request(server, RETRY_PATH, caller.headers())
    assert first.status == 201
    pg.execute(
        f"ALTER DATABASE faults SET statement_timeout = {STATEMENT_TIMEOUT_MS}", dbname="postgres"
    )
    with pg.connect() as locker:
        locker.autocommit = False
        # SHARE conflicts with the ROW EXCLUSIVE lock every claim statement takes.
        locker.execute("LOCK TABLE django_idempotency_record IN SHARE MODE")
        blocked = request(server, "POST", RETRY_PATH, CHARGE, caller.headers())
        assert_problem(blocked, 503, "idempotency_store_unavailable")
        locker.rollback()
    replay = request(server, "POST", RETRY_PATH, CHARGE, caller.headers())
    assert replay.replayed
    assert replay.body == first.body
    assert effects(pg, caller) == (1, 1, 1)


@direct_sessions_only
def test_statement_timeout_in_the_completion(server, pg, signals):
    """The fenced completion UPDATE waits on a row lock and times out: the view's writes
    roll back, the answer is the store's 503, the release times out too, and the claim is
    recovered after its lease."""
    reached, go = signals
    caller = Caller.new()
    pg.execute(
        f"ALTER DATABASE faults SET statement_timeout = {STATEMENT_TIMEOUT_MS}", dbname="postgres"
    )
    with ThreadPoolExecutor(max_workers=1) as pool, pg.connect() as locker:
        pending = send(
            pool, server, caller, f"touch-after-write:{reached},wait-after-write:{go}", reached
        )
        wait_for(reached)
        locker.autocommit = False
        locker.execute(
            "SELECT 1 FROM django_idempotency_record WHERE account = %s FOR UPDATE",
            [caller.tenant],
        )
        go.touch()
        answer = pending.result(timeout=30)
        locker.rollback()
    assert answer.status == 503
    assert answer.json()["code"] == "idempotency_store_unavailable"
    assert effects(pg, caller) == (0, 1, 1)
    state = record(pg, caller)
    assert state is not None
    assert state["status"] == "in_progress"
    pg.execute("ALTER DATABASE faults RESET statement_timeout", dbname="postgres")
    assert_recovers_with_one_charge(server, pg, caller)
