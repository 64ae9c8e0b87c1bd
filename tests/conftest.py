"""The suite's hooks and its shared fixtures.

The hooks choose a part of the suite (``TEST_DATABASE_ONLY``, ``TEST_SHARD``), mark the
tests that start servers (``servers``: see ``SERVER_FIXTURES``) and empty the database after
each transactional test the cheaper way of ``tests/flush.py``. The plain helpers that test
modules share are in ``tests/helpers.py``.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# The assertions of the shared helpers show their values when they fail, as the tests' own
# do: pytest rewrites only the modules it is told of before they are imported.
pytest.register_assert_rewrite("tests.helpers", "tests.live")

from django.contrib.auth.models import User  # noqa: E402
from django.db import connection, connections  # noqa: E402

from tests import flush, live  # noqa: E402
from tests.factories import UserFactory  # noqa: E402
from tests.helpers import ApiClient, Example, capped_vendor, example_server  # noqa: E402

# The fixtures that start a server or a worker process, wherever they are defined: every test
# that uses one (directly or through another fixture) is marked `servers`. A test that starts
# one without such a fixture is marked by hand; `tests.live.starting_a_server` fails a test
# that starts one unmarked.
SERVER_FIXTURES = frozenset(
    {
        "live_server",  # pytest-django's: a server thread on a socket of its own
        "example",  # here: the example project under runserver
        "debug_example",  # test_example_rides.py: the same, DEBUG on
        "server",  # gunicorn (test_crash, test_faults_*, test_hostile_input, test_soak,
        # test_steps_crash), runserver (test_quickstart)
        "servers",  # test_servers.py: four gunicorn servers
        "asgi_server",  # uvicorn (test_async, test_cancellation)
        "atomic_server",  # gunicorn (test_callers_transaction_crash)
        "webhook_server",  # gunicorn (test_webhook_recipes)
        "pg",  # test_faults_database.py: a private PostgreSQL
        "worker",  # test_outbox_relay.py: a Celery worker
        "starved_claims_pool",  # PgBouncer (test_claim_connection)
        "bounced_with_prepared_statements",  # PgBouncer (test_store_errors)
    }
)


def pytest_configure(config: pytest.Config) -> None:
    live.under_pytest = True
    # After each transactional test, the database emptied as Django's flush would, cheaper.
    flush.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    """Remember the running test for ``tests.live.starting_a_server``. A hook, not an autouse
    fixture: a module's or the session's fixtures are set up before any function-scoped one,
    and a server is most often started by one of those."""
    live.running_test = item
    try:
        return (yield)
    finally:
        live.running_test = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that use a server fixture ``servers``; ``TEST_DATABASE_ONLY=1`` and
    ``TEST_SHARD=k/n`` choose a part of the suite."""
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.servers)
    if os.environ.get("TEST_DATABASE_ONLY") == "1":
        _keep(config, items, touches_the_database)
    shard = os.environ.get("TEST_SHARD")
    if shard:
        _keep(config, items, shard_of(shard, items))


def touches_the_database(item: pytest.Item) -> bool:
    """Whether a test can reach the test database: it is marked ``django_db``, or one of its
    fixtures (a live server's, say) unblocks the database. pytest-django refuses every other
    test a connection, so what such a test shows holds on every database alike: the runs on
    a second database (MariaDB, PostgreSQL 16) leave it to the first two."""
    fixtures = getattr(item, "fixturenames", ())
    return item.get_closest_marker("django_db") is not None or "django_db_setup" in fixtures


# Each test file's seconds on PostgreSQL (the longest suite), for TEST_SHARD: written by a run
# with TEST_TIMINGS naming the file (see record_timings below). A file it does not name counts
# DEFAULT_TEST_SECONDS per test.
WEIGHTS = Path(__file__).with_name("shard_weights.json")
DEFAULT_TEST_SECONDS = 0.3


def shard_of(shard: str, items: Sequence[pytest.Item]) -> Callable[[pytest.Item], bool]:
    """``TEST_SHARD=k/n``: the k-th of n parts of ``items``, whole files each, the parts of
    about the same length by the files' measured seconds (``WEIGHTS``): the longest file
    first, each into the part that is the shortest so far. ``tests/halves.py`` runs the
    parts of a suite side by side: on a server, a suite spends most of its time waiting on
    it, on workers and on processes, and the run lasts as long as its longest part (with
    the files placed by the hash of their path, one of make test's three PostgreSQL parts
    took half as long again as the others: the worker, kill and MCP server suites fell
    together)."""
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise pytest.UsageError(f"TEST_SHARD must be k/n with 1 <= k <= n, not {shard!r}")
    measured: dict[str, float] = json.loads(WEIGHTS.read_text()) if WEIGHTS.exists() else {}
    tests_per_file = collections.Counter(file_of(item) for item in items)
    seconds = {
        path: measured.get(path, tests * DEFAULT_TEST_SECONDS)
        for path, tests in tests_per_file.items()
    }
    parts = [0.0] * count
    part_of: dict[str, int] = {}
    for path in sorted(seconds, key=lambda path: (-seconds[path], path)):
        shortest = parts.index(min(parts))
        part_of[path] = shortest + 1
        parts[shortest] += seconds[path]
    return lambda item: part_of.get(file_of(item)) == index


def file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


