import pytest

from tests.conftest import new_key
from tests.testapp.models import Charge, ProviderCharge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def test_first_then_replay(api):
    key = new_key()
    first = api.post("/charges/", {"amount": 100, "currency": "EUR"}, key=key)
    second = api.post("/charges/", {"currency": "EUR", "amount": 100}, key=key)
    assert first.status_code == 201, first.content
    assert second.status_code == 201
    assert second.content == first.content
    assert second["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert ProviderCharge.objects.count() == 1


def test_drf(api):
    key = new_key()
    first = api.post("/api/charges/", {"amount": 100, "currency": "EUR"}, key=key)
    second = api.post("/api/charges/", {"amount": 100, "currency": "EUR"}, key=key)
    assert first.status_code == 201, first.content
    assert second.content == first.content
    third = api.post("/api/fn-charges/", {"amount": 100, "currency": "EUR"}, key=key)
    assert third.status_code == 201, third.content
    assert Charge.objects.count() == 2
