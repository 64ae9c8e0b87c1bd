"""The helpers that more than one test module uses: plain functions, constants and classes.

Test modules import what they share from here, never from one another; the fixtures they
share are in ``tests/conftest.py``, and the servers the tests start are in ``tests/live.py``
(gunicorn, uvicorn), ``tests/pg_instance.py`` (a private PostgreSQL) and ``tests/poolers.py``
(PgBouncer). This module imports no optional dependency at import time (Celery, DRF,
django-ninja, cryptography, httpx, the example project): a helper that needs one imports it
when called, so the tox env ``core`` and the wheel's runs can import every test module.

Sections: the quick run; requests and keys; logged-in clients; records at a fixed moment; threads;
encryption; faults through gunicorn; a Celery worker; the example project.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.db import connection, connections
from django.test import Client, override_settings
from django.utils import timezone as django_timezone

from django_idempotency._context import IdempotencyContext
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.factories import RecordFactory, UserFactory
from tests.live import ROOT, Answer, basic_auth, free_port, request, server_env, starting_a_server
from tests.testapp.models import Charge, ProviderCall, ProviderCharge

# -- the quick run -----------------------------------------------------------------------------

#: ``make test-quick`` sets ``TEST_QUICK=1``: the property-based tests try fewer examples there.
QUICK = os.environ.get("TEST_QUICK") == "1"


def examples(count: int) -> int:
    """``max_examples`` for a property-based test: ``count``, or a quarter of it (at least
    10) in ``make test-quick``. Every other run (``make test``, CI, tox) tries them all."""
    return max(10, count // 4) if QUICK else count


def work_tasks(worker_id: str = "in-process") -> None:
    """django-tasks-db's worker (the loop of ``manage.py db_worker``) on the ``worker``
    backend, in this process, until no task is ready."""
    from django_tasks_db.management.commands.db_worker import Worker

    Worker(
        queue_names=["*"],
        interval=0,
        batch=True,
        backend_name="worker",
        startup_delay=False,
        max_tasks=None,
        worker_id=worker_id,
        excluded_queue_names=[],
    ).run()


# -- requests and keys -------------------------------------------------------------------------


@contextmanager
def opened() -> Iterator[Counter[str]]:
    """How many database connections were opened meanwhile, per alias."""
    from django.db.backends.signals import connection_created

    counts: Counter[str] = Counter()

    def count(sender: Any, connection: Any, **kwargs: Any) -> None:
        counts[connection.alias] += 1

    connection_created.connect(count)
    try:
        yield counts
    finally:
        connection_created.disconnect(count)


needs_drf = pytest.mark.skipif(
    not settings.HAS_DRF,
    reason="needs djangorestframework (the tox env 'core' runs without it)",
)

needs_ninja = pytest.mark.skipif(
    not settings.HAS_NINJA,
    reason="needs django-ninja (the tox env 'core' runs without it)",
)

postgres_only = pytest.mark.skipif(
    connection.vendor == "sqlite",
    reason="needs real concurrent transactions, each on its own connection: "
    "PostgreSQL (and MariaDB), not SQLite",
)


def assert_released_or_given_back(policy: str) -> None:
    """After a store failure under ``policy``: ``"retry"`` released its claim (no record);
    a policy that keeps it gave its lease back (one record, in progress, stale at once)."""
    records = list(IdempotencyRecord.objects.all())
    if policy == "retry":
        assert records == []
    else:
        assert len(records) == 1
        assert records[0].status == RecordStatus.IN_PROGRESS
        assert records[0].lease_expires_at <= django_timezone.now()


def is_completion(sql: str) -> bool:
    """Whether ``sql`` is the engine's fenced completion (alone, or carrying the transaction's
    ``COMMIT`` on PostgreSQL on Django's defaults): an execute wrapper's test for a fault."""
    plain = sql.replace('"', "").replace("`", "").lstrip()
    return plain.startswith(
        ("UPDATE django_idempotency_record", "WITH done AS (UPDATE django_idempotency_record")
    ) and ("completed_at" in plain)


def committed_charges() -> int:
    """Charges as another connection sees them: committed ones only."""
    with connections["provider"].cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {Charge._meta.db_table}")
        (count,) = cursor.fetchone()
    return int(count)


@contextmanager
def libpq_trace() -> Iterator[list[str]]:
    """The messages the default connection (PostgreSQL) sends and receives while the block
    runs, one line each (a statement's text may go on over lines of its own), from libpq's
    protocol trace: every ``ReadyForQuery`` ends a round trip."""
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    lines: list[str] = []
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        try:
            yield lines
        finally:
            pgconn.untrace()
            trace.seek(0)
            lines.extend(trace.read().splitlines())


def simple_queries(lines: list[str]) -> list[str]:
    """The text (its first line, quoted) of each simple query in a :func:`libpq_trace`."""
    return [
        line.split("\t")[-1].strip() for line in lines if "\tF\t" in line and "\tQuery\t" in line
    ]


def begins_alone(lines: list[str]) -> bool:
    """Whether psycopg sent a ``BEGIN`` of its own (a simple query, or a parsed one)."""
    sent = [line.split("\t", 4)[3:] for line in lines if "\tF\t" in line]
    return any(
        (message[0] == "Query" and message[1].strip() == '"BEGIN"')
        or (message[0] == "Parse" and message[1].strip().startswith('"" "BEGIN"'))
        for message in sent
        if len(message) == 2
    )


def new_key() -> str:
    return uuid.uuid4().hex


class ApiClient:
    """A Django test client that sends JSON and an Idempotency-Key."""

    def __init__(self, user: User | None) -> None:
        self.client = Client()
        if user is not None:
            self.client.force_login(user)

    def post(self, path: str, data: Any = None, key: str | None = None, **extra: Any) -> Any:
        return self.send("post", path, data, key, **extra)

    def patch(self, path: str, data: Any = None, key: str | None = None, **extra: Any) -> Any:
        return self.send("patch", path, data, key, **extra)

    def send(self, method: str, path: str, data: Any, key: str | None, **extra: Any) -> Any:
        headers = dict(extra.pop("headers", {}))
        if key is not None:
            headers["Idempotency-Key"] = key
        body = data if isinstance(data, (bytes, str)) else json.dumps(data or {})
        content_type = extra.pop("content_type", "application/json")
        call: Callable[..., Any] = getattr(self.client, method)
        return call(path, body, content_type=content_type, headers=headers, **extra)


# -- logged-in clients -------------------------------------------------------------------------


def logged_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def staff_with(*codenames: str) -> Any:
    """A staff user with these permissions of the package's models, and no others."""
    user = UserFactory(is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="django_idempotency", codename__in=codenames
        )
    )
    return user


