"""The shop's test fixtures: customers, their logged-in clients, and the payment gateway
replaced by a fake that counts calls and payments."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from example_project.docs_examples.shop import payments

# --8<-- [start:fixtures]
from django_idempotency.testing import FakeProvider


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> FakeProvider:
    """The payment gateway: every call, and every payment it made (a repeated key makes
    none), counted in memory, where no database rollback reaches."""
    fake = FakeProvider(answer=lambda n: f"pay_{n}")
    monkeypatch.setattr(payments, "charge", fake)
    return fake


@pytest.fixture
def alice(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("alice", "alice@example.com")


@pytest.fixture
def as_alice(alice: Any) -> Client:
    client = Client()
    client.force_login(alice)
    return client


@pytest.fixture
def as_bob(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_user("bob", "bob@example.com"))
    return client


# --8<-- [end:fixtures]
