"""``request.idempotency`` through every entry point: the context of a protected request,
``None`` for a request the entry point does not protect (★ Public API; docs/getting-started.md).

The plain decorator, DRF's ``@api_view`` over it, the DRF mixin and django-ninja (sync and
``async def``) follow one rule: a view that reads ``request.idempotency`` on a ``GET``, a
``PUT`` or a ``DELETE`` finds ``None`` and runs, whatever entry point protects its ``POST``.
Each view writes one charge saying what it found, so the tests count effects."""

from __future__ import annotations

import json

import pytest

from django_idempotency.models import IdempotencyRecord
from tests.helpers import needs_drf, needs_ninja, new_key
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.urls("tests.testapp.context_urls"),
]

UNPROTECTED = ["get", "put", "delete"]


def drf(path: str):
    return pytest.param(path, marks=needs_drf)


def ninja(path: str):
    return pytest.param(path, marks=needs_ninja)


@pytest.mark.parametrize(
    "path",
    [
        "/context/plain/",
        drf("/context/api-view/"),
        drf("/context/mixin/"),
        drf("/context/own-dispatch/"),
        ninja("/context/ninja/sync"),
    ],
)
@pytest.mark.parametrize("method", UNPROTECTED)
def test_an_unprotected_method_finds_none_on_every_entry_point(api, path, method):
    answer = getattr(api.client, method)(path)
    assert answer.status_code == 200, answer.content
    assert json.loads(answer.content) == {"context": "none"}
    assert list(Charge.objects.values_list("account", flat=True)) == ["none"]
    assert not IdempotencyRecord.objects.exists()


@needs_ninja
@pytest.mark.parametrize("method", ["get", "put"])
def test_an_unprotected_method_of_an_async_ninja_operation_finds_none(api, method):
    answer = getattr(api.client, method)("/context/ninja/async")
    assert answer.status_code == 200, answer.content
    assert json.loads(answer.content) == {"context": "none"}
    assert Charge.objects.count() == 1
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize(
    "path",
    [
        "/context/plain/",
        drf("/context/api-view/"),
        drf("/context/mixin/"),
        drf("/context/own-dispatch/"),
        ninja("/context/ninja/sync"),
    ],
)
def test_a_protected_request_finds_its_context_and_runs_once(api, user, path):
    key = new_key()
    first = api.post(path, {}, key=key)
    again = api.post(path, {}, key=key)
    assert first.status_code == again.status_code == 200, first.content
    assert json.loads(first.content) == {"context": f"user:{user.pk}"}
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
