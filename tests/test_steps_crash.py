"""A resumable operation killed (SIGKILL, a real process) at every boundary, then resumed.

The operation (``tests/testapp/steps.py``): a ride (a local write), a charge through the
fake provider with ``downstream_key("charge")``, a receipt (an external call without
idempotency), each a step. After the kill and the retry: the ride is written exactly once;
the charge and the receipt are called once, or twice where the process died inside that
step (the charge with the same downstream key both times, so the provider charged once);
and the final answer is replayed byte for byte afterwards. For a view (gunicorn) and for
``run_once`` (a subprocess).
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from django_idempotency import run_once
from django_idempotency.models import IdempotencyRecord, IdempotencyStep, RecordStatus
from tests.helpers import new_key, postgres_only
from tests.live import DISCONNECTED, ROOT, gunicorn, request, server_env
from tests.testapp.models import Charge, ProviderCall, ProviderCharge
from tests.testapp.steps import INSIDE, STAGES, book

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

WAIT = 60


def end_lease() -> None:
    IdempotencyRecord.objects.filter(status=RecordStatus.IN_PROGRESS).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


def assert_effects(stage: str) -> None:
    """Every step's local writes once; every external call once, twice where it died."""
    died_in = INSIDE.get(stage)
    assert Charge.objects.filter(account="ride").count() == 1
    charge_calls = ProviderCall.objects.exclude(key__startswith="receipt:")
    assert charge_calls.count() == (2 if died_in == "charge" else 1)
    assert len(set(charge_calls.values_list("key", flat=True))) == 1  # one downstream key
    assert ProviderCharge.objects.count() == 1  # the provider charged once
    receipts = ProviderCall.objects.filter(key__startswith="receipt:")
    assert receipts.count() == (2 if died_in == "receipt" else 1)
    assert sorted(IdempotencyStep.objects.values_list("name", flat=True)) == [
        "charge",
        "receipt",
        "ride",
    ]
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), gunicorn(workers=2) as url:
        yield url


@pytest.mark.parametrize("stage", STAGES)
def test_a_view_killed_at_each_boundary_resumes(server, user, stage):
    client = Client()
    client.force_login(user)
    headers = {
        "Cookie": f"sessionid={client.cookies['sessionid'].value}",
        "Idempotency-Key": new_key(),
    }
    died = request(server, "POST", "/steps/book/", {}, {**headers, "X-Test": f"kill:{stage}"})
    assert died is DISCONNECTED
    end_lease()
    answer = request(server, "POST", "/steps/book/", {}, headers)
    assert answer.status == 201, answer.body
    assert answer.replayed == (stage == "after-commit")
    assert_effects(stage)
    replay = request(server, "POST", "/steps/book/", {}, headers)
    assert replay.replayed
    assert replay.status == 201
    assert replay.body == answer.body
    assert replay.headers["content-type"] == answer.headers["content-type"]
    assert_effects(stage)


@pytest.mark.parametrize("stage", STAGES)
def test_run_once_killed_at_each_boundary_resumes(stage):
    key = new_key()
    process = subprocess.run(
        [sys.executable, "-m", "tests.steps_worker", key, stage],
        cwd=ROOT,
        env=server_env({}),
        timeout=WAIT,
        capture_output=True,
        text=True,
    )
    assert process.returncode == -9, process.stderr
    end_lease()
    identity = {"account": "consumer:rides", "operation": "rides.book", "key": key}
    result = run_once(book, **identity, recovery="resume")
    assert set(result) == {"ride", "charge"}
    assert_effects(stage)
    stored = bytes(IdempotencyRecord.objects.get().response_body or b"")
    assert run_once(book, **identity, recovery="resume") == result
    assert bytes(IdempotencyRecord.objects.get().response_body or b"") == stored
    assert json.loads(stored) == result
    assert_effects(stage)
