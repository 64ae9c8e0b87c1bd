"""``IdempotencyMixin``'s hooks as a view overrides them, and the requests it leaves alone.

A view's ``get_idempotency_account`` / ``_fingerprint`` / ``_operation`` that call the
mixin's own and add to it; a key source given to ``as_view()`` or written as a
``classmethod``; a ``dispatch`` of the view's own that never calls the mixin's; and a
method the view does not serve (DRF's ``405``), which claims nothing. Effects are counted:
the ``Charge`` rows the views write and the records stored.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

pytest.importorskip("rest_framework")  # the mixin is DRF's (tox's core env has no DRF)

from django.core.management import call_command
from django.urls import path, re_path
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import context_of, sources
from django_idempotency.drf import IdempotencyMixin
from django_idempotency.models import IdempotencyRecord
from tests.helpers import new_key
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]


class Charging(IdempotencyMixin, APIView):
    """Writes one ``Charge`` per run; answers with what the record is made of."""

    def post(self, request: Request) -> Response:
        Charge.objects.create(account=type(self).__name__, amount=1, currency="EUR")
        context = context_of(request)
        assert context is not None
        return Response({"account": context.account, "operation": context.operation}, 201)


class Extending(Charging):
    """Each hook calls the mixin's and adds to it."""

    def get_idempotency_account(self, request: Request) -> str | None:
        account = super().get_idempotency_account(request)
        return f"{account}:eu" if account else None

    fingerprinted = 0

    def get_idempotency_fingerprint(self, request: Request) -> str:
        type(self).fingerprinted += 1
        return super().get_idempotency_fingerprint(request)

    def get_idempotency_operation(self, request: Request) -> str:
        return f"{super().get_idempotency_operation(request)}:v2"


class ClassKey(Charging):
    @classmethod
    def idempotency_key(cls, request: Any) -> str | None:
        assert cls is ClassKey
        key: str | None = request.headers.get("X-Order")
        return key


class OwnDispatch(Charging):
    """A dispatch of the view's own that goes straight to DRF's."""

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return APIView.dispatch(self, request, *args, **kwargs)  # type: ignore[arg-type]

    def get(self, request: Request) -> Response:
        Charge.objects.create(account="own-dispatch-get", amount=1, currency="EUR")
        return Response({"got": True})


class PostOnly(Charging):
    idempotency_methods = ("POST", "PUT", "DELETE")
    http_method_names = ["post", "put", "options"]


urlpatterns = [
    path("extending/", Extending.as_view()),
    path("instance-key/", Charging.as_view(idempotency_key=sources.header("X-Order"))),
    path("class-key/", ClassKey.as_view()),
    path("own-dispatch/", OwnDispatch.as_view()),
    path("post-only/", PostOnly.as_view()),
    # Regex routes, as the audit reads them: escapes, nested and escaped groups, "/?".
    re_path(r"^legacy/(?P<order>[0-9]+(\.[0-9]+)?)\.json/?$", Charging.as_view()),
    re_path(r"^legacy/(?P<code>\(x\)(y)|z)/(?P<tail>(a\)b))$", Charging.as_view()),
]


def charges(view: type) -> int:
    return Charge.objects.filter(account=view.__name__).count()


def test_hooks_that_extend_the_mixins_own(api, user):
    key = new_key()
    Extending.fingerprinted = 0
    first = api.post("/extending/", {"amount": 1}, key=key)
    assert first.status_code == 201, first.content
    assert first.json() == {"account": f"user:{user.pk}:eu", "operation": "POST extending/:v2"}
    again = api.post("/extending/", {"amount": 1}, key=key)
    assert (again.status_code, again.content) == (201, first.content)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert charges(Charging) == 0
    assert Charge.objects.filter(account="Extending").count() == 1
    # The mixin's fingerprint, through the view's hook: another body is refused.
    changed = api.post("/extending/", {"amount": 2}, key=key)
    assert changed.status_code == 422
    assert Extending.fingerprinted == 3
    assert Charge.objects.filter(account="Extending").count() == 1
    (record,) = IdempotencyRecord.objects.all()
    assert (record.account, record.operation) == (f"user:{user.pk}:eu", "POST extending/:v2")


@pytest.mark.parametrize("route", ["/instance-key/", "/class-key/"])
def test_a_key_source_given_to_as_view_or_as_a_classmethod(api, route):
    key = new_key()
    first = api.post(route, {}, headers={"X-Order": key})
    assert first.status_code == 201, first.content
    again = api.post(route, {}, headers={"X-Order": key})
    assert again.headers["Idempotent-Replayed"] == "true"
    # The Idempotency-Key header is not this view's key: without X-Order it is refused.
    missing = api.post(route, {}, key=new_key())
    assert missing.status_code == 400
    assert Charge.objects.count() == 1
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == [key]


def test_a_dispatch_of_the_views_own_is_protected_all_the_same(api):
    key = new_key()
    assert api.post("/own-dispatch/", {}, key=key).status_code == 201
    assert api.post("/own-dispatch/", {}, key=key).headers["Idempotent-Replayed"] == "true"
    assert api.post("/own-dispatch/", {}).status_code == 400  # no key
    assert charges(OwnDispatch) == 1
    # A method it does not protect runs every time, without a key.
    assert [api.client.get("/own-dispatch/").status_code for _ in range(2)] == [200, 200]
    assert Charge.objects.filter(account="own-dispatch-get").count() == 2
    assert IdempotencyRecord.objects.count() == 1


@pytest.mark.parametrize("method", ["put", "delete"])
def test_a_protected_method_the_view_does_not_serve_claims_nothing(api, method):
    # PUT is one of its methods but it has no put(); DELETE is not among its methods.
    for _ in range(2):
        response = api.send(method, "/post-only/", {}, new_key())
        assert response.status_code == 405
    assert not IdempotencyRecord.objects.exists()
    assert api.post("/post-only/", {}, key=new_key()).status_code == 201
    assert (charges(PostOnly), IdempotencyRecord.objects.count()) == (1, 1)


def test_the_audit_names_each_views_operation_and_key_as_the_view_does():
    out = io.StringIO()
    call_command("idempotency_audit", "--format", "json", stdout=out)
    rows = {(e["method"], e["url"]): e for e in json.loads(out.getvalue())["endpoints"]}
    extending = rows[("POST", "/extending/")]
    assert (extending["protected"], extending["by"]) == (True, "mixin")
    # Its own get_idempotency_operation() names it: the audit says so, and calls nothing.
    assert extending["operation"] == "Extending.get_idempotency_operation()"
    assert rows[("POST", "/instance-key/")]["key"] == "X-Order header"
    assert {url for _, url in rows if url.startswith("/legacy/")} == {
        "/legacy/<order>.json/",
        "/legacy/<code>/<tail>",
    }
