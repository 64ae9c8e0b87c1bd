"""A response whose stored header the database cannot hold (a NUL in ``Location``, which a
PostgreSQL JSON column refuses): refused as not storable, the same on every database, never
a store failure that runs the view again on every retry."""

from __future__ import annotations

from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import Client, override_settings
from django.urls import path

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge, ProviderCall

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__")]


@idempotent(operation="things.create")
def create_thing(request: HttpRequest) -> HttpResponse:
    ProviderCall.objects.using("provider").create(key="thing")
    Charge.objects.create(account="consumer", amount=1, currency="EUR")
    response = HttpResponse("made", status=201)
    response["Location"] = "/things/a\x00b"
    return response


urlpatterns = [path("things/", create_thing)]


@override_settings(ROOT_URLCONF=__name__)
def test_a_nul_in_a_stored_header_is_not_storable_and_says_so(user: Any) -> None:
    client = Client()
    client.force_login(user)
    answer = client.post("/things/", {}, headers={"Idempotency-Key": "k-1"})
    assert answer.status_code == 500
    assert answer.json()["code"] == "idempotency_response_not_storable"
    assert ProviderCall.objects.using("provider").count() == 1
    assert Charge.objects.using("provider").count() == 0  # rolled back
    assert IdempotencyRecord.objects.count() == 0  # released