def session_headers(user: Any) -> dict[str, str]:
    """The cookie of a logged-in session of ``user``, for a plain HTTP client."""
    client = Client()
    client.force_login(user)
    return {"Cookie": f"sessionid={client.cookies['sessionid'].value}"}


def auth_headers(user: Any, path: str) -> dict[str, str]:
    """How a plain HTTP client authenticates to ``path``: HTTP Basic for the DRF and ninja
    APIs (ninja's session authentication would want a CSRF token), a session elsewhere."""
    if path.startswith(("/api/", "/ninja/")):
        return basic_auth(user.username)
    return session_headers(user)


# -- records at a fixed moment -----------------------------------------------------------------

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=timezone.utc)


def completed(*, expires_in: timedelta, now: datetime = NOW, **fields: Any) -> IdempotencyRecord:
    """A completed record that expires ``expires_in`` after ``now`` (negative: expired)."""
    return RecordFactory(created_at=now - timedelta(hours=1), expires_at=now + expires_in, **fields)


def in_progress(
    *,
    lease_in: timedelta,
    expires_in: timedelta = timedelta(hours=1),
    policy: str = "retry",
    now: datetime = NOW,
    **fields: Any,
) -> IdempotencyRecord:
    """An in-progress record whose lease ends ``lease_in`` after ``now`` (negative: stale)."""
    return RecordFactory(
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=now + lease_in,
        expires_at=now + expires_in,
        created_at=now - timedelta(minutes=5),
        recovery_policy=policy,
        response_status=None,
        response_headers=[],
        response_body=None,
        **fields,
    )


