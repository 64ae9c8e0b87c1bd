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


# -- when daylight saving time ends: the clock repeats an hour ----------------------------------
# On 2027-11-07 at 06:00 UTC (02:00 EDT) New York's clocks go back to 01:00 EST: every
# reading from 01:00 to 02:00 comes twice, and a naive time cannot say which it is.


def test_a_live_lease_that_ends_in_the_repeated_hour_is_not_taken_over_before_it(clock):
    calls: list[str] = []
    identity = {"account": "a", "operation": "op", "key": "fall", "lease": timedelta(minutes=30)}
    clock.append(datetime(2027, 11, 7, 5, 50, tzinfo=UTC))  # 01:50 EDT: the lease ends 01:20 EST

    def retry() -> str:
        calls.append("retry")
        return "retry"

    def first() -> str:
        calls.append("first")
        clock.append(datetime(2027, 11, 7, 5, 55, tzinfo=UTC))  # 01:55 EDT: 5 minutes on
        with pytest.raises(InProgress):
            run_once(retry, **identity)
        return "first"

    assert run_once(first, **identity) == "first"
    assert calls == ["first"]
    assert IdempotencyRecord.objects.get().status == "completed"


def test_a_record_whose_ttl_ends_in_the_repeated_hour_is_replayed_until_then(clock):
    calls: list[str] = []

    def body() -> str:
        calls.append("ran")
        return "done"

    identity = {"account": "a", "operation": "op", "key": "fall-ttl", "ttl": timedelta(hours=1)}
    clock.append(datetime(2027, 11, 7, 5, 10, tzinfo=UTC))  # 01:10 EDT: the TTL ends 01:10 EST
    assert run_once(body, **identity) == "done"
    clock.append(datetime(2027, 11, 7, 5, 15, tzinfo=UTC))  # 01:15 EDT: 5 minutes later
    assert run_once(body, **identity) == "done"
    clock.append(datetime(2027, 11, 7, 5, 59, tzinfo=UTC))  # 01:59 EDT: 49 minutes later
    assert run_once(body, **identity) == "done"
    assert calls == ["ran"]
    assert IdempotencyRecord.objects.count() == 1


@pytest.mark.parametrize(
    ("zone", "claimed"),
    [
        # 01:55 BST; at 01:00 UTC London goes back to 01:00 GMT, an offset of zero.
        ("Europe/London", datetime(2027, 10, 31, 0, 55, tzinfo=UTC)),
        # 01:55 (+11); at 15:00 UTC Lord Howe Island goes back half an hour, to 01:30 (+10:30).
        ("Australia/Lord_Howe", datetime(2027, 4, 3, 14, 55, tzinfo=UTC)),
    ],
)
def test_a_lease_ending_in_a_repeated_reading_of_any_zone_holds_to_its_end(
    zone: str, claimed: datetime, monkeypatch: pytest.MonkeyPatch
):
    moments = [claimed]
    monkeypatch.setattr(
        timezone,
        "now",
        lambda: moments[-1].astimezone(zoneinfo.ZoneInfo(zone)).replace(tzinfo=None),
    )
    calls: list[str] = []
    identity = {"account": "a", "operation": "op", "key": zone, "lease": timedelta(minutes=10)}

    def retry() -> str:
        calls.append("retry")
        return "retry"

    def first() -> str:
        calls.append("first")
        moments.append(claimed + timedelta(minutes=2))  # 01:57, before the clock goes back
        with pytest.raises(InProgress):
            run_once(retry, **identity)
        return "first"

    with override_settings(USE_TZ=False, TIME_ZONE=zone):
        assert run_once(first, **identity) == "first"
    assert calls == ["first"]


def test_an_enqueue_once_window_ending_in_the_repeated_hour_holds_to_its_end(clock):
    from django_idempotency import outbox
    from django_idempotency.models import OutboxMessage

    window = {"unique_until": timedelta(minutes=10)}
    clock.append(datetime(2027, 11, 7, 5, 55, tzinfo=UTC))  # 01:55 EDT: held until 01:05 EST
    with transaction.atomic():
        first = outbox.enqueue_once("nightly", "tests.send", **window)
    clock.append(datetime(2027, 11, 7, 5, 57, tzinfo=UTC))  # 01:57 EDT: 2 minutes later
    with transaction.atomic():
        again = outbox.enqueue_once("nightly", "tests.send", **window)
    assert again == first
    assert OutboxMessage.objects.count() == 1
