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

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connection, connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import IdempotencyError, InProgress, StoreUnavailable, _autonomous, run_once
from django_idempotency._store import ClaimResult, RecordState
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import completed, opened, postgres_only
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
        close_claims()
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
            close_claims()
            settings["PORT"] = original


def close_claims() -> None:
    """Close ``claims``, and its Django pool where it has one (TEST_DB=postgres-pool), so
    that its next connection is made with its settings as they are then."""
    claims = connections["claims"]
    claims.close()
    if getattr(claims, "pool", None) is not None:
        claims.close_pool()


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


LATE = {"CLAIM_DATABASE": "claims", "CLAIM_TIMEOUT": timedelta(seconds=1)}


def refused_late(starved: threading.Event, calls: list[str], key: str) -> None:
    """``run_once`` inside a transaction, under ``LATE``, while ``claims`` is starved: the
    watchdog cancels at 1 s (the pooler ignores it for a queued client) and closes the
    connection at 2 s, and the pool is freed in between. It must be StoreUnavailable, the
    claim connection replaced (not probed through the pooler's queue), and nothing run."""
    freed = threading.Timer(1.4, starved.set)
    freed.start()
    try:
        with transaction.atomic(), pytest.raises(StoreUnavailable):
            run_once(effect, calls, "a", "default", **IDENTITY, key=key)
    finally:
        freed.cancel()
    assert calls == []
    assert connections["claims"].connection is None


@on_postgresql
def test_a_claim_that_reaches_the_database_after_claim_timeout_writes_nothing(
    starved_claims_pool,
):
    """The pooler hands the claim a server connection after CLAIM_TIMEOUT, before the
    watchdog closes its connection: the late statement must write nothing. (Had it
    committed, the watchdog's close could cut its answer, and the caller would be told
    StoreUnavailable with a claim left behind that nobody owns.)"""
    calls: list[str] = []
    with override_settings(IDEMPOTENCY=LATE):
        refused_late(starved_claims_pool, calls, "late-1")
        assert IdempotencyRecord.objects.count() == 0
        with transaction.atomic():
            assert run_once(effect, calls, "b", "default", **IDENTITY, key="late-1") == "b"
    assert calls == ["b"]
    assert Charge.objects.count() == 1


@on_postgresql
def test_a_late_claim_never_takes_over_the_expired_record_in_its_way(starved_claims_pool):
    """The same late claim meets an expired record of the key: it must not replace it after
    CLAIM_TIMEOUT either (it would run the work late, or leave a takeover nobody owns)."""
    calls: list[str] = []
    expired = completed(
        expires_in=-timedelta(minutes=1), now=timezone.now(), **IDENTITY, key="late-2"
    )
    with override_settings(IDEMPOTENCY=LATE):
        refused_late(starved_claims_pool, calls, "late-2")
        record = IdempotencyRecord.objects.get()
        assert (record.pk, record.lease_token, record.expires_at) == (
            expired.pk,
            expired.lease_token,
            expired.expires_at,
        )
        with transaction.atomic():
            assert run_once(effect, calls, "b", "default", **IDENTITY, key="late-2") == "b"
    assert calls == ["b"]


