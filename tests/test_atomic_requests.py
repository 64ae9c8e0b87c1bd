"""ATOMIC_REQUESTS = True: protected views still claim visibly and commit atomically."""

from __future__ import annotations

import json

import pytest

from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import needs_drf, new_key
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def test_claim_is_committed_before_the_view_runs(api, atomic_requests):
    response = api.post("/peek/", {}, key=new_key())
    body = json.loads(response.content)
    # Another connection saw the claim while the view ran, inside its own transaction.
    assert body == {"seen": RecordStatus.IN_PROGRESS, "atomic": True}
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


def test_without_atomic_requests_the_view_still_runs_in_a_transaction(api):
    body = json.loads(api.post("/peek/", {}, key=new_key()).content)
    assert body == {"seen": RecordStatus.IN_PROGRESS, "atomic": True}


def test_unprotected_requests_keep_atomic_requests(api, atomic_requests):
    assert json.loads(api.client.get("/peek/").content) == {"atomic": True}


def test_unprotected_requests_without_atomic_requests(api):
    assert json.loads(api.client.get("/peek/").content) == {"atomic": False}


@needs_drf
def test_drf_handled_exception_rolls_back_writes_and_stores_the_answer(api, atomic_requests):
    key = new_key()
    headers = {"X-Tenant": "t"}
    first = api.post("/api/custom/", {"fail": True}, key=key, headers=headers)
    assert first.status_code == 400
    # DRF marked the transaction for rollback: the view's write is gone, the answer is kept.
    assert Charge.objects.count() == 0
    retry = api.post("/api/custom/", {"fail": True}, key=key, headers=headers)
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 0


@needs_drf
def test_drf_success_under_atomic_requests(api, atomic_requests):
    key = new_key()
    first = api.post("/api/charges/", {"amount": 3, "currency": "EUR"}, key=key)
    retry = api.post("/api/charges/", {"amount": 3, "currency": "EUR"}, key=key)
    assert first.status_code == 201
    assert retry.content == first.content
    assert Charge.objects.count() == 1
