"""The claim of code inside its own transaction: never from the caller's pool, bounded.

``run_once`` (and ``@idempotent_task``) inside a caller's transaction must commit the claim
elsewhere. That claim connection is never drawn from the caller's own pool (a pool sized to
the server's threads would starve: every thread holds its connection and waits for a second
one), goes to ``IDEMPOTENCY["CLAIM_DATABASE"]`` when it is set, and is waited for at most
``CLAIM_TIMEOUT``; past it the caller gets ``StoreUnavailable`` and nothing ran.

The aliases ``pooled`` (PostgreSQL through a Django pool of one connection) and ``claims``
(the same database again) come from ``tests/settings.py``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.backends.signals import connection_created
from django.test import override_settings

from django_idempotency import IdempotencyError, InProgress, StoreUnavailable, run_once
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import postgres_only
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]
on_postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="a Django pool and PgBouncer: PostgreSQL's"
)

IDENTITY = {"account": "consumer:billing", "operation": "invoices.send"}


def effect(calls: list[str], tag: str, using: str) -> str:
    calls.append(tag)
    Charge.objects.using(using).create(account="consumer", amount=1, currency="EUR")
    return tag


@contextmanager
def opened() -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter()

    def count(sender: Any, connection: Any, **kwargs: Any) -> None:
        counts[connection.alias] += 1

    connection_created.connect(count)
    try:
        yield counts
    finally:
        connection_created.disconnect(count)


@pytest.fixture
def pooled() -> Iterator[None]:
    try:
        yield
    finally:
        connections["pooled"].close_pool()  # its connection, kept by the pool, let go


@on_postgresql
def test_inside_a_transaction_the_claim_is_never_drawn_from_the_callers_pool(pooled):
    """The caller holds the only connection of its pool: the claim must not wait for it."""
    calls: list[str] = []
    with override_settings(IDEMPOTENCY={"DATABASE": "pooled"}):
        with transaction.atomic(using="pooled"):
            assert Charge.objects.using("pooled").count() == 0  # the pool's one connection
            result = run_once(effect, calls, "a", "pooled", **IDENTITY, key="k-1")
        again = run_once(effect, calls, "b", "pooled", **IDENTITY, key="k-1")
    assert (result, again) == ("a", "a")
    assert calls == ["a"]
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


def test_claim_database_takes_the_claim_and_is_reused():
    calls: list[str] = []
    assert Charge.objects.count() == 0  # the caller's connection is open from here on
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        with opened() as first, transaction.atomic():
            run_once(effect, calls, "k-1", "default", **IDENTITY, key="k-1")
        with opened() as later:
            for key in ("k-2", "k-3"):
                with transaction.atomic():
                    run_once(effect, calls, key, "default", **IDENTITY, key=key)
    assert calls == ["k-1", "k-2", "k-3"]
    assert first["claims"] >= 1  # the claim went to CLAIM_DATABASE
    assert later["claims"] == 0  # and its connection is reused, as Django reuses its own
    assert first["default"] == later["default"] == 0  # never a second caller's connection
    assert IdempotencyRecord.objects.filter(status=RecordStatus.COMPLETED).count() == 3


def test_a_duplicate_inside_its_own_transaction_is_refused_at_once_through_claim_database():
    inside = threading.Event()
    release = threading.Event()
    outcomes: list[Any] = []

    def first() -> None:
        def slow() -> str:
            inside.set()
            assert release.wait(30)
            return "first"

        try:
            with transaction.atomic():
                outcomes.append(run_once(slow, **IDENTITY, key="dup"))
        finally:
            connections.close_all()

    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        thread = threading.Thread(target=first)
        thread.start()
        assert inside.wait(30)
        try:
            with transaction.atomic(), pytest.raises(InProgress):
                run_once(lambda: "second", **IDENTITY, key="dup")
        finally:
            release.set()
            thread.join(30)
    assert outcomes == ["first"]


@pytest.fixture
def starved_claims_pool() -> Iterator[threading.Event]:
    """``claims`` through a PgBouncer of one server connection, which another session
    holds in a transaction until the event is set."""
    import shutil

    if shutil.which("pgbouncer") is None and not __import__("os").path.exists(
        "/usr/sbin/pgbouncer"
    ):
        pytest.skip("PgBouncer is not installed (CI installs it)")
    from tests.poolers import pgbouncer

    settings = connections["claims"].settings_dict
    upstream = int(connections["default"].settings_dict["PORT"] or 5432)
    done = threading.Event()
    holding = threading.Event()
    with pgbouncer(upstream, pool_size=1) as bouncer:
        original = settings["PORT"]
        connections["claims"].close()
        settings["PORT"] = str(bouncer.port)

        def hold() -> None:
            import psycopg

            with psycopg.connect(
                host="127.0.0.1", port=bouncer.port, user=settings["USER"],
                dbname=settings["NAME"], connect_timeout=5,
            ) as conn:  # fmt: skip
                conn.execute("SELECT 1")  # in a transaction: the one server connection
                holding.set()
                done.wait(60)
                conn.rollback()

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert holding.wait(30)
            yield done
        finally:
            done.set()
            holder.join(30)
            connections["claims"].close()
            settings["PORT"] = original


@on_postgresql
def test_a_claim_connection_that_cannot_be_had_is_store_unavailable_and_nothing_ran(
    starved_claims_pool,
):
    calls: list[str] = []
    timeout = {"CLAIM_DATABASE": "claims", "CLAIM_TIMEOUT": timedelta(seconds=1)}
    with override_settings(IDEMPOTENCY=timeout):
        with transaction.atomic(), pytest.raises(StoreUnavailable) as raised:
            run_once(effect, calls, "a", "default", **IDENTITY, key="k-1")
        assert isinstance(raised.value, IdempotencyError)
        assert calls == []
        assert IdempotencyRecord.objects.count() == 0
        starved_claims_pool.set()  # the pool is free again
        connections["claims"].close()
        with transaction.atomic():
            assert run_once(effect, calls, "b", "default", **IDENTITY, key="k-1") == "b"
    assert calls == ["b"]
    assert Charge.objects.count() == 1