def bulk_records(count: int, *, expires_at: datetime, prefix: str) -> None:
    """``count`` completed records, created a day before they expire, with the keys
    ``{prefix}-0`` ... in a few statements: the factory's record is built once and copied
    (factories one by one are slow, even unsaved)."""
    built = RecordFactory.build(expires_at=expires_at, created_at=expires_at - timedelta(hours=24))
    fields = {
        field.attname: getattr(built, field.attname)
        for field in IdempotencyRecord._meta.concrete_fields
        if not field.primary_key
    }
    records = [
        IdempotencyRecord(
            **{
                **fields,
                "key": f"{prefix}-{n}",
                "response_headers": [list(header) for header in fields["response_headers"]],
            }
        )
        for n in range(count)
    ]
    IdempotencyRecord.objects.bulk_create(records, batch_size=1000)


def make_in_progress(key: str, lease_left: timedelta) -> None:
    """Turn a completed record back into a claim whose lease ends ``lease_left`` from now."""
    IdempotencyRecord.objects.filter(key=key).update(
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=django_timezone.now() + lease_left,
        response_status=None,
        response_body=None,
        completed_at=None,
    )


# -- threads -----------------------------------------------------------------------------------


def server_sessions() -> int:
    """The PostgreSQL test database's client backends, but the one this read opens."""
    import psycopg

    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as raw:
        (count,) = raw.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchone()  # type: ignore[misc]
    return int(count)


def in_thread(call: Any) -> Any:
    """Run ``call`` in a thread of its own, so on a database connection of its own."""

    def wrapped(*args: Any) -> Any:
        try:
            return call(*args)
        finally:
            connections.close_all()

    return wrapped


class Polls:
    """The threads seen reading a record in progress while they wait for its owner (see
    :func:`watching_polls`)."""

    def __init__(self) -> None:
        self._threads: set[int] = set()
        self._seen = threading.Condition()

    def saw(self) -> None:
        with self._seen:
            self._threads.add(threading.get_ident())
            self._seen.notify_all()

    def count(self) -> int:
        with self._seen:
            return len(self._threads)

    def wait(self, threads: int = 1, timeout: float = 30) -> None:
        """Until ``threads`` threads wait for an owner; fail after ``timeout`` seconds."""
        with self._seen:
            if not self._seen.wait_for(lambda: len(self._threads) >= threads, timeout):
                raise AssertionError(
                    f"{len(self._threads)} of {threads} duplicates waited for the original "
                    f"within {timeout} s"
                )


@contextmanager
def watching_polls() -> Iterator[Polls]:
    """Which threads wait for an attempt in progress (``wait=``, ``IN_PROGRESS_WAIT``).

    A duplicate that waits reads the record between pauses (``_store.fetch``, which an
    attempt in autocommit calls for nothing else before it is answered): once a thread was
    seen reading, it waits, and what the test does next happens while it does."""
    from django_idempotency import _store

    polls = Polls()
    real_fetch = _store.fetch

    def observed_fetch(*args: Any, **kwargs: Any) -> Any:
        polls.saw()
        return real_fetch(*args, **kwargs)

    _store.fetch = observed_fetch
    try:
        yield polls
    finally:
        _store.fetch = real_fetch


def storm_while_held(
    call: Callable[[], Any],
    count: int,
    entered: threading.Event,
    leave: threading.Event,
    wait: float = 30,
) -> list[Any]:
    """``count`` threads make ``call`` at once, each on a connection of its own, while the
    original is held inside its body (``entered`` set by it, ``leave`` releasing it once
    every other call was refused or waits for it); every wait bounded by ``wait``. Their
    answers, in the order they came back."""
    results: list[Any] = []
    lock = threading.Lock()

    def one() -> None:
        result = call()
        with lock:
            results.append(result)

    def answered() -> int:
        with lock:
            return len(results)

    with watching_polls() as polls:
        threads = [threading.Thread(target=in_thread(one)) for _ in range(count)]
        for thread in threads:
            thread.start()
        try:
            assert entered.wait(wait)
            # Not a fixed pause: a thread that started late would call after the original
            # completed, and the storm would not be one.
            deadline = time.monotonic() + wait
            while answered() + polls.count() < count - 1:
                assert time.monotonic() < deadline, (
                    f"within {wait} s, {answered()} calls were answered and {polls.count()} "
                    f"waited, of the {count - 1} that met the original"
                )
                time.sleep(0.01)
        finally:
            leave.set()
            for thread in threads:
                thread.join(wait)
    assert not any(thread.is_alive() for thread in threads)
    assert len(results) == count
    return results


# -- encryption (tests/test_crypto.py, tests/test_crypto_rotation.py) --------------------------


