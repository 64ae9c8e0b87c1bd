"""Races through a real threaded server on PostgreSQL, each request on its own connection."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord, RecordStatus
from django_idempotency.testing import assert_replay, assert_single_execution, settle, storm
from tests.helpers import (
    auth_headers,
    needs_drf,
    needs_ninja,
    new_key,
    postgres_only,
    session_headers,
    wait_until,
    watching_polls,
)
from tests.live import basic_auth, request
from tests.testapp.models import Charge, ProviderCall, ProviderCharge

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

CHARGE = {"amount": 100, "currency": "EUR"}
WAIT = 30  # seconds: a bound on every wait for a request to reach a stage


def reached(path: Path) -> None:
    """Until the original's view touched ``path`` (``touch-<stage>:``): it holds its claim."""
    wait_until(path.exists, "the original to reach its gate", timeout=WAIT)


def lease_ran_out() -> None:
    """Until the (one) record's lease is over."""
    lease_end = IdempotencyRecord.objects.get().lease_expires_at
    assert lease_end is not None
    wait_until(lambda: timezone.now() > lease_end, "the original's lease to run out", timeout=WAIT)


@pytest.mark.parametrize(
    "path",
    [
        "/charges/",
        pytest.param("/api/charges/", marks=needs_drf),
        pytest.param("/api/fn-charges/", marks=needs_drf),
        pytest.param("/ninja/charges", marks=needs_ninja),
    ],
)
def test_storm_of_identical_requests_has_one_effect(live_server, user, path):
    rounds, n = 5, 16
    auth = auth_headers(user, path)
    for _ in range(rounds):
        headers = {**auth, "Idempotency-Key": new_key()}
        answers = storm(live_server.url, path, CHARGE, headers=headers, requests=n, timeout=30)
        statuses = sorted(a.status for a in answers)
        assert set(statuses) <= {201, 409}, statuses
        created = assert_single_execution(answers)  # the others: 409s or replays of it
        final = settle(live_server.url, path, CHARGE, headers=headers, timeout=30)
        assert_replay(created, final)
    assert Charge.objects.count() == rounds
    assert ProviderCharge.objects.count() == rounds
    assert IdempotencyRecord.objects.filter(status=RecordStatus.COMPLETED).count() == rounds


@needs_drf
def test_storm_with_a_changed_payload_in_the_mix(live_server, user):
    headers = {**basic_auth(user.username), "Idempotency-Key": new_key()}
    payloads = [CHARGE] * 8 + [{"amount": 1, "currency": "EUR"}] * 8
    barrier = threading.Barrier(len(payloads), timeout=10)

    def one(payload):
        barrier.wait()
        return request(live_server.url, "POST", "/api/charges/", payload, headers)

    with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
        answers = list(pool.map(one, payloads))
    assert sum(1 for a in answers if a.status == 201 and not a.replayed) == 1
    assert {a.status for a in answers} <= {201, 409, 422}
    assert Charge.objects.count() == 1
    assert ProviderCall.objects.count() == 1