# TEST_TIMINGS=tests/shard_weights.json: each file's seconds (set-up, call and tear-down of
# its tests) are written there at the end of the run, over the values of the files it ran.
_timings: collections.defaultdict[str, float] = collections.defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("TEST_TIMINGS"):
        _timings[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get("TEST_TIMINGS")
    if not target or hasattr(session.config, "workerinput") or not _timings:
        return  # a pytest-xdist worker: its reports reach the controller too
    path = Path(target)
    known: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}
    known.update({name: round(value, 1) for name, value in _timings.items()})
    path.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")


def _keep(
    config: pytest.Config, items: list[pytest.Item], kept: Callable[[pytest.Item], bool]
) -> None:
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        (keep if kept(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def django_db_setup(
    django_db_setup: None, django_db_blocker: Any, request: pytest.FixtureRequest
) -> Iterator[None]:
    """pytest-django's, and at the end every connection closed before the test databases are
    dropped: a test on ``databases="__all__"`` opens the ``provider`` alias (a mirror of the
    default database), and PostgreSQL refuses to drop a database another session is on."""
    yield
    with django_db_blocker.unblock():
        connections.close_all()
        # A Django pool keeps its connections open after close(): close the pools too.
        for alias in connections:
            if connections.settings[alias]["OPTIONS"].get("pool"):
                connections[alias].close_pool()
        # Where Django drops the database itself: under --reuse-db (tests/poolers.py) a
        # pooler's own server connections stay on it, and the runner drops it by force.
        if connection.vendor == "postgresql" and not request.config.getoption("reuse_db"):
            await_other_sessions()


_OTHER_SESSIONS = (
    "SELECT pid, application_name, state, backend_start, left(query, 200)"
    " FROM pg_stat_activity WHERE datname = current_database()"
    " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
)


def await_other_sessions(seconds: float = 15) -> None:
    """Wait until no other session is on the test database: the backend of a server or
    worker process that a test stopped may take a moment to exit. One that stays is a
    connection a test left open, named in the failure (its last statement, its program)."""
    import time

    deadline = time.monotonic() + seconds
    others: list[tuple[Any, ...]] = []
    if connection.settings_dict["OPTIONS"].get("pool"):
        # Through Django's pool the check would open a pool again, whose own connections
        # (min_size, opened in the background) it would then find.
        import psycopg

        params = connection.get_connection_params()
        params.pop("pool", None)
        with psycopg.connect(**params, autocommit=True) as raw:
            while True:
                others = raw.execute(_OTHER_SESSIONS).fetchall()
                if not others or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        if others:
            pytest.fail(f"sessions left on the test database after {seconds} s: {others}")
        return
    try:
        with connection.cursor() as cursor:
            while True:
                cursor.execute(_OTHER_SESSIONS)
                others = cursor.fetchall()
                if not others or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    finally:
        connection.close()
    if others:
        pytest.fail(f"sessions left on the test database after {seconds} s: {others}")


@pytest.fixture
def user(db: Any) -> User:
    return UserFactory()


@pytest.fixture
def other_user(db: Any) -> User:
    return UserFactory()


@pytest.fixture
def api(user: User) -> ApiClient:
    return ApiClient(user)


@pytest.fixture
def anon_api() -> ApiClient:
    return ApiClient(None)


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Example]:
    """The example project on a fresh SQLite file, served by ``runserver`` on a free port."""
    pytest.importorskip("httpx")
    pytest.importorskip(
        "example_project.client", reason="the example project is not here (tox tests the wheel)"
    )
    with example_server(tmp_path_factory.mktemp("example") / "db.sqlite3") as served:
        yield served


@pytest.fixture(scope="module")
def run_queue() -> Iterator[None]:
    """This run's Celery queue; its routing keys and its unacknowledged set are removed from
    Redis after the last test."""
    from tests import celery_app
    from tests.helpers import broker

    yield
    client = broker()
    queue = celery_app.QUEUE
    unacked = celery_app.UNACKED
    client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
    client.delete(unacked, f"{unacked}-index", f"{unacked}-mutex")


@pytest.fixture
def clean_queue(run_queue: None) -> Iterator[None]:
    """The Celery queue emptied before and after the test."""
    from tests import celery_app
    from tests.helpers import broker

    client = broker()
    client.delete(celery_app.QUEUE)
    yield
    client.delete(celery_app.QUEUE)


@pytest.fixture
def eager_celery() -> Iterator[None]:
    """The test Celery app runs its tasks at once, in the caller (``task_always_eager``)."""
    pytest.importorskip("celery", reason="Celery is an optional dependency")
    from tests import celery_app

    celery_app.app.conf.task_always_eager = True
    try:
        yield
    finally:
        celery_app.app.conf.task_always_eager = False


@pytest.fixture
def atomic_requests() -> Iterator[None]:
    """``ATOMIC_REQUESTS`` on for the default database, for one test."""
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        yield
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False


@pytest.fixture
def capped() -> Iterator[None]:
    """The database's limit on one statement: MariaDB's own, elsewhere a vendor that declares
    one (``tests.helpers.capped_vendor``)."""
    with capped_vendor():
        yield


@pytest.fixture
def unreachable_store() -> Iterator[None]:
    """Makes the store fail for real: a closed port on PostgreSQL, a missing table on SQLite
    (an in-memory SQLite database cannot be disconnected without losing it)."""
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE django_idempotency_record RENAME TO moved_away")
        try:
            yield
        finally:
            with connection.cursor() as cursor:
                cursor.execute("ALTER TABLE moved_away RENAME TO django_idempotency_record")
        return
    settings_dict = connection.settings_dict
    saved = dict(settings_dict)
    connection.close()
    settings_dict["PORT"] = "1"
    try:
        yield
    finally:
        connection.close()
        settings_dict.clear()
        settings_dict.update(saved)
