"""A duplicate refused while its original runs is told the original's remaining lease,
bounded by ``RETRY_AFTER_MAX`` where it is set: the ``409``'s ``Retry-After`` and
``InProgress.retry_after``."""

from __future__ import annotations

from datetime import timedelta

import pytest

from django_idempotency import InProgress, run_once
from django_idempotency.models import IdempotencyRecord
from tests.helpers import make_in_progress, new_key
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")
CHARGE = {"amount": 1, "currency": "EUR"}
IDENTITY = {"account": "consumer:shipping", "operation": "orders.ship"}


def running_original(api, lease_left: timedelta) -> str:
    """A key whose original request is running with ``lease_left`` of its lease."""
    key = new_key()
    assert api.post("/charges/", CHARGE, key=key).status_code == 201
    make_in_progress(key, lease_left)
    return key


@pytest.mark.parametrize(
    ("lease_left", "expected"),
    [
        (timedelta(seconds=30), {29, 30}),  # the whole seconds left, rounded up
        (timedelta(milliseconds=200), {1}),  # never 0
        (timedelta(minutes=10), {599, 600}),  # unbounded by default
    ],
    ids=["30 s left", "under a second", "ten minutes left"],
)
def test_a_409_tells_the_seconds_left_of_the_original_lease(api, lease_left, expected):
    key = running_original(api, lease_left)
    response = api.post("/charges/", CHARGE, key=key)
    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_key_in_use"
    assert int(response["Retry-After"]) in expected
    assert Charge.objects.count() == 1  # the duplicate ran nothing


def test_the_bound_is_a_setting(api, settings):
    settings.IDEMPOTENCY = {"RETRY_AFTER_MAX": 5, "RETRY_AFTER": 2}
    key = running_original(api, timedelta(seconds=30))
    response = api.post("/charges/", CHARGE, key=key)
    assert (response.status_code, response["Retry-After"]) == (409, "5")
    assert Charge.objects.count() == 1


def test_a_503_keeps_its_own_retry_after(api, settings):
    # RETRY_AFTER stays what a 503 (nothing ran) is told; it does not bound the 409.
    settings.IDEMPOTENCY = {"RETRY_AFTER": 7}
    key = running_original(api, timedelta(seconds=30))
    assert int(api.post("/charges/", CHARGE, key=key)["Retry-After"]) in {29, 30}


@pytest.mark.parametrize(
    ("bound", "lease_left", "expected"),
    [
        (20, timedelta(seconds=45), {20}),
        (20, timedelta(seconds=12), {11, 12}),
        (None, timedelta(minutes=5), {299, 300}),  # no bound by default, however long
    ],
    ids=["bounded", "under the bound", "unbounded by default"],
)
def test_in_progress_is_bounded_the_same_way(settings, bound, lease_left, expected):
    settings.IDEMPOTENCY = {"RETRY_AFTER_MAX": bound}
    calls: list[str] = []

    def work() -> str:
        calls.append("ran")
        return "done"

    run_once(work, **IDENTITY, key="k")
    make_in_progress("k", lease_left)
    with pytest.raises(InProgress) as refused:
        run_once(work, **IDENTITY, key="k")
    assert refused.value.retry_after in expected
    assert calls == ["ran"]
    assert IdempotencyRecord.objects.count() == 1


@pytest.mark.parametrize("value", [0, -1, "60", 1.5, True, timedelta(seconds=60)])
def test_a_wrong_bound_is_a_check_error(settings, value):
    from django.core import checks

    settings.IDEMPOTENCY = {"RETRY_AFTER_MAX": value}
    ids = [message.id for message in checks.run_checks()]
    assert "django_idempotency.E019" in ids
