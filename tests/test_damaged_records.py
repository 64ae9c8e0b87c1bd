"""A completed record whose stored headers were damaged (by hand, by another program) is
never answered with a ``500`` nor replayed wrongly: like one no key opens, it is treated as
expired, and the request runs afresh (one more effect, and a replay from then on)."""

from __future__ import annotations

import json

import pytest

from django_idempotency.models import IdempotencyRecord
from tests.conftest import new_key
from tests.factories import store_raw_json
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CHARGE = {"amount": 5, "currency": "EUR"}

DAMAGE = {
    "a-dict": {"Content-Type": "application/json"},
    "a-number": 42,
    "a-flat-list": ["Content-Type", "application/json"],
    "a-triple": [["Content-Type", "application/json", "x"]],
    "a-non-string-value": [["Content-Type", 7]],
}


@pytest.mark.parametrize("damage", list(DAMAGE.values()), ids=list(DAMAGE))
def test_a_record_with_damaged_headers_runs_afresh(api, damage):
    key = new_key()
    first = api.post("/charges/", CHARGE, key=key)
    assert first.status_code == 201
    record = IdempotencyRecord.objects.get()
    store_raw_json(IdempotencyRecord, record.pk, "response_headers", json.dumps(damage))
    again = api.post("/charges/", CHARGE, key=key)
    assert again.status_code == 201
    assert again.get("Idempotent-Replayed") is None  # ran afresh, not a wrong replay
    assert Charge.objects.count() == 2
    replay = api.post("/charges/", CHARGE, key=key)
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == again.content
    assert Charge.objects.count() == 2
