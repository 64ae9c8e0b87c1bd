"""A protected view's ``transaction.on_commit`` callbacks, with and without
``ATOMIC_REQUESTS``, through the decorator and DRF's ``@api_view``: each runs once, after
the work committed (another connection sees it), never on a replay; a robust one that
raises does not stop the next; none runs when the work rolls back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse
from django.test import Client, override_settings
from django.urls import path

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__")]

SEEN: list[Any] = []


def committed() -> int:
    return Charge.objects.using("provider").count()


def failing() -> None:
    SEEN.append("robust")
    raise RuntimeError("a robust callback that fails")


@idempotent(operation="things.create")
def create_thing(request: HttpRequest) -> HttpResponse:
    Charge.objects.create(account="consumer", amount=1, currency="EUR")
    transaction.on_commit(lambda: SEEN.append(("committed", committed())))
    transaction.on_commit(failing, robust=True)
    transaction.on_commit(lambda: SEEN.append("last"))
    if request.GET.get("fail"):
        return HttpResponse("no", status=503)
    return HttpResponse("made", status=201)


urlpatterns = [path("things/", create_thing)]


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic-requests"])
def atomic_requests(request: pytest.FixtureRequest) -> Iterator[bool]:
    connection.settings_dict["ATOMIC_REQUESTS"] = request.param
    SEEN.clear()
    try:
        yield request.param
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False


@override_settings(ROOT_URLCONF=__name__)
def test_callbacks_run_once_after_the_commit(user: Any, atomic_requests: bool) -> None:
    client = Client()
    client.force_login(user)
    first = client.post("/things/", {}, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 201
    assert SEEN == [("committed", 1), "robust", "last"]
    replay = client.post("/things/", {}, headers={"Idempotency-Key": "k-1"})
    assert replay.status_code == 201
    assert SEEN == [("committed", 1), "robust", "last"]
    assert committed() == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    assert not connection.in_atomic_block


@override_settings(ROOT_URLCONF=__name__)
def test_no_callback_runs_when_the_work_rolls_back(user: Any, atomic_requests: bool) -> None:
    client = Client()
    client.force_login(user)
    answer = client.post("/things/?fail=1", {}, headers={"Idempotency-Key": "k-1"})
    assert answer.status_code == 503
    assert SEEN == []
    assert committed() == 0
    assert IdempotencyRecord.objects.count() == 0
