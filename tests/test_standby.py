"""PostgreSQL with a streaming standby: reads routed to a lagging replica, and failovers.

Each test starts a private primary (tests/pg_instance.py) and a standby made from it by
``pg_basebackup -R``, on free ports, never the shared server on 5432. The app runs in a
gunicorn. The fake provider's ledger lives on the shared server (a database of this run):
like an external system's, it survives the failover, so that a second run of an operation
is counted even when the database that ran it is gone.

- A project router sends every read to the standby, which applies WAL 2 s late
  (``recovery_min_apply_delay``): the package reads its records on the primary (its alias),
  so every retry replays and nothing runs again.
- Failover: the primary killed mid-burst, the standby promoted, a new app server on it,
  every key retried. Half-way, the primary is cut off from its standby (replication
  refused), so that the last claims and completions cannot reach it: with synchronous
  replication their commits wait and are never acknowledged, and no key runs twice beyond
  its policy ("fail": never); with asynchronous replication they are acknowledged, lost in
  the failover, and run again.
  ``check --database`` warns of the second (W020), not of the first.

Run by ``make test-standby`` (``RUN_STANDBY=1``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from tests import pg_instance
from tests.helpers import FAIL_PATH, FAULTS_CHARGE, RETRY_PATH, Caller, settle, wait_until
from tests.live import ROOT, Answer, gunicorn, migrate, request

pytestmark = [
    pytest.mark.servers,  # two private PostgreSQL servers and a gunicorn
    pytest.mark.skipif(
        os.environ.get("RUN_STANDBY") != "1", reason="make test-standby runs it (RUN_STANDBY=1)"
    ),
]

SHARED = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "autocommit": True}


@pytest.fixture(scope="module")
def ledger() -> Iterator[dict[str, str]]:
    """The provider's database on the shared server; the env that points the app at it."""
    name = f"standby_ledger_{os.getpid()}"
    with psycopg.connect(dbname="postgres", **SHARED) as conn:  # type: ignore[arg-type]
        conn.execute(f"CREATE DATABASE {name}")
    env = {"TEST_PROVIDER_NAME": name, "TEST_PROVIDER_PORT": "5432"}
    try:
        migrate({"TEST_DB": "postgres", "DB_NAME": name, "PGPORT": "5432"}, 120)
        yield env
    finally:
        with psycopg.connect(dbname="postgres", **SHARED) as conn:  # type: ignore[arg-type]
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def provider_calls(ledger: dict[str, str], caller: Caller, operation: str) -> int:
    downstream = caller.downstream_key(operation)
    with psycopg.connect(dbname=ledger["TEST_PROVIDER_NAME"], **SHARED) as conn:  # type: ignore[arg-type]
        row = conn.execute(
            "SELECT count(*) FROM testapp_providercall WHERE key = %s", [downstream]
        ).fetchone()
    assert row is not None
    return int(row[0])


@contextmanager
def primary_and_standby(
    delay: str = "0", synchronous: bool = False
) -> Iterator[tuple[pg_instance.PostgresInstance, pg_instance.Standby]]:
    primary = pg_instance.PostgresInstance()
    standby: pg_instance.Standby | None = None
    try:
        primary.init()
        primary.migrate()
        standby = pg_instance.Standby(primary, delay)
        standby.init()
        if synchronous:
            primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'", dbname="postgres")
            primary.execute("SELECT pg_reload_conf()", dbname="postgres")
        deadline = time.monotonic() + 30
        while not primary.scalar(
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        ):
            assert time.monotonic() < deadline, "the standby never streamed"
            time.sleep(0.1)
        yield primary, standby
    finally:
        if standby is not None:
            standby.destroy()
        primary.destroy()


def cut_off(primary: pg_instance.PostgresInstance) -> None:
    """A network partition between the primary and its standby: replication connections
    refused from now on (pg_hba.conf), the WAL sender ended. The primary runs on."""
    hba = primary.data / "pg_hba.conf"
    hba.write_text("host replication all all reject\n" + hba.read_text())
    primary.execute("SELECT pg_reload_conf()", dbname="postgres")
    primary.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_replication", dbname="postgres")


def records_on(instance: pg_instance.PostgresInstance, caller: Caller) -> int:
    return int(
        instance.scalar(
            "SELECT count(*) FROM django_idempotency_record WHERE account = %s", [caller.tenant]
        )
    )


def charges_on(instance: pg_instance.PostgresInstance, caller: Caller) -> int:
    return int(
        instance.scalar("SELECT count(*) FROM testapp_charge WHERE account = %s", [caller.tenant])
    )


# -- reads routed to a lagging replica ------------------------------------------------------


def test_reads_routed_to_a_lagging_replica_never_reach_the_records(ledger):
    """Each key: the original, then at once a retry and a burst of 8 while the replica is
    still 2 s behind. Every retry replays the original byte for byte; one run per key."""
    keys = 12
    with primary_and_standby(delay="2s") as (primary, standby):
        env = {**primary.server_env(), **ledger, "TEST_REPLICA_PORT": str(standby.port)}
        with gunicorn(workers=2, threads=4, extra_env=env) as url:
            callers = [Caller.new() for _ in range(keys)]
            lagging = 0
            with ThreadPoolExecutor(max_workers=8) as pool:
                for caller in callers:
                    first = request(url, "POST", RETRY_PATH, FAULTS_CHARGE, caller.headers())
                    assert first.status == 201, first.body[:300]
                    again = list(
                        pool.map(
                            lambda _, c=caller: request(
                                url, "POST", RETRY_PATH, FAULTS_CHARGE, c.headers()
                            ),
                            range(8),
                        )
                    )
                    lagging += records_on(standby, caller) == 0
                    for answer in again:
                        assert answer.status == 201, answer.body[:300]
                        assert answer.headers["idempotent-replayed"] == "true"
                        assert answer.body == first.body
        # The replica had not applied the original when its retries were answered.
        assert lagging == keys
        for caller in callers:
            assert charges_on(primary, caller) == 1
            assert provider_calls(ledger, caller, "faults.charge") == 1


