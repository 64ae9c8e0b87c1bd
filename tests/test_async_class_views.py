"""``method_decorator(idempotent, name="dispatch")`` on a class whose handlers are
``async def``: the shape the README recommends for class-based views.

Django's ``View.dispatch`` is a plain function that returns the async handler's coroutine.
Before this was handled the decorator ran the engine on that coroutine: every request
answered 500 (``SynchronousOnlyOperation`` under ASGI, "'coroutine' object has no attribute
..." under WSGI) while the audit called the view protected. It now protects the view as it
protects an ``async def`` function view: one run per key, the retry replayed.
"""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.test import AsyncClient, Client

pytest.importorskip("rest_framework")

from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key
from tests.test_async import run
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.urls("tests.testapp.shapes_urls"),
]

PATHS = {
    "/payouts/": "async_payout",
    "/refunds/async/": "async_refund",
    # The decorator first in method_decorator's list, above csrf_exempt's plain function.
    "/refunds/async/listed/": "async_listed",
    "/notes/async/": "async_note",  # the decorator on the handler: protected already
}


@pytest.mark.parametrize("path", PATHS)
def test_under_asgi_one_key_runs_once_and_the_retry_is_replayed(user, path):
    client = AsyncClient()
    client.force_login(user)
    key = new_key()

    async def scenario():
        return [
            await client.post(
                path, {}, content_type="application/json", headers={"Idempotency-Key": key}
            )
            for _ in range(2)
        ]

    first, retry = run(scenario())
    assert (first.status_code, retry.status_code) == (201, 201)
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.filter(account=PATHS[path]).count() == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


@pytest.mark.parametrize("path", PATHS)
def test_under_wsgi_one_key_runs_once_and_the_retry_is_replayed(user, path):
    client = Client()
    client.force_login(user)
    key = new_key()
    answers = [
        client.post(path, {}, content_type="application/json", headers={"Idempotency-Key": key})
        for _ in range(2)
    ]
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[1].content == answers[0].content
    assert Charge.objects.filter(account=PATHS[path]).count() == 1


def test_a_missing_key_is_refused_and_get_is_untouched(user):
    client = Client()
    client.force_login(user)
    assert client.post("/payouts/", {}, content_type="application/json").status_code == 400
    assert client.get("/payouts/").json() == {"payouts": 0}
    assert not Charge.objects.exists()
    assert not IdempotencyRecord.objects.exists()


def test_listed_first_under_asgi_get_passes_by_and_a_missing_key_is_refused(user):
    # The unprotected GET awaits what csrf_exempt's plain function hands back, on the event
    # loop; the POST without its key is refused before anything runs.
    client = AsyncClient()
    client.force_login(user)

    async def scenario():
        got = await client.get("/refunds/async/listed/")
        posted = await client.post("/refunds/async/listed/", {}, content_type="application/json")
        return got, posted

    got, posted = run(scenario())
    assert (got.status_code, got.json()) == (200, {"refunds": 0})
    assert posted.status_code == 400
    assert not Charge.objects.exists()
    assert not IdempotencyRecord.objects.exists()


def test_the_audit_lists_them_as_protected_and_they_are(user):
    out = io.StringIO()
    call_command("idempotency_audit", "--format", "json", stdout=out)
    rows = {
        e["url"]: (e["protected"], e["operation"])
        for e in json.loads(out.getvalue())["endpoints"]
        if e["url"] in PATHS and e["method"] == "POST"
    }
    assert rows == {
        "/payouts/": (True, "POST payouts/"),
        "/refunds/async/": (True, "refunds.async"),
        "/refunds/async/listed/": (True, "refunds.async-listed"),
        "/notes/async/": (True, "notes.async"),
    }
    assert IdempotencyRecord.objects.filter(operation="POST payouts/").count() == 0