@pytest.mark.parametrize("path", ["/charges/", pytest.param("/ninja/charges", marks=needs_ninja)])
def test_in_flight_duplicate_gets_a_prompt_409(live_server, user, path, tmp_path):
    """The original is held on a gate (a file it waits for, bounded) after its write."""
    headers = {**auth_headers(user, path), "Idempotency-Key": new_key()}
    started, gate = tmp_path / "started", tmp_path / "gate"
    held = {**headers, "X-Test": f"touch-after-write:{started},wait-after-write:{gate}"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        original = pool.submit(request, live_server.url, "POST", path, CHARGE, held)
        reached(started)
        duplicates = [request(live_server.url, "POST", path, CHARGE, headers) for _ in range(3)]
        assert not original.done()  # every duplicate was answered while the original held
        gate.touch()
        first = original.result(timeout=30)
    for duplicate in duplicates:
        assert duplicate.status == 409
        # The holder's lease left, in whole seconds (the lease is 60 s by default).
        assert 1 <= int(duplicate.headers["retry-after"]) <= 60
        assert duplicate.headers["content-type"] == "application/problem+json"
        assert duplicate.json()["code"] == "idempotency_key_in_use"
    assert first.status == 201
    assert ProviderCall.objects.count() == 1
    assert Charge.objects.count() == 1
    replay = request(live_server.url, "POST", path, CHARGE, headers)
    assert replay.replayed
    assert replay.body == first.body


def _original_and_waiting_duplicate(
    live_server: Any, headers: dict[str, str], tmp_path: Path, then: str
) -> tuple[Any, Any]:
    """An original held after its write (then ``then``, more ``X-Test`` directives) and a
    duplicate sent once it holds its claim; the original released once the duplicate is
    seen waiting for it. Their answers."""
    started, gate = tmp_path / "started", tmp_path / "gate"
    held = {**headers, "X-Test": f"touch-after-write:{started},wait-after-write:{gate}{then}"}
    with watching_polls() as polls, ThreadPoolExecutor(max_workers=2) as pool:
        original = pool.submit(request, live_server.url, "POST", "/charges/", CHARGE, held)
        reached(started)
        waiting = pool.submit(request, live_server.url, "POST", "/charges/", CHARGE, headers)
        polls.wait(timeout=WAIT)  # the duplicate waits for the original
        gate.touch()
        return original.result(timeout=30), waiting.result(timeout=30)


@override_settings(IDEMPOTENCY={"IN_PROGRESS_WAIT": 5})
def test_bounded_wait_turns_the_409_into_a_replay(live_server, user, tmp_path):
    headers = {**session_headers(user), "Idempotency-Key": new_key()}
    first, duplicate = _original_and_waiting_duplicate(live_server, headers, tmp_path, "")
    assert duplicate.status == 201
    assert duplicate.replayed
    assert duplicate.body == first.body
    assert Charge.objects.count() == 1


@override_settings(IDEMPOTENCY={"IN_PROGRESS_WAIT": 5})
def test_a_duplicate_waiting_on_an_original_that_failed_runs_the_view_itself(
    live_server, user, tmp_path
):
    headers = {**session_headers(user), "Idempotency-Key": new_key()}
    original, duplicate = _original_and_waiting_duplicate(
        live_server, headers, tmp_path, ",raise-after-write"
    )
    assert original.status == 500
    # The original's claim was released when it failed: the waiting duplicate claimed and ran.
    assert duplicate.status == 201
    assert not duplicate.replayed
    assert Charge.objects.count() == 1  # the original's write was rolled back
    assert request(live_server.url, "POST", "/charges/", CHARGE, headers).replayed


@override_settings(IDEMPOTENCY={"IN_PROGRESS_WAIT": 0.5})
def test_bounded_wait_never_exceeds_its_bound(live_server, user, tmp_path):
    headers = {**session_headers(user), "Idempotency-Key": new_key()}
    held_at, gate = tmp_path / "started", tmp_path / "gate"
    held = {**headers, "X-Test": f"touch-after-write:{held_at},wait-after-write:{gate}"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        original = pool.submit(request, live_server.url, "POST", "/charges/", CHARGE, held)
        reached(held_at)
        started = time.monotonic()
        duplicate = request(live_server.url, "POST", "/charges/", CHARGE, headers)
        waited = time.monotonic() - started
        gate.touch()
        assert duplicate.status == 409
        assert 0.5 <= waited < 2.0
        assert original.result(timeout=30).status == 201
    assert Charge.objects.count() == 1


def test_slow_original_that_lost_its_lease_cannot_commit(live_server, user, tmp_path):
    """Timeout after the provider call: the retry takes the stale lease over, the provider
    deduplicates by the downstream key, and the original's writes are rolled back."""
    headers = {**session_headers(user), "Idempotency-Key": new_key()}
    started, gate = tmp_path / "started", tmp_path / "gate"
    slow = {**headers, "X-Test": f"touch-after-provider:{started},wait-after-provider:{gate}"}
    path = "/charges/short-lease/"  # a 1-second lease
    with ThreadPoolExecutor(max_workers=1) as pool:
        original = pool.submit(request, live_server.url, "POST", path, CHARGE, slow)
        reached(started)
        lease_ran_out()  # the original is still held after its provider call
        retry = request(live_server.url, "POST", path, CHARGE, headers)
        gate.touch()
        assert retry.status == 201
        assert not retry.replayed
        late = original.result(timeout=30)
    assert late.status == 409
    assert late.json()["code"] == "idempotency_lease_lost"
    assert Charge.objects.count() == 1  # the original's write never committed
    assert ProviderCharge.objects.count() == 1  # charged once overall
    assert ProviderCall.objects.count() == 2  # called twice, with the same downstream key
    replay = request(live_server.url, "POST", path, CHARGE, headers)
    assert replay.replayed
    assert replay.body == retry.body
    record = IdempotencyRecord.objects.get()
    assert record.recovery_attempts == 1


def test_live_lease_is_never_taken_over(live_server, user, tmp_path):
    headers = {**session_headers(user), "Idempotency-Key": new_key()}
    started, gate = tmp_path / "started", tmp_path / "gate"
    held = {**headers, "X-Test": f"touch-after-provider:{started},wait-after-provider:{gate}"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        original = pool.submit(
            request, live_server.url, "POST", "/charges/short-lease/", CHARGE, held
        )
        # The duplicate goes as soon as the original holds its claim, within its 1 s lease.
        reached(started)
        duplicate = request(live_server.url, "POST", "/charges/short-lease/", CHARGE, headers)
        gate.touch()
        assert duplicate.status == 409
        assert original.result(timeout=30).status == 201
    assert Charge.objects.count() == 1