@on_postgresql
@pytest.mark.parametrize("in_the_way", [False, True])
def test_a_guarded_claim_past_its_deadline_writes_nothing_and_says_so(in_the_way, monkeypatch):
    """Whatever the app's clock says: the statement itself tells a refusal from a record
    that vanished (a server clock ahead of the app's is never read as a vanished record)."""
    from django_idempotency._context import Operation
    from django_idempotency._store import claiming

    if in_the_way:
        completed(expires_in=timedelta(hours=1), now=timezone.now(), **IDENTITY, key="g-1")
    op = Operation(
        "default", IDENTITY["account"], IDENTITY["operation"], "g-1", "a" * 64, "v1", "retry",
        timedelta(seconds=60), timedelta(hours=1),
    )  # fmt: skip
    past = datetime.now(dt_timezone.utc) - timedelta(milliseconds=1)
    now = timezone.now()
    # The app's clock an hour behind the server's: only the server can tell it is too late.
    monkeypatch.setattr(timezone, "now", lambda: now - timedelta(hours=1))
    if in_the_way:
        found = claiming._insert_or_existing(op, now, past)
        assert isinstance(found, RecordState)
        assert found.status == RecordStatus.COMPLETED
    else:
        with pytest.raises(OperationalError, match="after CLAIM_TIMEOUT"):
            claiming._insert_or_existing(op, now, past)
    monkeypatch.undo()
    assert IdempotencyRecord.objects.count() == (1 if in_the_way else 0)
    # Before its deadline the same statement claims as ever.
    soon = datetime.now(dt_timezone.utc) + timedelta(seconds=30)
    found = claiming._insert_or_existing(op, timezone.now(), soon)
    assert isinstance(found, ClaimResult if not in_the_way else RecordState)


@on_postgresql
@pytest.mark.parametrize("audit", [False, True])
def test_a_late_takeover_the_servers_guard_refuses_is_store_unavailable_and_leaves_no_copy(
    audit, monkeypatch
):
    """The app's clock an hour behind the server's: the app sends the takeover and the
    server's guard refuses it. The statement itself says so: the claim is StoreUnavailable
    at once (never a record read as held until CLAIM_TIMEOUT, then as one that vanished),
    and with the audit trail the copy of the expired record made before it goes too."""
    from django_idempotency import _autonomous
    from django_idempotency._context import Operation
    from django_idempotency._store import claiming
    from django_idempotency.models import IdempotencyAuditRecord

    class Behind(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) - timedelta(hours=1)

    calls: list[str] = []
    expired = completed(
        expires_in=-timedelta(minutes=1), now=timezone.now(), **IDENTITY, key="audit-1"
    )
    looks: list[object] = []
    fetch = claiming.fetch

    def counted(op: Operation) -> RecordState | None:
        looks.append(op)
        return fetch(op)

    monkeypatch.setattr(claiming, "fetch", counted)
    monkeypatch.setattr(_autonomous, "datetime", Behind)
    monkeypatch.setattr(claiming, "datetime", Behind)
    late = override_settings(IDEMPOTENCY={**LATE, "AUDIT": audit})
    with late, transaction.atomic(), pytest.raises(StoreUnavailable, match="CLAIM_TIMEOUT"):
        run_once(effect, calls, "a", "default", **IDENTITY, key="audit-1")
    assert calls == []
    assert looks == []  # refused by the statement, not read again as a record in the way
    assert IdempotencyAuditRecord.objects.count() == 0
    assert IdempotencyRecord.objects.get().lease_token == expired.lease_token


