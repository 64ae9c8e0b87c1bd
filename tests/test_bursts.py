"""Bursts of distinct keys through a pooler, in every configuration of the connections table.

A real server (gunicorn, 2 workers x 4 threads) reaches PostgreSQL either through PgBouncer
in transaction mode with fewer server connections than threads (3 for 8), or through
Django's pool sized to each worker's threads (4). Sixteen requests with distinct keys start
at once. Every answer is listed in the failure message; the effects (``Charge`` rows) are
counted against the ``201`` answers, and no record may be left in progress.

Before the fix the ``ATOMIC_REQUESTS`` configurations held a connection and waited for a
second one: through PgBouncer 46 s and then 503 x9, 500 x5, 201 x2; through Django's pool
503 after its timeout. ``run_once`` inside the request's transaction still needs a claim
connection: through ``CLAIM_DATABASE`` (a PgBouncer pool of its own) every request runs;
without it, through the one starved pool, a claim waits at most ``CLAIM_TIMEOUT`` and is
refused (``503``, nothing ran), never a ``500``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key
from tests.live import Answer, basic_auth, gunicorn, request
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.servers,  # gunicorn, through a PgBouncer or a Django pool of its own
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.skipif(
        settings.TEST_DB != "postgres",
        reason="PostgreSQL directly: the bursts start a PgBouncer and a Django pool of their own",
    ),
]

WORKERS, THREADS, KEYS = 2, 4, 16
BOUNCER_POOL = 3  # server connections for WORKERS x THREADS = 8 threads
CLAIMS_POOL = 8
CLAIMS_NAME = "claims_pool"


def config(name: str, path: str, atomic: bool, idempotency: str = "{}", **marks: Any) -> Any:
    needs = []
    if path.startswith(("/peek/mixin", "/peek/api-view")) and not settings.HAS_DRF:
        needs.append(pytest.mark.skip(reason="needs djangorestframework"))
    if path.startswith("/peek/ninja") and not settings.HAS_NINJA:
        needs.append(pytest.mark.skip(reason="needs django-ninja"))
    return pytest.param(path, atomic, idempotency, id=name, marks=needs)


# The configurations of docs/deployment.md's connections table.
CONFIGS = [
    config("decorator", "/peek/decorator/", atomic=False),
    config("decorator-atomic", "/peek/decorator/", atomic=True),
    config("cbv-method-atomic", "/peek/cbv/", atomic=True),
    config("mixin-atomic", "/peek/mixin/", atomic=True),
    config("api-view-atomic", "/peek/api-view/", atomic=True),
    config("ninja-atomic", "/peek/ninja/sync", atomic=True),
    config("ninja-async-atomic", "/peek/ninja/async", atomic=True),
    config("run-once-claim-database", "/peek/run-once/", True, "{'CLAIM_DATABASE': 'claims'}"),
    config("run-once-own-claim-connection", "/peek/run-once/", True, "{'CLAIM_TIMEOUT': 2}"),
]


@contextmanager
def server(pooler: str, atomic: bool, idempotency: str, prepare: bool = False) -> Iterator[str]:
    """A gunicorn on the test database through ``pooler``; yields its URL."""
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.settings_from_env",
        "TEST_IDEMPOTENCY": idempotency,
        "TEST_ATOMIC_REQUESTS": "1" if atomic else "0",
    }
    # Prepared statements only where asked for: not inherited from a run that prepares its
    # own (make test-pg16), which through PgBouncer 1.18 would refuse some first statements.
    env["TEST_DB_PREPARE"] = "0" if prepare else ""
    with ExitStack() as stack:
        if pooler == "pgbouncer":
            import shutil

            if shutil.which("pgbouncer") is None and not __import__("os").path.exists(
                "/usr/sbin/pgbouncer"
            ):
                pytest.skip("PgBouncer is not installed (CI installs it)")
            from tests.poolers import pgbouncer

            upstream = int(connection.settings_dict["PORT"] or 5432)
            pools = {CLAIMS_NAME: (connection.settings_dict["NAME"], CLAIMS_POOL)}
            # PgBouncer's own default wait for a server connection (120 s), not the 5 s of
            # the fault runs: in the starved configuration a view's own statement may queue
            # behind claims that wait out CLAIM_TIMEOUT, and its failing would be the
            # pooler's 500, not the product's.
            bouncer = stack.enter_context(
                pgbouncer(upstream, pool_size=BOUNCER_POOL, pools=pools, query_wait_timeout=120)
            )
            env.update(TEST_DB="pgbouncer", PGPORT=str(bouncer.port), TEST_CLAIMS_NAME=CLAIMS_NAME)
        else:
            env.update(TEST_DB="postgres-pool", TEST_POOL_MAX=str(THREADS))
        yield stack.enter_context(gunicorn(workers=WORKERS, threads=THREADS, extra_env=env))


class Servers:
    """The servers of one module's bursts, one per pooler at a time: a test whose
    configuration is the one of the previous test through that pooler gets its server
    again (the tests run in the order of ``CONFIGS``, where six in a row share one), so the
    eighteen bursts start eight servers rather than eighteen. Each server's first burst
    meets empty pools, the later ones pools the earlier bursts filled: both run into the
    same starvation, sixteen requests for eight threads and three (or four) connections: a
    view under ``ATOMIC_REQUESTS`` holds one of them for its transaction whether the pool
    was full or empty when it came. A failed burst stops its server."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[tuple[bool, str], ExitStack, str]] = {}

    def url(self, pooler: str, atomic: bool, idempotency: str) -> str:
        wanted = (atomic, idempotency)
        if pooler in self.running and self.running[pooler][0] == wanted:
            return self.running[pooler][2]
        self.stop(pooler)
        stack = ExitStack()
        url = stack.enter_context(server(pooler, atomic, idempotency))
        self.running[pooler] = (wanted, stack, url)
        return url

    def stop(self, pooler: str) -> None:
        """Stop the server through ``pooler``: the next test starts a new one."""
        if pooler in self.running:
            _, stack, _ = self.running.pop(pooler)
            stack.close()

    def close(self) -> None:
        for pooler in list(self.running):
            self.stop(pooler)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    running = Servers()
    try:
        yield running
    finally:
        running.close()