def _fernet_key() -> str:
    """A new Fernet key: what ``Fernet.generate_key()`` returns (32 random bytes, URL-safe
    base64), made without importing cryptography, which the tox env ``core`` lacks."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode()


OLD = _fernet_key()
NEW = _fernet_key()
LOST = _fernet_key()
# What a response carries that must never be readable in a stored row.
SECRET_BODY = "Ada Lovelace, 12 St James's Square, card ending 4242"
SECRET_HEADER = "ada.lovelace@example.com"
LOCATION = "/customers/ada-lovelace/"
PAYLOAD = {
    "status": 201,
    "body": json.dumps({"name": SECRET_BODY}),
    "headers": {"X-Customer": SECRET_HEADER, "Location": LOCATION},
}


def keys(*keys: str, **more: Any) -> Any:
    """The settings of a server holding these ``ENCRYPTION_KEYS`` (the first seals)."""
    return override_settings(
        IDEMPOTENCY={"ENCRYPTION_KEYS": list(keys), "REPLAY_HEADERS": ["X-Customer"], **more}
    )


def answered(response: Any) -> tuple[Any, ...]:
    """What a retry must get again, byte for byte."""
    return (
        response.status_code,
        response.content,
        response["Content-Type"],
        response.get("Location"),
        response.get("X-Customer"),
    )


def fingerprint_of(api: Any, payload: dict[str, Any]) -> str:
    """The hash a request of this payload to ``/outcome/`` gets: from a record made by one,
    then removed."""
    with keys():
        api.post("/outcome/", payload, key="probe")
    probe = IdempotencyRecord.objects.get(key="probe")
    probe.delete()
    Charge.objects.filter(account="outcome").delete()
    return probe.request_hash


# -- faults through gunicorn (test_faults_crash, test_faults_database, test_servers, soak) -----

FAULTS_CHARGE = {"amount": 250, "currency": "EUR"}
RETRY_PATH = "/faults/charges/"  # operation faults.charge, recovery "retry", 2 s lease
FAIL_PATH = "/faults/charges/fail-policy/"  # operation faults.charge-fail, recovery "fail"
LEASE_SECONDS = 2


@dataclass(frozen=True)
class Caller:
    """One tenant sending one logical operation: the headers every attempt carries."""

    tenant: str
    key: str

    @classmethod
    def new(cls) -> Caller:
        return cls(tenant=f"t-{uuid.uuid4().hex[:12]}", key=new_key())

    def headers(self, directives: str = "") -> dict[str, str]:
        headers = {"X-Tenant": self.tenant, "Idempotency-Key": self.key}
        if directives:
            headers["X-Test"] = directives
        return headers

    def downstream_key(self, operation: str) -> str:
        """The key the provider was sent for this operation (same SECRET_KEY as the server)."""
        return IdempotencyContext(self.key, operation, self.tenant).downstream_key("provider")


def settle(
    url: str,
    path: str,
    headers: dict[str, str],
    payload: Any = FAULTS_CHARGE,
    seconds: float = 30,
) -> Answer:
    """Retry like a good client until the outcome is known: back off on 409, on no answer,
    and on the 503 of an unreachable store (a pooler answers it until the server is back)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        answer = request(url, "POST", path, payload, headers, timeout=15)
        if answer.status not in (0, 409) and not unavailable(answer):
            return answer
        time.sleep(0.2)
    raise AssertionError(f"no outcome for {path} within {seconds} s")


def unavailable(answer: Answer) -> bool:
    return answer.status == 503 and b"idempotency_store_unavailable" in answer.body


def sleep_past_lease(seconds: float = LEASE_SECONDS) -> None:
    time.sleep(seconds + 0.3)


def assert_problem(answer: Answer, status: int, code: str) -> None:
    assert answer.status == status, (answer.status, answer.body[:300])
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["code"] == code


def caller_effects(caller: Caller, operation: str) -> tuple[int, int, int]:
    """(local charges, provider charges, provider calls) of one caller's operation."""
    downstream = caller.downstream_key(operation)
    return (
        Charge.objects.filter(account=caller.tenant).count(),
        ProviderCharge.objects.filter(key=downstream).count(),
        ProviderCall.objects.filter(key=downstream).count(),
    )


# -- a Celery worker (tests/test_tasks.py, tests/test_outbox_relay.py) -------------------------

WORKER_WAIT = 60  # seconds: a bound on every wait for the worker


