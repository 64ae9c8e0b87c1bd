"""What each entry point costs in database connections, and that it never starves a pool.

Under ``ATOMIC_REQUESTS`` every protected HTTP entry point (the decorator, a class-based
view's method, the mixin, ``@api_view`` over ``@idempotent``, ninja sync and async) costs the
connections the same view costs unprotected: one. The product takes the protected request
out of the request's transaction and runs its own; unprotected methods keep the request's
transaction. ``run_once`` inside a caller's transaction claims on a connection that is never
drawn from the caller's pool (or on ``CLAIM_DATABASE``), and waits for it a bounded time.

Each test counts the connections opened (``connection_created``) and the effects
(``Charge`` rows), not only statuses.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.test import AsyncClient, Client

from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import needs_drf, needs_ninja, new_key, opened
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

ENTRIES = [
    "decorator",
    "cbv",
    pytest.param("mixin", marks=needs_drf),
    pytest.param("mixin-dispatch", marks=needs_drf),
    pytest.param("api-view", marks=needs_drf),
    pytest.param("ninja/sync", marks=needs_ninja),
]


def client(user: Any) -> Client:
    c = Client()
    c.force_login(user)
    return c


def url(entry: str) -> str:
    return f"/peek/{entry}" if entry.startswith("ninja/") else f"/peek/{entry}/"


def post(c: Client, entry: str, key: str) -> Any:
    return c.post(
        url(entry), "{}", content_type="application/json", headers={"Idempotency-Key": key}
    )


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_protected_request_under_atomic_requests_opens_no_second_connection(
    user, atomic_requests, entry
):
    c = client(user)
    post(c, entry, new_key())  # the caller's own connection is open from here on
    keys = [new_key() for _ in range(5)]
    with opened() as counts:
        answers = [post(c, entry, key) for key in keys]
        replays = [post(c, entry, key) for key in keys]
    assert [a.status_code for a in answers] == [201] * 5
    for first, again in zip(answers, replays, strict=True):
        assert again.content == first.content
        assert again["Idempotent-Replayed"] == "true"
        # The claim committed on its own before the view ran, in a transaction of its own.
        assert json.loads(first.content) == {"seen": True, "atomic": True}
    assert counts["default"] == 0
    assert Charge.objects.filter(account="peek").count() == 6
    assert set(IdempotencyRecord.objects.values_list("status", flat=True)) == {
        RecordStatus.COMPLETED
    }


@pytest.mark.parametrize("entry", ENTRIES)
def test_unprotected_methods_keep_atomic_requests(user, atomic_requests, entry):
    answer = client(user).get(url(entry))
    assert answer.status_code == 200
    assert json.loads(answer.content) == {"atomic": True}


@pytest.mark.parametrize("entry", ENTRIES)
def test_unprotected_methods_without_atomic_requests_run_as_django_runs_them(user, entry):
    answer = client(user).get(url(entry))
    assert json.loads(answer.content) == {"atomic": False}


@needs_ninja
def test_an_async_ninja_operation_runs_under_atomic_requests(user, atomic_requests):
    async def scenario() -> list[Any]:
        c = AsyncClient()
        await sync_to_async(c.force_login)(user)
        key = new_key()
        try:
            return [
                await c.post(
                    "/peek/ninja/async",
                    "{}",
                    content_type="application/json",
                    headers={"Idempotency-Key": key},
                )
                for _ in range(2)
            ]
        finally:
            await sync_to_async(connections.close_all)()

    first, again = asyncio.run(scenario())
    assert first.status_code == 201, first.content
    assert json.loads(first.content) == {"seen": True, "atomic": True}
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.filter(account="peek").count() == 1


def asgi_requests(user: Any, *requests: tuple[str, str, str | None]) -> list[Any]:
    """``(method, url, key)`` one after another through Django's ASGI test client."""

    async def scenario() -> list[Any]:
        c = AsyncClient()
        await sync_to_async(c.force_login)(user)
        try:
            answers = []
            for method, where, key in requests:
                headers = {} if key is None else {"Idempotency-Key": key}
                call = c.post if method == "POST" else c.get
                answers.append(
                    await call(where, "{}", content_type="application/json", headers=headers)
                    if method == "POST"
                    else await call(where)
                )
            return answers
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(scenario())


def test_resume_on_a_class_views_dispatch_runs_under_asgi_and_atomic_requests(
    user, atomic_requests
):
    key = new_key()
    first, again, unprotected = asgi_requests(
        user,
        ("POST", "/peek/cbv-dispatch-resume/", key),
        ("POST", "/peek/cbv-dispatch-resume/", key),
        ("GET", "/peek/cbv-dispatch-resume/", None),
    )
    assert first.status_code == 201, first.content
    # "resume" runs the body outside a transaction: each step commits as it finishes.
    assert json.loads(first.content) == {"seen": True, "atomic": False}
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert json.loads(unprotected.content) == {"atomic": True}
    assert Charge.objects.filter(account="peek").count() == 1


def test_resume_on_one_method_of_a_class_view_under_asgi_says_to_decorate_dispatch(
    user, atomic_requests
):
    # Where Django's ASGI handler cannot pass the request's method on before it wraps the
    # view in the request's transaction (before Django 6.1), a view that protects some of its
    # methods only stays in it: "resume" cannot run there, and the refusal names the way
    # out. Where it can, the protected request leaves the transaction and runs.
    refusal: ImproperlyConfigured | None = None
    try:
        (answer,) = asgi_requests(user, ("POST", "/peek/cbv-resume/", new_key()))
    except ImproperlyConfigured as raised:
        refusal = raised
    if refusal is not None:
        assert "dispatch" in str(refusal)
        assert Charge.objects.filter(account="peek").count() == 0
        assert not IdempotencyRecord.objects.exists()
    else:
        assert answer.status_code == 201, answer.content
        assert Charge.objects.filter(account="peek").count() == 1
