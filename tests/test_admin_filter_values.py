"""The admin's changelists answer any filter value a URL can carry, on every database.

Each filter (the operation of the records, the task of the outbox, a status, any field
lookup the admin allows) compares the value from the URL with a column. A value no column
can hold (a NUL: PostgreSQL refuses it in any text parameter) is refused as a lookup the
admin does not allow, ``400``, as on every database; never a ``500``. Other odd values
(a lone surrogate, which the URL's decoding replaces, a thousand characters) list nothing.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import quote

import pytest
from django.db import transaction
from django.test import Client

from django_idempotency import outbox
from tests.factories import RecordFactory, UserFactory
from tests.helpers import logged_in

pytestmark = pytest.mark.django_db

RECORDS = "/admin/django_idempotency/idempotencyrecord/"
MESSAGES = "/admin/django_idempotency/outboxmessage/"
KEYS = "/admin/django_idempotency/outboxuniquekey/"
PAGES = {
    "records-by-operation": (RECORDS, "operation"),
    "records-by-status": (RECORDS, "status"),
    "messages-by-task": (MESSAGES, "task"),
    "messages-by-status": (MESSAGES, "status"),
    "unique-keys-by-task": (KEYS, "task"),
    "unique-keys-by-key": (KEYS, "key"),
}
VALUES = {"lone-surrogate": "charges\ud800", "long": "x" * 1000}


@pytest.fixture
def admin_client() -> Client:
    return logged_in(UserFactory(is_staff=True, is_superuser=True))


@pytest.fixture(autouse=True)
def one_of_each() -> None:
    """One record and one message holding one key: each page lists one row unfiltered."""
    RecordFactory(operation="charges.create")
    with transaction.atomic():
        outbox.enqueue_once("k-1", "tasks.send", 1, unique_until=timedelta(hours=1))


@pytest.mark.parametrize(("url", "parameter"), list(PAGES.values()), ids=list(PAGES))
def test_a_filter_value_holding_a_nul_is_refused_as_a_bad_request(admin_client, url, parameter):
    response = admin_client.get(f"{url}?{parameter}=charges%00create")
    assert response.status_code == 400
    assert admin_client.get(url).context["cl"].result_count == 1


@pytest.mark.parametrize("value", list(VALUES.values()), ids=list(VALUES))
@pytest.mark.parametrize(("url", "parameter"), list(PAGES.values()), ids=list(PAGES))
def test_other_odd_filter_values_list_nothing(admin_client, url, parameter, value):
    response = admin_client.get(f"{url}?{parameter}={quote(value, errors='surrogatepass')}")
    assert response.status_code == 200
    assert response.context["cl"].result_count == 0