# -- failover ----------------------------------------------------------------------------


def check_output(env: dict[str, str]) -> str:
    """``manage.py check --database default`` against the server ``env`` names."""
    done = subprocess.run(
        [sys.executable, "-m", "django", "check", "--database", "default"],
        cwd=ROOT,
        env={
            **os.environ,
            **env,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": str(ROOT),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr


def failover(ledger: dict[str, str], synchronous: bool) -> dict[str, Any]:
    """24 fail-policy keys sent 4 at a time: the first half answered; the standby's WAL
    receiver paused; the second half sent and the primary killed 2 s after it reached the
    primary; the standby promoted and every key settled through a new app server on it."""
    keys = 24
    callers = [Caller.new() for _ in range(keys)]
    answered: dict[Caller, Answer] = {}
    at: dict[Caller, float] = {}
    with primary_and_standby(synchronous=synchronous) as (primary, standby):
        warned = "django_idempotency.W020" in check_output({**primary.server_env(), **ledger})
        env = {**primary.server_env(), **ledger}
        with gunicorn(workers=2, threads=2, extra_env=env) as url:
            pool = ThreadPoolExecutor(max_workers=4)
            first = {c: pool.submit(timed, url, c) for c in callers[: keys // 2]}
            for caller, future in first.items():
                answered[caller], at[caller] = future.result(timeout=30)
            cut_off(primary)
            paused_at = time.monotonic()
            second = {c: pool.submit(timed, url, c) for c in callers[keys // 2 :]}
            # The second half reached the primary (a loaded machine may take longer than the
            # 2 s to send it, and a failover before it would show no window), then 2 s more.
            wait_until(lambda: reached(primary, second), "the second half to reach the primary", 30)
            time.sleep(2)
            primary.crash()
            for caller, future in second.items():
                answered[caller], at[caller] = future.result(timeout=30)
            pool.shutdown()
        standby.promote()
        env = {**standby.server_env(), **ledger}
        with gunicorn(workers=2, threads=2, extra_env=env) as url:
            final = {c: settle(url, FAIL_PATH, c.headers(), seconds=60) for c in callers}
        calls = {c: provider_calls(ledger, c, "faults.charge-fail") for c in callers}
        charges = {c: charges_on(standby, c) for c in callers}
    acknowledged = {c for c, a in answered.items() if a.status == 201}
    # Acknowledged well before the standby stopped receiving: outside any window.
    early = {c for c in acknowledged if at[c] < paused_at - 0.5}
    return {
        "early": early,
        "callers": callers,
        "answered": answered,
        "acknowledged": acknowledged,
        "final": final,
        "calls": calls,
        "charges": charges,
        "warned": warned,
    }


def reached(primary: pg_instance.PostgresInstance, sent: dict[Caller, Future[Any]]) -> bool:
    """Whether a request of ``sent`` was answered, or its commit waits for the standby."""
    if any(future.done() for future in sent.values()):
        return True
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
    return bool(primary.scalar(waiting))


def timed(url: str, caller: Caller) -> tuple[Answer, float]:
    """The original of ``caller``, and when its answer came."""
    answer = request(url, "POST", FAIL_PATH, FAULTS_CHARGE, caller.headers(), timeout=8)
    return answer, time.monotonic()


def outcome(answer: Answer) -> str:
    if answer.status == 201:
        return "201"
    assert answer.status == 500, answer.body[:300]
    assert answer.json()["code"] == "idempotency_outcome_unknown"
    return "unknown"


def test_failover_with_synchronous_replication(ledger):
    """No key runs twice (recovery "fail"); every outcome acknowledged before the failover
    is replayed after it; the commits the standby could not confirm were never answered."""
    seen = failover(ledger, synchronous=True)
    assert not seen["warned"]
    for caller in seen["callers"]:
        assert seen["calls"][caller] <= 1, caller
        assert seen["charges"][caller] <= 1, caller
        result = outcome(seen["final"][caller])
        if caller in seen["acknowledged"]:
            assert result == "201"
            assert seen["final"][caller].body == seen["answered"][caller].body
            assert seen["charges"][caller] == 1
    late = [c for c in seen["callers"][len(seen["callers"]) // 2 :] if c in seen["acknowledged"]]
    assert late == [], "a commit was acknowledged that the paused standby never received"
    print(
        f"\nsynchronous: {len(seen['acknowledged'])} of {len(seen['callers'])} acknowledged,"
        " all replayed after the failover; ran twice 0"
    )


def test_failover_with_asynchronous_replication(ledger):
    """The window: what the primary acknowledged after the standby stopped receiving is
    lost in the failover, and those keys run again. check --database warned of it."""
    seen = failover(ledger, synchronous=False)
    assert seen["warned"]
    twice = {c for c in seen["callers"] if seen["calls"][c] == 2}
    lost = {c for c in seen["acknowledged"] if seen["final"][c].body != seen["answered"][c].body}
    assert twice, "the failover lost no acknowledged claim: the window was not shown"
    assert not twice & seen["early"], "a claim acknowledged long before the failover was lost"
    for caller in seen["callers"]:
        assert seen["calls"][caller] <= 2
        assert seen["charges"][caller] <= 1
    print(
        f"\nasynchronous: {len(seen['acknowledged'])} of {len(seen['callers'])} acknowledged,"
        f" {len(lost)} of them lost in the failover; ran twice {len(twice)}"
    )