def headers(user: Any, path: str) -> dict[str, str]:
    from tests.helpers import session_headers

    auth = (
        basic_auth(user.username)
        if path.startswith(("/peek/mixin", "/peek/api-view", "/peek/ninja"))
        else session_headers(user)
    )
    return {**auth, "X-Burst": "1"}


def burst(url: str, path: str, base: dict[str, str]) -> tuple[list[Answer], float]:
    """KEYS requests with distinct keys, released at once; their answers and the seconds
    the burst took."""
    barrier = threading.Barrier(KEYS, timeout=30)

    def one(_: int) -> Answer:
        barrier.wait()
        return request(url, "POST", path, {}, {**base, "Idempotency-Key": new_key()}, timeout=60)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=KEYS) as pool:
        answers = list(pool.map(one, range(KEYS)))
    return answers, time.monotonic() - started


def judged(answers: list[Answer], allowed: set[int]) -> str:
    statuses = Counter(a.status for a in answers)
    listing = ", ".join(f"{status} x{n}" for status, n in sorted(statuses.items()))
    assert set(statuses) <= allowed, listing
    # Every answer has its effect, and only those: no second run, nothing half done.
    assert Charge.objects.filter(account="peek").count() == statuses[201], listing
    assert not IdempotencyRecord.objects.filter(status=RecordStatus.IN_PROGRESS).exists(), listing
    assert IdempotencyRecord.objects.filter(status=RecordStatus.COMPLETED).count() == statuses[201]
    return listing


@pytest.mark.parametrize("pooler", ["pgbouncer", "django-pool"])
@pytest.mark.parametrize(("path", "atomic", "idempotency"), CONFIGS)
def test_a_burst_of_distinct_keys(servers, user, pooler, path, atomic, idempotency):
    refusable = "CLAIM_TIMEOUT" in idempotency and pooler == "pgbouncer"
    url = servers.url(pooler, atomic, idempotency)
    try:
        answers, seconds = burst(url, path, headers(user, path))
        # Only a claim connection through the starved pool may be refused, and then only 503.
        listing = judged(answers, {201, 503} if refusable else {201})
    except BaseException:
        # A request this test gave up on may still be running there: the next test's
        # counts must not meet its effects.
        servers.stop(pooler)
        raise
    print(f"\n{pooler} {path} atomic={atomic} {idempotency}: {listing} in {seconds:.1f} s")
    if refusable:
        refused = [a for a in answers if a.status == 503]
        assert all(a.json()["code"] == "StoreUnavailable" for a in refused)


@pytest.mark.parametrize(
    ("path", "atomic", "idempotency"),
    [
        CONFIGS[1],  # the decorator under ATOMIC_REQUESTS
        CONFIGS[4],  # @api_view
        CONFIGS[7],  # run_once with CLAIM_DATABASE
    ],
)
def test_a_burst_through_an_old_pgbouncer_with_prepared_statements(user, path, atomic, idempotency):
    """PgBouncer 1.18 does not keep prepared statements: the engine stops preparing on the
    first refusal (so each burst has a new server, whose workers still prepare). No 500,
    nothing left in progress; a refusal inside a transaction (the completion, once per
    connection at most) is a 503 whose work was rolled back."""
    with server("pgbouncer", atomic, idempotency, prepare=True) as url:
        answers, seconds = burst(url, path, headers(user, path))
    listing = judged(answers, {201, 503})
    print(f"\nprepared through pgbouncer {path}: {listing} in {seconds:.1f} s")