@on_postgresql
def test_a_claim_inside_a_transaction_without_use_tz():
    calls: list[str] = []
    try:
        with override_settings(USE_TZ=False, IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
            with transaction.atomic():
                assert run_once(effect, calls, "a", "default", **IDENTITY, key="naive") == "a"
            with transaction.atomic():
                assert run_once(effect, calls, "b", "default", **IDENTITY, key="naive") == "a"
    finally:
        close_claims()  # its connections (and a Django pool's) were set up without USE_TZ
    assert calls == ["a"]


# -- a claim never waits on a lock another attempt holds ------------------------------------


def test_a_takeover_never_waits_for_an_owner_completing_inside_its_callers_transaction():
    """The first attempt completed inside its caller's transaction, which stays open past its
    lease: a retry meets a stale lease whose row that transaction holds. It is refused at
    once (InProgress), never made to wait for the caller to commit."""
    done = threading.Event()
    release = threading.Event()
    calls: list[str] = []

    def first() -> None:
        try:
            with transaction.atomic():
                run_once(effect, calls, "A", "default", **IDENTITY, key="w-1", lease=1)
                done.set()
                assert release.wait(30)
        finally:
            connections.close_all()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert done.wait(30)
        time.sleep(1.2)  # the lease runs out while the caller's transaction is still open
        with pytest.raises(InProgress):
            run_once(effect, calls, "B", "default", **IDENTITY, key="w-1", lease=1)
    finally:
        release.set()
        thread.join(30)
    assert calls == ["A"]
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


@on_postgresql
def test_a_late_watchdog_never_cancels_the_next_claims_statement():
    """The watchdog of a claim that outlasted CLAIM_TIMEOUT fires while the next claim-side
    block already runs on the same connection: it must leave that block alone."""
    import logging

    from django.db import DatabaseError

    from django_idempotency import _autonomous

    go = threading.Event()

    class Slow(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "CLAIM_TIMEOUT" in record.getMessage():
                go.wait(5)

    handler = Slow(logging.WARNING)
    logger = logging.getLogger("django_idempotency")
    logger.addHandler(handler)
    outcome: dict[str, str] = {}
    bound = override_settings(IDEMPOTENCY={"CLAIM_TIMEOUT": timedelta(milliseconds=300)})
    try:
        with bound, transaction.atomic():
            Charge.objects.count()  # the caller's transaction
            try:
                with _autonomous.claiming("default"), connection.cursor() as cursor:
                    cursor.execute("SELECT pg_sleep(0.4)")
                outcome["first"] = "finished"
            except DatabaseError as exc:
                outcome["first"] = type(exc).__name__
            threading.Timer(0.05, go.set).start()
            try:
                with _autonomous.claiming("default"), connection.cursor() as cursor:
                    cursor.execute("SELECT pg_sleep(0.15)")
                outcome["second"] = "finished"
            except DatabaseError as exc:
                outcome["second"] = f"{type(exc).__name__}: {exc}"
    finally:
        logger.removeHandler(handler)
        go.set()
    assert outcome["first"] == "OperationalError"  # cancelled: it outlasted its bound
    assert outcome["second"] == "finished", outcome


@pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB's and MySQL's bounds")
@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_on_mariadb_a_claim_refused_at_claim_timeout_leaves_nothing_behind(policy):
    """A claim that waits for a lock (a purge deleting the expired record in its way) past
    CLAIM_TIMEOUT is refused, and the server gives its statement up too: it does not commit
    the claim after the caller was told that nothing ran. The first claim, inside a
    transaction too, opens the claim connection under the default bound: a bound changed
    since is the one that holds."""
    calls: list[str] = []
    with transaction.atomic():
        assert run_once(effect, calls, "first", "default", **IDENTITY, key="m-1", ttl=60) == "first"
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    record_id = IdempotencyRecord.objects.get().pk
    locked = threading.Event()

    def purge_batch() -> None:
        try:
            with transaction.atomic(using="provider"):
                IdempotencyRecord.objects.using("provider").filter(pk=record_id).delete()
                locked.set()
                time.sleep(4)
        finally:
            connections["provider"].close()

    purger = threading.Thread(target=purge_batch)
    purger.start()
    assert locked.wait(10)
    bound = override_settings(IDEMPOTENCY={"CLAIM_TIMEOUT": timedelta(seconds=1)})
    with bound, transaction.atomic():
        IdempotencyRecord.objects.count()  # the caller's transaction
        with pytest.raises(StoreUnavailable):
            run_once(effect, calls, "second", "default", **IDENTITY, key="m-1", recovery=policy)
        transaction.set_rollback(True)
    purger.join(15)
    time.sleep(0.5)
    assert IdempotencyRecord.objects.count() == 0  # the purge's delete won; no stray claim
    assert run_once(effect, calls, "third", "default", **IDENTITY, key="m-1") == "third"
    assert calls == ["first", "third"]


@contextmanager
def init_command(command: str | None) -> Iterator[None]:
    """The caller's connection with ``command`` as its OPTIONS["init_command"] (or none),
    its claim connection made afresh from it."""
    options = connection.settings_dict["OPTIONS"]
    before = options.get("init_command")
    options.pop("init_command", None)
    if command is not None:
        options["init_command"] = command
    forget_claim_connection()
    try:
        yield
    finally:
        options.pop("init_command", None)
        if before is not None:
            options["init_command"] = before
        forget_claim_connection()


def forget_claim_connection() -> None:
    second = getattr(connection, _autonomous._ATTRIBUTE, None)
    if second is not None:
        second.close()
        setattr(connection, _autonomous._ATTRIBUTE, None)


@pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB's and MySQL's lock wait")
@pytest.mark.parametrize(
    ("command", "kept"),
    [
        (None, None),
        ("SET sql_mode = 'STRICT_ALL_TABLES'", ("@@SESSION.sql_mode", "STRICT_ALL_TABLES")),
        ("set\nsql_mode = 'STRICT_ALL_TABLES';", ("@@SESSION.sql_mode", "STRICT_ALL_TABLES")),
        (
            "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
            ("@@SESSION.tx_isolation", "READ-COMMITTED"),
        ),
        ("SELECT 1", None),
        ("DO 1", None),
    ],
)
def test_on_mariadb_the_claim_connection_bounds_its_lock_wait_whatever_the_init_command(
    command, kept
):
    """The server gives a claim's lock wait up at CLAIM_TIMEOUT whatever the project's own
    init_command is (a SET of its own, a statement of another kind), and that command runs
    on the claim connection as written."""
    bound = override_settings(IDEMPOTENCY={"CLAIM_TIMEOUT": timedelta(seconds=3)})
    with init_command(command), bound, transaction.atomic():
        IdempotencyRecord.objects.count()  # the caller's transaction
        with _autonomous.claiming("default"):
            claims = connections["default"]
            assert claims is not connection  # the claim connection
            with claims.cursor() as cursor:
                cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
                assert cursor.fetchone()[0] == 3
                if kept is not None:
                    cursor.execute(f"SELECT {kept[0]}")
                    assert kept[1] in cursor.fetchone()[0]


@pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB's and MySQL's lock wait")
def test_on_mariadb_claim_database_bounds_its_lock_wait_too():
    """CLAIM_DATABASE is the project's own alias: the claim bounds the server's lock wait
    on it as on a claim connection of its own, and follows CLAIM_TIMEOUT when it changes."""
    for seconds in (3, 4):
        bound = {"CLAIM_DATABASE": "claims", "CLAIM_TIMEOUT": timedelta(seconds=seconds)}
        with override_settings(IDEMPOTENCY=bound), transaction.atomic():
            IdempotencyRecord.objects.count()  # the caller's transaction
            with _autonomous.claiming("default"), connections["default"].cursor() as cursor:
                cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
                assert cursor.fetchone()[0] == seconds
    connections["claims"].close()


@pytest.fixture
def autocommit_off() -> Iterator[None]:
    """``DATABASES["default"]["AUTOCOMMIT"] = False``: the project manages its transactions
    itself, every connection of that alias in one from its first statement."""
    connection.close()
    connection.settings_dict["AUTOCOMMIT"] = False
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["AUTOCOMMIT"] = True


@pytest.mark.parametrize("opened_first", [False, True], ids=["unopened", "opened"])
def test_with_autocommit_off_the_claim_commits_at_once_and_the_work_with_the_caller(
    autocommit_off, opened_first
):
    """The caller's connection is in its transaction from its first statement: the claim
    goes to a connection of its own, in autocommit whatever the alias says, and the work
    and the completion commit when the caller commits. Before, a connection not yet opened
    was taken for one in autocommit (the claim, on it, committed only with the work: no
    other connection saw it while the body ran), and the claim connection took AUTOCOMMIT
    off from the caller's entry (no claim ever committed: each call ran its body, lost its
    lease, and left nothing for a retry to find)."""
    calls: list[str] = []
    seen: list[bool] = []
    key = f"ac-{opened_first}"

    def body(tag: str) -> str:
        calls.append(tag)
        # Another connection sees the claim while the body runs: it committed at once.
        seen.append(IdempotencyRecord.objects.using("provider").filter(key=key).exists())
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        return tag

    outcomes = []
    for tag in ("a", "b"):
        if opened_first:
            Charge.objects.count()
        outcomes.append(run_once(body, tag, **IDENTITY, key=key))
        connection.commit()
    assert outcomes == ["a", "a"]
    assert calls == ["a"]
    assert seen == [True]
    # As committed, read on another connection.
    records = IdempotencyRecord.objects.using("provider").filter(key=key)
    assert list(records.values_list("status", flat=True)) == [RecordStatus.COMPLETED]
    assert Charge.objects.using("provider").count() == 1


def test_a_claim_database_with_autocommit_off_is_refused_before_anything_runs():
    """Check E038 reports it; a claim that comes all the same is refused, its connection not
    yet opened too (before, its claim never committed: the body ran and lost its lease)."""
    calls: list[str] = []
    claims = connections["claims"]
    claims.close()
    claims.settings_dict["AUTOCOMMIT"] = False
    try:
        with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}), transaction.atomic():
            Charge.objects.count()  # the caller's transaction is under way
            with pytest.raises(ImproperlyConfigured, match="CLAIM_DATABASE"):
                run_once(effect, calls, "a", "default", **IDENTITY, key="k-1")
    finally:
        claims.close()
        claims.settings_dict["AUTOCOMMIT"] = True
    assert calls == []
    assert IdempotencyRecord.objects.count() == 0


