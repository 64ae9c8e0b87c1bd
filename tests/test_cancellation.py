"""A protected ``async def`` view whose client disconnects never turns into a second run.

Under uvicorn, Django cancels an async view when its client goes away. The attempt then goes
on to its end, as a sync view's would, and its outcome is stored: the client's retry gets
it replayed. (Had the attempt been cancelled all the same, by a server shutting down, the
claim stays as a killed process's would, and the recovery policy decides when its lease
runs out: never a silent release.) The effects are counted: provider calls (a call without
a key would be made twice by a second run), the provider's charges and the local charges.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from django_idempotency import InProgress, OutcomeUnknown, run_once
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import needs_ninja, new_key, postgres_only
from tests.live import DISCONNECTED, request, uvicorn
from tests.testapp.models import Charge, ProviderCall, ProviderCharge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CHARGE = {"amount": 70, "currency": "EUR"}
# The view sleeps this long after the provider call; the client gives up after a second.
SLEEP = 3


@pytest.fixture(scope="module")
def asgi_server(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), uvicorn() as url:
        yield url


@postgres_only
@pytest.mark.parametrize(
    "path", ["/async/charges/", pytest.param("/ninja/async/charges", marks=needs_ninja)]
)
def test_a_disconnected_client_leaves_the_attempt_to_finish_and_its_retry_replays(
    asgi_server, user, path
):
    from tests.helpers import auth_headers

    headers = {**auth_headers(user, path), "Idempotency-Key": new_key()}
    dropped = request(
        asgi_server,
        "POST",
        path,
        CHARGE,
        {**headers, "X-Test": f"sleep-after-provider:{SLEEP}"},
        timeout=1,
    )
    assert dropped == DISCONNECTED
    deadline = time.monotonic() + SLEEP + 20
    record = IdempotencyRecord.objects.get()
    while record.status == RecordStatus.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.1)
        record.refresh_from_db()
    # The attempt finished after its client left, and stored its outcome.
    assert record.status == RecordStatus.COMPLETED
    retry = request(asgi_server, "POST", path, CHARGE, headers)
    assert retry.status == 201
    assert retry.replayed
    assert ProviderCall.objects.count() == 1
    assert ProviderCharge.objects.count() == 1
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("policy", ["retry", "fail"])
@pytest.mark.parametrize("ending", [asyncio.CancelledError, SystemExit, KeyboardInterrupt])
def test_an_attempt_ended_from_outside_keeps_its_claim_as_a_crash_would(policy, ending):
    """What ends an attempt from outside is no error of the body's, and no release: a
    cancellation that reaches the body (a server shutting down), ``SystemExit`` (Celery's
    pool process on SIGTERM, which billiard raises there; a server's worker told to quit),
    Ctrl-C as ``KeyboardInterrupt``. The claim stays in progress as a killed process's
    would, duplicates are refused, and after the lease the policy decides. Released, the
    next attempt ran the body again under ``"fail"``."""
    calls: list[str] = []
    identity = {"account": "worker", "operation": "mail.send", "key": "k-1", "recovery": policy}

    def ended() -> str:
        calls.append("sent")
        Charge.objects.create(account="worker", amount=1, currency="EUR")
        raise ending()

    with pytest.raises(ending):
        run_once(ended, **identity)
    record = IdempotencyRecord.objects.get()
    assert record.status == RecordStatus.IN_PROGRESS  # kept, not released
    assert Charge.objects.count() == 0  # its database work rolled back
    with pytest.raises(InProgress):
        run_once(lambda: "again", **identity)
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    if policy == "fail":
        with pytest.raises(OutcomeUnknown):
            run_once(lambda: "again", **identity)
    else:
        assert run_once(lambda: "again", **identity) == "again"
    assert calls == ["sent"]
