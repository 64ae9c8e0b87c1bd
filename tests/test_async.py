"""``@idempotent`` on ``async def`` views, in-process and under a real ASGI server (uvicorn)."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections
from django.test import AsyncClient
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import needs_ninja, new_key, postgres_only, wait_until
from tests.live import request, uvicorn
from tests.testapp import views
from tests.testapp.models import Charge, ProviderCharge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CHARGE = {"amount": 70, "currency": "EUR"}

# The async Django view, and an async ninja operation (with a 201 schema and ninja's rendering).
PATHS = ["/async/charges/", pytest.param("/ninja/async/charges", marks=needs_ninja)]


@pytest.fixture
def async_client(user):
    client = AsyncClient()
    client.force_login(user)
    return client


def run(coroutine):
    """Runs a scenario, then closes the connections its requests opened.

    The async test client keeps them open (it disconnects close_old_connections), and they
    live in the scenario's context, out of reach of the test's own thread.
    """

    async def scenario():
        try:
            return await coroutine
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(scenario())


async def post(client, payload, key, path="/async/charges/"):
    return await client.post(
        path,
        payload,
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )


@pytest.mark.parametrize("path", PATHS)
def test_async_view_runs_once_and_replays(async_client, path):
    key = new_key()

    async def scenario():
        first = await post(async_client, CHARGE, key, path)
        retry = await post(async_client, CHARGE, key, path)
        other = await post(async_client, {"amount": 1, "currency": "EUR"}, key, path)
        return first, retry, other

    first, retry, other = run(scenario())
    assert first.status_code == 201
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert retry["Content-Type"] == first["Content-Type"]
    assert retry.get("Location") == first.get("Location")
    assert other.status_code == 422
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/async/charges/", {**CHARGE, "fail": True}),
        # The ninja operation raises HttpError(500) after its write for this amount.
        pytest.param("/ninja/async/charges", {**CHARGE, "amount": 500}, marks=needs_ninja),
    ],
)
def test_async_view_5xx_rolls_back_its_async_writes(async_client, path, payload):
    key = new_key()
    response = run(post(async_client, payload, key, path))
    assert response.status_code == 500
    assert Charge.objects.count() == 0  # the acreate() ran inside the engine's transaction
    assert not IdempotencyRecord.objects.exists()


WHERE = ["/async/where/", "/async/where/class/"]  # a function view; a class's dispatch


def where(async_client, method, key=None, path="/async/where/"):
    """``method`` on an ``async def`` view that notes its task; its answer and whether it
    ran in the caller's own task (the test's)."""
    views.ASYNC_TASKS.clear()

    async def scenario():
        headers = {"Idempotency-Key": key} if key else {}
        response = await getattr(async_client, method)(path, headers=headers)
        return response, asyncio.current_task()

    response, task = run(scenario())
    assert len(views.ASYNC_TASKS) == 1
    return response, views.ASYNC_TASKS[0] is task


@pytest.mark.parametrize("path", WHERE)
def test_an_unprotected_method_of_an_async_view_stays_in_its_task(async_client, path):
    # A GET is none of the engine's: the view runs as it would undecorated, in the caller's
    # task, with no hop into the engine's thread and back, and outside any transaction. It
    # finds request.idempotency None, as the docs say of an unprotected request.
    response, in_its_task = where(async_client, "get", path=path)
    assert response.status_code == 200
    assert json.loads(response.content) == {"atomic": False, "context": None}
    assert in_its_task
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize("path", WHERE)
def test_a_key_on_an_unprotected_method_claims_nothing(async_client, path):
    response, in_its_task = where(async_client, "get", key=new_key(), path=path)
    assert response.status_code == 200
    assert json.loads(response.content) == {"atomic": False, "context": None}
    assert in_its_task
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize("path", WHERE)
def test_a_protected_method_of_an_async_view_runs_in_the_engines_transaction(async_client, path):
    response, in_its_task = where(async_client, "post", key=new_key(), path=path)
    assert response.status_code == 201
    assert json.loads(response.content) == {"atomic": True, "context": "set"}
    assert not in_its_task  # run from the engine's thread, back on the event loop
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


@pytest.mark.parametrize("path", WHERE)
def test_an_unprotected_method_of_an_async_view_keeps_atomic_requests(async_client, path):
    # Under ATOMIC_REQUESTS the engine runs an unprotected request in the project's
    # transaction, as it does for a sync view (Django itself wraps no async view).
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        response, _ = where(async_client, "get", path=path)
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False
    assert response.status_code == 200
    assert json.loads(response.content) == {"atomic": True, "context": None}


@pytest.fixture(scope="module")
def asgi_server(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), uvicorn() as url:
        yield url


@postgres_only
@pytest.mark.parametrize("path", PATHS)
def test_async_storm_under_uvicorn_has_one_effect(asgi_server, user, path):
    from tests.helpers import auth_headers

    rounds, n = 3, 16
    for _ in range(rounds):
        headers = {**auth_headers(user, path), "Idempotency-Key": new_key()}
        barrier = threading.Barrier(n, timeout=10)

        def one(_, barrier=barrier, headers=headers):
            barrier.wait()
            return request(asgi_server, "POST", path, CHARGE, headers)

        with ThreadPoolExecutor(max_workers=n) as pool:
            answers = list(pool.map(one, range(n)))
        statuses = [a.status for a in answers]
        assert set(statuses) <= {201, 409}, statuses
        assert sum(1 for a in answers if a.status == 201 and not a.replayed) == 1
    assert Charge.objects.count() == rounds
    assert ProviderCharge.objects.count() == rounds


@postgres_only
def test_async_slow_original_loses_its_lease_under_uvicorn(asgi_server, user, tmp_path):
    """The async path is fenced like the sync one: a takeover wins, the original rolls back."""
    from tests.helpers import session_headers

    headers = {**session_headers(user), "Idempotency-Key": new_key()}
    path = "/async/charges/short-lease/"  # a 1-second lease
    started, gate = tmp_path / "started", tmp_path / "gate"
    held = {**headers, "X-Test": f"touch-after-provider:{started},wait-after-provider:{gate}"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(request, asgi_server, "POST", path, CHARGE, held)
        # Not a fixed pause: the original holds its claim, held after its provider call,
        # and its lease has run out.
        wait_until(started.exists, "the original to call the provider", timeout=30)
        lease_end = IdempotencyRecord.objects.get().lease_expires_at
        assert lease_end is not None
        wait_until(lambda: timezone.now() > lease_end, "the original's lease to run out", 30)
        retry = request(asgi_server, "POST", path, CHARGE, headers)
        gate.touch()
        late = pending.result(timeout=30)
    assert retry.status == 201
    assert late.status == 409
    assert late.json()["code"] == "idempotency_lease_lost"
    assert Charge.objects.count() == 1
    assert ProviderCharge.objects.count() == 1