def task_effects(tag: str) -> int:
    """How many runs of ``tests.record_effect`` with ``tag`` committed their effect."""
    return ProviderCall.objects.filter(key=f"effect:{tag}").count()


def task_starts(tag: str) -> int:
    """How many runs of ``tests.record_effect`` with ``tag`` started (a crash keeps these)."""
    return ProviderCall.objects.filter(key__startswith=f"start:{tag}:").count()


def wait_until(condition: Callable[[], object], what: str, timeout: float = WORKER_WAIT) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def broker() -> Any:
    """A Redis client on the tests' broker."""
    import redis

    from tests import celery_app

    return redis.Redis.from_url(celery_app.BROKER_URL)


def drained() -> bool:
    """No message waits in the queue, and none is held unacknowledged by a worker."""
    from tests import celery_app

    client = broker()
    return not client.llen(celery_app.QUEUE) and not client.hlen(celery_app.UNACKED)


def wait_drained() -> None:
    # Seen twice, half a second apart: a message moving from the queue to the unacked
    # set is in neither for an instant.
    def drained_twice() -> bool:
        if not drained():
            return False
        time.sleep(0.5)
        return drained()

    wait_until(drained_twice, "an empty queue")


@contextmanager
def celery_worker(
    pool: str = "prefork", concurrency: int = 1, broker_url: str | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A ``celery worker`` process on the test database; killed at the end.

    ``broker_url``: another broker than the tests' (a private Redis, say).
    """
    from celery import Celery

    from tests import celery_app

    starting_a_server("a Celery worker")
    name = f"idempotency-tests-{uuid.uuid4().hex[:8]}@localhost"
    extra = {"TEST_CELERY_QUEUE": celery_app.QUEUE}
    if broker_url is not None:
        extra["TEST_CELERY_BROKER"] = broker_url
    env = server_env(extra)
    # Only to ping the worker: never the current app, which the tests' tasks use.
    control = (
        celery_app.app if broker_url is None else Celery(broker=broker_url, set_as_current=False)
    )
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker"),
            *("--pool", pool, "--concurrency", str(concurrency), "-Q", celery_app.QUEUE),
            *("-n", name, "--loglevel", "WARNING"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: (
                process.poll() is not None or control.control.ping(destination=[name], timeout=0.5)
            ),
            "the worker to answer a ping",
            timeout=30,
        )
        if process.poll() is not None:
            raise RuntimeError(f"the celery worker exited during start-up ({process.returncode})")
        yield process
    finally:
        stop_process(process)
        if control is not celery_app.app:
            control.close()


def node_name(worker: subprocess.Popen[bytes]) -> str:
    """The node name of a worker that ``celery_worker`` started: the ``destination`` of a
    control command for it alone. (A command with a reply and no destination waits out its
    whole timeout for the replies of every worker on the broker, other runs' included.)"""
    arguments = [str(argument) for argument in worker.args]
    return arguments[arguments.index("-n") + 1]


def stop_process(process: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> None:
    """Stop a process started in a session of its own (a worker and its pool processes)."""
    if process.poll() is None:
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


# -- the example project -----------------------------------------------------------------------

# How long the example's fake payment provider takes (the client guide's impatient client
# gives up sooner).
PROVIDER_LATENCY = 1.0


@dataclass
class Example:
    """A server of the example project: its URL and its SQLite database."""

    url: str
    database: Path
    #: The server's environment: a script run with it reads the server's database.
    env: dict[str, str] = field(default_factory=dict)

    def count(self, table: str, description: str) -> int:
        with sqlite3.connect(self.database) as db:
            (n,) = db.execute(
                f"SELECT count(*) FROM {table} WHERE description = ?", [description]
            ).fetchone()
        return int(n)


@contextmanager
def example_server(database: Path, **extra_env: str) -> Iterator[Example]:
    """The example project on a fresh SQLite file ``database``, migrated, with the demo user
    demo/demo, served by ``runserver`` on a free port; ``extra_env`` overrides its settings'
    environment (``EXAMPLE_DEBUG``, ``EXAMPLE_PROVIDER_LATENCY``, ...)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("celery", reason="the example project sends its receipts with Celery")
    starting_a_server("the example project's runserver")
    env = {
        **os.environ,
        "EXAMPLE_DB": "sqlite",
        "EXAMPLE_SQLITE_PATH": str(database),
        "EXAMPLE_FAST_PASSWORDS": "1",
        "EXAMPLE_PROVIDER_LATENCY": str(PROVIDER_LATENCY),
        "EXAMPLE_CELERY_EAGER": "1",
        "EXAMPLE_DEBUG": "0",
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "PYTHONPATH": str(ROOT),
        **extra_env,
    }
    manage = [sys.executable, str(ROOT / "manage.py")]
    for command in (["migrate"], ["ensure_demo_user", "--username", "demo", "--password", "demo"]):
        subprocess.run([*manage, *command, "--verbosity", "0"], env=env, cwd=ROOT, check=True)
    port = free_port()
    server = subprocess.Popen(
        [*manage, "runserver", "--noreload", f"127.0.0.1:{port}"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert server.poll() is None, "the example project exited during start-up"
            try:
                httpx.get(f"{url}/admin/login/", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the example project did not start"
                time.sleep(0.1)
        yield Example(url, database, env)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)


def says_nothing_of_the_server(problem: dict[str, Any]) -> None:
    """A refusal's body names none of the server's settings, key ids, hosts or SQL: what a
    client is told is what it can do (the log and ``check`` carry the rest)."""
    from django_idempotency import conf

    text = json.dumps(problem)
    told = [name for name in (*conf.DEFAULTS, "IDEMPOTENCY", "DATABASES") if name in text]
    assert not told, f"the body names the setting(s) {told}: {text}"
    assert not re.search(r"\b[0-9a-f]{12}\b", problem.get("detail", "")), text  # a key id
    assert not re.search(r"\b(SELECT|INSERT|UPDATE|DELETE|FROM|WHERE)\b", text), text
    database = connection.settings_dict
    for server in (database.get("HOST"), database.get("NAME"), "localhost", "127.0.0.1"):
        assert not server or str(server) not in text, f"{server!r} in {text}"


# -- a database's limit on one statement (tests/test_outcome_size.py) --------------------------

#: The limit a capped vendor declares where the server has none of its own (PostgreSQL and
#: SQLite take a gigabyte a value); MariaDB's own is ``max_allowed_packet``.
CAP = 256 * 1024
#: The room that vendor keeps for the rest of a statement, as MariaDB's does.
ROOM = 16 * 1024


def packet() -> int:
    """The largest statement the server takes (under :func:`capped_vendor`, what it
    declares)."""
    if connection.vendor != "mysql":
        return CAP
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@max_allowed_packet")
        return int(cursor.fetchone()[0])


@contextmanager
def capped_vendor() -> Iterator[None]:
    """On MariaDB, the server's own limit; elsewhere, the alias's vendor declaring ``CAP``
    (read from the server as a ``SELECT``, the values counted as they are), so that the
    engine's refusal of an outcome too large runs on every database."""
    from django_idempotency._vendors import VENDORS, of

    if connection.vendor == "mysql":
        yield
        return
    real = VENDORS[connection.vendor]

    class Capped(type(real)):  # type: ignore[misc]
        packet_limit_sql = f"SELECT {CAP}"

        def statement_limit(self, connection: Any, body: bytes, headers: str) -> int | None:
            with connection.cursor() as cursor:
                cursor.execute(self.packet_limit_sql)
                limit = int(cursor.fetchone()[0])
            needed = len(body) + len(headers.encode()) + ROOM
            return limit if needed > limit else None

    VENDORS[connection.vendor] = Capped()
    of.cache_clear()
    try:
        yield
    finally:
        VENDORS[connection.vendor] = real
        of.cache_clear()


def nested_past_json() -> list[Any]:
    """A list nested deeper than ``json.dumps`` goes on every Python: past the recursion limit
    (3.10, 3.11) and past the C recursion limit of 3.12 and later (about 10,000), which lets
    a list nested just past ``sys.getrecursionlimit()`` through."""
    value: list[Any] = []
    for _ in range(100_000):
        value = [value]
    return value


# -- charsets that read no text (tests/test_sources.py, tests/test_hostile_input.py) ----------

#: Charsets Python has a codec for that decodes no text (rot13, base64) or that cannot
#: replace what it fails to decode (idna, undefined; punycode before Python 3.13, whose
#: punycode codec replaces): Django's form parsers raise on them.
NO_TEXT_CHARSETS = [
    "rot13",
    "base64",
    "idna",
    *(["punycode"] if sys.version_info < (3, 13) else []),
    "undefined",
]
