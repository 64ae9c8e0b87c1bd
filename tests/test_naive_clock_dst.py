"""Under ``USE_TZ = False`` Django's clock is naive local time, which skips an hour when
daylight saving time begins: a TTL or a lease added to it as wall-clock time is an hour
short of its length across the change. Each test moves ``django.utils.timezone.now`` (the
application's clock, never the database's) across the change of ``America/New_York`` on
2027-03-14 and counts the effects."""

from __future__ import annotations

import zoneinfo
from collections.abc import Iterator
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import InProgress, run_once
from django_idempotency.models import IdempotencyRecord
from tests.helpers import ApiClient, new_key
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

UTC = dt_timezone.utc  # datetime.UTC is Python 3.11's
ZONE = "America/New_York"
CHARGE = {"amount": 5, "currency": "EUR"}
# 03:00 EST on the eve of the change: 23 hours of real time later it is 03:00 EDT.
BEFORE = datetime(2027, 3, 13, 8, 0, tzinfo=UTC)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[datetime]]:
    """The application's clock: the last instant of the list, as Django's ``now`` gives it
    under ``USE_TZ = False`` (naive, local time in ``TIME_ZONE``)."""
    moments = [BEFORE]

    def now() -> datetime:
        return moments[-1].astimezone(zoneinfo.ZoneInfo(ZONE)).replace(tzinfo=None)

    with override_settings(USE_TZ=False, TIME_ZONE=ZONE):
        monkeypatch.setattr(timezone, "now", now)
        yield moments


def test_a_retry_within_the_ttl_across_the_change_is_replayed_not_run_again(user, clock):
    api = ApiClient(user)  # logged in on the moved clock
    key = new_key()
    assert api.post("/charges/", CHARGE, key=key).status_code == 201
    clock.append(BEFORE + timedelta(hours=23, minutes=30))  # within the default TTL of 24 h
    again = api.post("/charges/", CHARGE, key=key)
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.count() == 1


def test_run_once_within_its_ttl_across_the_change_runs_once(clock):
    calls: list[str] = []

    def body() -> str:
        calls.append("ran")
        return "done"

    identity = {"account": "a", "operation": "op", "key": "dst", "ttl": timedelta(hours=2)}
    clock.append(datetime(2027, 3, 14, 6, 30, tzinfo=UTC))  # 01:30 EST
    assert run_once(body, **identity) == "done"
    clock.append(datetime(2027, 3, 14, 7, 45, tzinfo=UTC))  # 03:45 EDT: 75 minutes later
    assert run_once(body, **identity) == "done"
    assert calls == ["ran"]


def test_a_live_lease_across_the_change_is_not_taken_over(clock):
    calls: list[str] = []
    identity = {"account": "a", "operation": "op", "key": "lease", "lease": timedelta(minutes=30)}
    clock.append(datetime(2027, 3, 14, 6, 50, tzinfo=UTC))  # 01:50 EST

    def retry() -> str:
        calls.append("retry")
        return "retry"

    def first() -> str:
        calls.append("first")
        clock.append(datetime(2027, 3, 14, 7, 5, tzinfo=UTC))  # 03:05 EDT: 15 minutes on
        # A retry while the first attempt still runs, 15 minutes into its 30-minute lease.
        with pytest.raises(InProgress):
            run_once(retry, **identity)
        return "first"

    assert run_once(first, **identity) == "first"
    assert calls == ["first"]


def test_an_enqueue_once_window_across_the_change_holds_its_length(clock):
    # unique_until=timedelta(hours=2) from 01:00 EST: the key is held until 04:00 EDT, two
    # hours of real time later (as wall-clock time, 03:00 EDT: one hour).
    from django_idempotency import outbox
    from django_idempotency.models import OutboxMessage, OutboxUniqueKey

    clock.append(datetime(2027, 3, 14, 6, 0, tzinfo=UTC))  # 01:00 EST
    with transaction.atomic():
        first = outbox.enqueue_once("nightly", "tests.send", unique_until=timedelta(hours=2))
    clock.append(datetime(2027, 3, 14, 7, 30, tzinfo=UTC))  # 03:30 EDT: 1 h 30 min later
    with transaction.atomic():
        again = outbox.enqueue_once("nightly", "tests.send", unique_until=timedelta(hours=2))
    assert again == first
    assert OutboxMessage.objects.count() == 1
    assert OutboxUniqueKey.objects.get().held_until == datetime(2027, 3, 14, 4, 0)
