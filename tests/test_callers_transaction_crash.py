"""Real crashes (SIGKILL) inside an operation whose caller holds a transaction.

A process that dies after its external call, inside ``run_once`` under
``transaction.atomic()`` or inside a view that Django wraps in ``ATOMIC_REQUESTS`` (DRF's
``@api_view`` over ``@idempotent``, ninja, a plain view calling ``run_once`` or a task):
its transaction is gone, its claim is not. After the lease, ``"fail"`` answers "outcome
unknown" and never runs the operation again; ``"retry"`` runs it once more with the same
downstream key.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from django_idempotency import OutcomeUnknown, current, run_once
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key, postgres_only
from tests.live import DISCONNECTED, ROOT, basic_auth, gunicorn, request, server_env
from tests.testapp import txn_views
from tests.testapp.models import Charge, ProviderCall

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

WAIT = 60

ENTRIES = ["decorator", "run-once"] + (["task"] if txn_views.HAS_CELERY else [])
if settings.HAS_DRF:
    ENTRIES += ["mixin", "api-view"]
if settings.HAS_NINJA:
    ENTRIES += ["ninja"]


def end_lease() -> None:
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_run_once_inside_atomic_killed_after_its_external_call(policy):
    process = subprocess.run(
        [sys.executable, "-m", "tests.once_worker", "m-atomic", policy, "atomic"],
        cwd=ROOT,
        env=server_env({}),
        timeout=WAIT,
        capture_output=True,
        text=True,
    )
    assert process.returncode == -9, process.stderr
    # The claim committed on its own before the callable ran; the callable's writes did not.
    assert IdempotencyRecord.objects.get().status == RecordStatus.IN_PROGRESS
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 1
    end_lease()

    def ship_again() -> str:
        context = current()
        assert context is not None
        ProviderCall.objects.using("provider").create(key=context.downstream_key("provider"))
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        return "shipped"

    identity = {"account": "consumer:shipping", "operation": "orders.ship", "key": "m-atomic"}
    if policy == "fail":
        with pytest.raises(OutcomeUnknown):
            run_once(ship_again, **identity, recovery=policy)
        assert ProviderCall.objects.count() == 1  # never run again
        assert Charge.objects.count() == 0
        assert IdempotencyRecord.objects.get().status == RecordStatus.FAILED
    else:
        assert run_once(ship_again, **identity, recovery=policy) == "shipped"
        keys = list(ProviderCall.objects.values_list("key", flat=True))
        assert len(keys) == 2
        assert len(set(keys)) == 1  # the same downstream key both times
        assert Charge.objects.count() == 1


@pytest.fixture(scope="module")
def atomic_server(django_db_setup, django_db_blocker):
    """gunicorn with ATOMIC_REQUESTS on: every view runs in the request's transaction."""
    with django_db_blocker.unblock(), gunicorn(extra_env={"TEST_ATOMIC_REQUESTS": "1"}) as url:
        yield url


@pytest.mark.parametrize("policy", ["retry", "fail"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_view_under_atomic_requests_killed_after_its_external_call(
    atomic_server, user, entry, policy
):
    client = Client()
    client.force_login(user)
    headers = {
        # A session for the plain views, HTTP Basic for DRF and ninja (no CSRF token here).
        "Cookie": f"sessionid={client.cookies['sessionid'].value}",
        **basic_auth(user.username),
        "Idempotency-Key": new_key(),
    }
    path = f"/txn/{entry}/{policy}/"
    assert request(atomic_server, "POST", path, {}, {**headers, "X-Test": "kill"}) is DISCONNECTED
    assert IdempotencyRecord.objects.get().status == RecordStatus.IN_PROGRESS
    assert ProviderCall.objects.count() == 1
    early = request(atomic_server, "POST", path, {}, headers)
    assert early.status == 409  # the dead attempt's lease still runs
    end_lease()
    answer = request(atomic_server, "POST", path, {}, headers)
    if policy == "fail":
        assert answer.status == 500, answer.body
        assert json.loads(answer.body)["code"] == "idempotency_outcome_unknown"
        assert ProviderCall.objects.count() == 1  # the provider was called once, ever
        assert Charge.objects.count() == 0
        assert IdempotencyRecord.objects.get().status == RecordStatus.FAILED
    else:
        assert answer.status == 201, answer.body
        assert ProviderCall.objects.count() == 2
        assert len(set(ProviderCall.objects.values_list("key", flat=True))) == 1
        assert Charge.objects.count() == 1
    again = request(atomic_server, "POST", path, {}, headers)
    assert again.status == answer.status
    assert ProviderCall.objects.count() == (1 if policy == "fail" else 2)
