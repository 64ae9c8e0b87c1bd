"""One view function's opt-out of ``ATOMIC_REQUESTS`` is not another's.

``@idempotent`` puts its marks (``_non_atomic_requests``, an ``IdempotencyDatabase``) on
the function it returns, and everything that copies a view's ``__dict__`` copies the one
object: ``functools.wraps`` (``csrf_exempt``, ``login_required``) and, for
``method_decorator(idempotent, name="dispatch")``, the class's dispatch and every view
function ``as_view()`` makes of it. ``@transaction.non_atomic_requests`` around one of them
in the URLconf added the alias to that shared object, and opted the view's other routes out
too (their ``GET`` ran out of the request's transaction). The marks now refuse an alias
(``IdempotencyDatabase.add``), and Django gives the function it decorates a set of its own,
as it does without the package.
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key, opened
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.urls(__name__),
]


def answer(request: HttpRequest) -> HttpResponse:
    Charge.objects.create(account="shared-marks", amount=1, currency="EUR")
    return JsonResponse({"atomic": connection.in_atomic_block})


@method_decorator(idempotent, name="dispatch")
class Charges(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return answer(request)


@method_decorator(idempotent, name="dispatch")
class Refunds(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return answer(request)


@method_decorator(transaction.non_atomic_requests, name="dispatch")
class RefundsOut(Refunds):
    """At each request, method_decorator applies non_atomic_requests to the bound dispatch,
    whose __dict__ functools.wraps copied from Refunds's: it adds to Refunds's marks."""


@idempotent
def charges(request: HttpRequest) -> HttpResponse:
    return answer(request)


urlpatterns = [
    path("class/kept/", Charges.as_view()),
    path("class/out/", transaction.non_atomic_requests(Charges.as_view())),
    path("parent/", Refunds.as_view()),
    path("subclass-out/", RefundsOut.as_view()),
    path("function/kept/", charges),
    path("function/out/", transaction.non_atomic_requests(csrf_exempt(charges))),
    path("other-out/", transaction.non_atomic_requests(using="provider")(csrf_exempt(charges))),
]


@pytest.mark.parametrize("shape", ["class", "function"])
def test_one_routes_opt_out_is_not_anothers(atomic_requests, shape):
    client = Client()
    assert client.get(f"/{shape}/out/").json() == {"atomic": False}
    assert client.get(f"/{shape}/kept/").json() == {"atomic": True}  # as without the package
    assert Charge.objects.count() == 2


def test_a_subclass_opt_out_is_never_its_parents(atomic_requests):
    # method_decorator applies non_atomic_requests to the bound dispatch at every request,
    # whose __dict__ functools.wraps copied from the parent's: it added to the parent's
    # marks, and the parent's GET lost its transaction from the subclass's first request on.
    # (The subclass's own opt-out is lost, as Django's method_decorator copies the decorated
    # method's attributes last, here the parent's dispatch's: wrap its view function in the
    # URLconf instead, docs/getting-started.md.)
    client = Client()
    assert client.get("/parent/").json() == {"atomic": True}
    assert client.get("/subclass-out/").json() == {"atomic": True}
    assert client.get("/parent/").json() == {"atomic": True}
    assert Charge.objects.count() == 3


def test_an_opt_out_of_another_database_keeps_the_protected_requests_out(atomic_requests, user):
    # The view function's own set ({"provider"}) replaced the marks: Django would wrap its
    # protected requests in the request's transaction on the idempotency database. The
    # request-time marking takes them back out, and a GET keeps the transaction.
    client = Client()
    client.force_login(user)
    client.get("/other-out/")  # the request's own connection is open from here on
    with opened() as counts:
        posted = [client.post("/other-out/", headers={"Idempotency-Key": new_key()})]
        posted += [client.post("/other-out/", headers={"Idempotency-Key": new_key()})]
    assert [p.status_code for p in posted] == [200, 200]
    assert all(p.json() == {"atomic": True} for p in posted)  # the engine's transaction
    # No claim on a second connection, as a claim inside the request's transaction takes.
    assert counts["default"] == 0
    assert IdempotencyRecord.objects.filter(status=RecordStatus.COMPLETED).count() == 2
    assert client.get("/other-out/").json() == {"atomic": True}
    assert Charge.objects.count() == 4
