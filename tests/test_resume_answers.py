"""A resumable view (``recovery="resume"``) that answers a server error.

A 5xx is no outcome: nothing is stored, the steps the attempt recorded are kept and its
lease is given back at once, so the client's retry runs the view again at once and resumes
after those steps (each step's effect happens once). Counted: the view's runs, each step's
runs, the records and steps stored.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

from django_idempotency import step
from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord, IdempotencyStep, RecordStatus
from tests.helpers import new_key

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

RUNS: dict[str, int] = {}


def count(name: str) -> int:
    RUNS[name] = RUNS.get(name, 0) + 1
    return RUNS[name]


def shipping(request: HttpRequest) -> str:
    return "shipping"


@idempotent(recovery="resume", operation="parcels.ship", account=shipping)
def ship(request: HttpRequest) -> HttpResponse:
    count("view")
    label = step("label", count, "label")
    if count("carrier") == 1:
        return JsonResponse({"error": "the carrier is down"}, status=503)
    return JsonResponse({"label": label}, status=201)


urlpatterns = [path("ship/", ship)]


def post(client: Any, key: str) -> Any:
    return client.post("/ship/", {}, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key)


def test_a_server_error_keeps_the_steps_and_the_retry_resumes_after_them(client):
    RUNS.clear()
    key = new_key()
    assert post(client, key).status_code == 503
    # Nothing stored but the step: the record waits, its lease given back, for the retry.
    assert IdempotencyRecord.objects.get().status == RecordStatus.IN_PROGRESS
    assert list(IdempotencyStep.objects.values_list("name", flat=True)) == ["label"]
    retried = post(client, key)
    assert (retried.status_code, retried.json()) == (201, {"label": 1})
    replayed = post(client, key)
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert RUNS == {"view": 2, "label": 1, "carrier": 2}
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
