from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client

from tests.factories import UserFactory

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
