from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, connections
from django.test import Client

from tests.factories import UserFactory


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``TEST_DATABASE_ONLY=1`` and ``TEST_SHARD=k/n`` choose a part of the suite."""
    if os.environ.get("TEST_DATABASE_ONLY") == "1":
        _keep(config, items, touches_the_database)
    shard = os.environ.get("TEST_SHARD")
    if shard:
        _keep(config, items, shard_of(shard))


def touches_the_database(item: pytest.Item) -> bool:
    """Whether a test can reach the test database: it is marked ``django_db``, or one of its
    fixtures (a live server's, say) unblocks the database. pytest-django refuses every other
    test a connection, so what such a test shows holds on every database alike: the runs on
    a second database (MariaDB, PostgreSQL 16) leave it to the first two."""
    fixtures = getattr(item, "fixturenames", ())
    return item.get_closest_marker("django_db") is not None or "django_db_setup" in fixtures


def shard_of(shard: str) -> Callable[[pytest.Item], bool]:
    """``TEST_SHARD=k/n``: the k-th of n parts of the suite, whole files each (a file's part
    is the hash of its path). ``tests/halves.py`` runs the two halves of a suite side by
    side: on a server, a suite spends most of its time waiting on it, on workers and on
    processes."""
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise pytest.UsageError(f"TEST_SHARD must be k/n with 1 <= k <= n, not {shard!r}")

    def kept(item: pytest.Item) -> bool:
        path = item.nodeid.split("::", 1)[0]
        return int(hashlib.sha256(path.encode()).hexdigest(), 16) % count + 1 == index

    return kept


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
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
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


@pytest.fixture
def user(db: Any) -> User:
    return UserFactory()


@pytest.fixture
def other_user(db: Any) -> User:
    return UserFactory()


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


@pytest.fixture
def api(user: User) -> ApiClient:
    return ApiClient(user)


@pytest.fixture
def anon_api() -> ApiClient:
    return ApiClient(None)
