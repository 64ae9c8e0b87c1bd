"""The example project's rides (``POST /api/rides/``): an operation in three steps, counted by
its effects (rides, provider calls and charges, mails); a crash inside the charge step,
resumed; the demo's crash switch, which works only with ``DEBUG`` on; and
``example_project/demo_steps.py`` against a live server of the example project."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("rest_framework")
pytest.importorskip("drf_spectacular")
pytest.importorskip(
    "example_project.payments", reason="the example project is not here (tox tests the wheel)"
)

from django.core.exceptions import MiddlewareNotUsed
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory, override_settings
from rest_framework.test import APIRequestFactory, force_authenticate

from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from django_idempotency.testing import (
    assert_replay,
    crash_after,
    crash_before,
    expire_lease,
)
from example_project.payments import demo, rides
from example_project.payments.models import (
    ProviderCall,
    ProviderCharge,
    Ride,
    SentMail,
)
from tests.factories import UserFactory
from tests.helpers import Example, example_server
from tests.live import ROOT

BOOKING = {"origin": "Dock 1", "target": "Dock 9", "amount": 2400, "currency": "EUR"}


def book(user: Any, key: str, payload: dict[str, Any] | None = None) -> Any:
    request = APIRequestFactory().post(
        "/api/rides/", payload or BOOKING, format="json", HTTP_IDEMPOTENCY_KEY=key
    )
    force_authenticate(request, user)
    return rides.book_ride(request)


def effects() -> tuple[int, int, int, int]:
    """(rides, provider calls, provider charges, mails)."""
    return (
        Ride.objects.count(),
        ProviderCall.objects.count(),
        ProviderCharge.objects.count(),
        SentMail.objects.count(),
    )


@pytest.fixture
def user() -> Any:
    return UserFactory(email="rider@example.com")


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_booking_runs_each_step_once_and_is_replayed(user):
    key = str(uuid.uuid4())
    first = book(user, key)
    again = book(user, key)
    assert first.status_code == 201, first.content
    assert_replay(first, again)
    assert effects() == (1, 1, 1, 1)
    ride = Ride.objects.get()
    assert first.data == {
        "ride": ride.pk,
        "charge": ride.provider_charge_id,
        "receipt": SentMail.objects.get().pk,
    }
    assert SentMail.objects.get().recipient == "rider@example.com"
    assert ProviderCharge.objects.get().reference == ride.provider_charge_id
    names = IdempotencyStep.objects.order_by("created_at", "pk").values_list("name", flat=True)
    assert list(names) == ["ride", "charge", "receipt"]


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_crash_inside_the_charge_step_is_resumed_with_the_same_provider_key(user):
    key = str(uuid.uuid4())
    # Where the demo's switch crashes: after the provider charged and the ride was updated.
    with crash_after("example_project.payments.demo.crash_point"):
        book(user, key)
    # The ride committed with its step; the charge reached the provider, the ride's update
    # rolled back; nothing was mailed.
    assert effects() == (1, 1, 1, 0)
    assert Ride.objects.get().provider_charge_id == ""
    assert list(IdempotencyStep.objects.values_list("name", flat=True)) == ["ride"]
    expire_lease(key)
    resumed = book(user, key)
    assert resumed.status_code == 201
    assert_replay(resumed, book(user, key))
    assert effects() == (1, 2, 1, 1)
    assert ProviderCall.objects.values("key").distinct().count() == 1
    assert Ride.objects.get().provider_charge_id == resumed.data["charge"]
    assert IdempotencyRecord.objects.get().recovery_attempts == 1


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_crash_between_the_charge_and_the_receipt_charges_once_and_mails_once(user):
    key = str(uuid.uuid4())
    with crash_before("example_project.payments.rides.send_receipt"):
        book(user, key)
    assert effects() == (1, 1, 1, 0)
    expire_lease(key)
    assert book(user, key).status_code == 201
    # Both recorded steps were skipped: one provider call, one mail.
    assert effects() == (1, 1, 1, 1)


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_an_invalid_booking_is_a_400_with_no_effect(user):
    response = book(user, str(uuid.uuid4()), {**BOOKING, "amount": 0, "currency": "euro"})
    assert response.status_code == 400
    assert set(response.data) == {"amount", "currency"}
    assert effects() == (0, 0, 0, 0)
    assert not IdempotencyStep.objects.exists()


# -- the demo's crash switch ---------------------------------------------------------------


def passing(request: HttpRequest) -> HttpResponse:
    demo.crash_point("after-charge")
    return HttpResponse("ran")


@override_settings(DEBUG=False)
def test_the_crash_switch_refuses_to_load_without_debug():
    with pytest.raises(MiddlewareNotUsed, match="DEBUG"):
        demo.DemoCrashMiddleware(passing)


@override_settings(DEBUG=True)
@pytest.mark.parametrize(("header", "crashes"), [("after-charge", True), ("elsewhere", False)])
def test_the_crash_switch_crashes_only_where_asked(header, crashes):
    middleware = demo.DemoCrashMiddleware(passing)
    request = RequestFactory().post("/api/rides/", headers={demo.HEADER: header})
    if crashes:
        with pytest.raises(SimulatedCrash):
            middleware(request)
    else:
        assert middleware(request).content == b"ran"
    # Outside a request that asked, nothing crashes.
    demo.crash_point("after-charge")


def test_the_example_settings_install_the_switch_only_with_debug():
    code = (
        "import django; django.setup(); from django.conf import settings; "
        "print(settings.DEBUG, 'example_project.payments.demo.DemoCrashMiddleware' "
        "in settings.MIDDLEWARE)"
    )
    seen = {}
    for debug in ("0", "1"):
        env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "DJANGO_SETTINGS_MODULE": "example_project.settings",
            "EXAMPLE_DEBUG": debug,
        }
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, check=True, capture_output=True
        )
        seen[debug] = out.stdout.decode().split()
    assert seen == {"0": ["False", "False"], "1": ["True", "True"]}


# -- the demo script, against a live server ------------------------------------------------


def counted(served: Example) -> dict[str, int]:
    with sqlite3.connect(served.database) as db:
        return {
            table: int(db.execute(f"SELECT count(*) FROM payments_{table}").fetchone()[0])
            for table in ("ride", "providercall", "providercharge", "sentmail")
        }


def demo_steps(served: Example) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "example_project.demo_steps", "--url", served.url],
        env=served.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.fixture(scope="module")
def debug_example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Example]:
    """The example project with DEBUG on, as ``make demo`` serves it."""
    database = tmp_path_factory.mktemp("example-debug") / "db.sqlite3"
    with example_server(database, EXAMPLE_DEBUG="1", EXAMPLE_PROVIDER_LATENCY="0.1") as served:
        yield served


def test_the_demo_kills_a_booking_after_its_charge_and_resumes_it(debug_example):
    before = counted(debug_example)
    run = demo_steps(debug_example)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "dies after the charge  500" in run.stdout
    assert "OK: one ride, one charge" in run.stdout
    after = counted(debug_example)
    # One ride, one charge, one mail; two provider calls (the charge step ran again).
    assert {t: after[t] - before[t] for t in after} == {
        "ride": 1,
        "providercall": 2,
        "providercharge": 1,
        "sentmail": 1,
    }


def test_without_debug_the_header_crashes_nothing_and_the_demo_says_so(example):
    before = counted(example)
    run = demo_steps(example)
    assert run.returncode == 1
    assert "PROBLEM: the crashing request got 201" in run.stdout
    after = counted(example)
    assert {t: after[t] - before[t] for t in after} == {
        "ride": 1,
        "providercall": 1,
        "providercharge": 1,
        "sentmail": 1,
    }