class FreezingProxy:
    """A TCP proxy in front of the database server that, once frozen, accepts new
    connections and never answers them (a server that stopped answering, a network that
    drops packets), while the connections made before keep going."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.frozen = threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[Any] = [self.listener]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.sockets.append(client)
            if self.frozen.is_set():
                continue  # held open, never answered
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.sockets.append(server)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self.pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def pipe(source: Any, target: Any) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            FreezingProxy.end(target)

    @staticmethod
    def end(sock: Any) -> None:
        # shutdown() first: a close() alone leaves the socket open while another thread
        # is still blocked reading it, and the server's session with it.
        for step in (lambda: sock.shutdown(socket.SHUT_RDWR), sock.close):
            with contextlib.suppress(OSError):
                step()

    def close(self) -> None:
        for sock in self.sockets:
            self.end(sock)


@on_postgresql
def test_the_claims_own_connection_waits_to_connect_no_longer_than_claim_timeout():
    """The project's connect_timeout is longer than CLAIM_TIMEOUT: the claim's own
    connection (made inside the caller's transaction) is bounded by the shorter one, as its
    statements are. Before, the project's 10 s were kept for it."""
    alias = connections["claims"]
    saved = dict(alias.settings_dict)
    proxy = FreezingProxy(int(connections["default"].settings_dict["PORT"] or 5432))
    close_claims()
    alias.settings_dict.update(
        HOST="127.0.0.1",
        PORT=str(proxy.port),
        OPTIONS={**saved["OPTIONS"], "connect_timeout": 10},
    )
    calls: list[str] = []
    bounded = {"DATABASE": "claims", "CLAIM_TIMEOUT": timedelta(seconds=2)}
    try:
        with override_settings(IDEMPOTENCY=bounded), transaction.atomic(using="claims"):
            Charge.objects.using("claims").count()  # the caller's connection, through the proxy
            proxy.frozen.set()
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                run_once(effect, calls, "a", "claims", **IDENTITY, key="k-1")
            waited = time.monotonic() - started
    finally:
        close_claims()
        alias.settings_dict.clear()
        alias.settings_dict.update(saved)
        proxy.close()
    assert calls == []
    assert IdempotencyRecord.objects.count() == 0
    assert waited < 6, f"the claim waited {waited:.1f} s for its connection"
