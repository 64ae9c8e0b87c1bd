"""A server process killed mid-request: after the lease, the retry recovers per policy.

These run a real multi-process server (gunicorn) on the PostgreSQL test database and kill
the worker with SIGKILL from inside the view at a chosen stage.
"""

from __future__ import annotations

import time

import pytest
from django.test import Client
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key, postgres_only
from tests.live import DISCONNECTED, gunicorn, request
from tests.testapp.models import Charge, ProviderCall, ProviderCharge

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

CHARGE = {"amount": 250, "currency": "EUR"}


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), gunicorn(workers=2) as url:
        yield url


def session_headers(user):
    client = Client()
    client.force_login(user)
    return {"Cookie": f"sessionid={client.cookies['sessionid'].value}"}


def crash(server, path, headers, stage):
    answer = request(server, "POST", path, CHARGE, {**headers, "X-Test": f"kill-{stage}"})
    assert answer is DISCONNECTED
    record = IdempotencyRecord.objects.get()
    assert record.status == RecordStatus.IN_PROGRESS
    return record


def wait_for_lease(record):
    remaining = (record.lease_expires_at - record.created_at).total_seconds()
    time.sleep(remaining + 0.3)


def retry_until_answered(server, path, headers, attempts=50):
    for _ in range(attempts):
        answer = request(server, "POST", path, CHARGE, headers)
        if answer.status not in (0, 409):
            return answer
        time.sleep(0.1)
    raise AssertionError("no answer")


@pytest.mark.parametrize("stage", ["start", "after-provider", "after-write"])
def test_retry_policy_runs_again_with_one_effect(server, user, stage):
    headers = {**session_headers(user), "Idempotency-Key": new_key()}
    path = "/charges/short-lease/"
    record = crash(server, path, headers, stage)
    # Before the lease runs out the record is still owned: the retry gets a 409.
    early = request(server, "POST", path, CHARGE, headers)
    if early.status == 409:
        wait_for_lease(record)
        answer = retry_until_answered(server, path, headers)
    else:
        # On a loaded machine the one-second lease can be over before this retry reaches the
        # server: then it took the lease over, as any retry after the lease does.
        assert record.lease_expires_at is not None
        assert timezone.now() >= record.lease_expires_at
        answer = early
    assert answer.status == 201
    assert not answer.replayed
    assert Charge.objects.count() == 1
    assert ProviderCharge.objects.count() == 1  # the provider deduplicated by downstream key
    replay = request(server, "POST", path, CHARGE, headers)
    assert replay.replayed
    assert replay.body == answer.body
    assert IdempotencyRecord.objects.get().recovery_attempts == 1


def test_fail_policy_never_runs_twice(server, user):
    headers = {**session_headers(user), "Idempotency-Key": new_key()}
    path = "/charges/fail-policy/"
    record = crash(server, path, headers, "after-provider")
    wait_for_lease(record)
    answer = retry_until_answered(server, path, headers)
    assert answer.status == 500
    assert answer.json()["code"] == "idempotency_outcome_unknown"
    again = request(server, "POST", path, CHARGE, headers)
    assert again.status == 500
    assert again.body == answer.body
    assert again.replayed
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 1  # the crashed attempt's call, never repeated
    assert IdempotencyRecord.objects.get().status == RecordStatus.FAILED


def test_callable_policy_can_answer(server, user):
    headers = {**session_headers(user), "Idempotency-Key": "known-" + new_key()}
    path = "/charges/callable-policy/"
    record = crash(server, path, headers, "after-provider")
    wait_for_lease(record)
    answer = retry_until_answered(server, path, headers)
    assert answer.status == 200
    assert answer.json() == {"recovered": headers["Idempotency-Key"]}
    assert request(server, "POST", path, CHARGE, headers).body == answer.body
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 1


def test_callable_policy_returning_none_retries(server, user):
    headers = {**session_headers(user), "Idempotency-Key": "unknown-" + new_key()}
    path = "/charges/callable-policy/"
    record = crash(server, path, headers, "after-provider")
    wait_for_lease(record)
    answer = retry_until_answered(server, path, headers)
    assert answer.status == 201
    assert Charge.objects.count() == 1
    assert ProviderCharge.objects.count() == 1


def test_callable_policy_answering_5xx_leaves_the_record_to_it(server, user):
    headers = {**session_headers(user), "Idempotency-Key": "down-" + new_key()}
    path = "/charges/callable-policy/"
    record = crash(server, path, headers, "after-provider")
    wait_for_lease(record)
    answer = retry_until_answered(server, path, headers)
    assert answer.status == 503
    # Not stored for replay, and not released either: its lease given back, so the next
    # retry asks the callable again rather than running the view (it did: a second call).
    assert IdempotencyRecord.objects.get().status == RecordStatus.IN_PROGRESS
    again = request(server, "POST", path, CHARGE, headers)
    assert again.status == 503
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 1  # the crashed attempt's call, never repeated
