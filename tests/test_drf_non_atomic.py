"""A DRF view under ``IdempotencyMixin`` that opts out of ``ATOMIC_REQUESTS`` keeps its
choice for the requests the mixin does not protect (the engine opened the transaction for
them all the same), and one view's choice is never another's: ``as_view()`` gives each view
function marks of its own, where every mixin view once shared the class's.

The Django views' side is tests/test_opt_out_and_misdecorated.py.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("rest_framework")  # the mixin is DRF's (tox's core env has no DRF)

from django.db import connection, transaction
from django.test import Client, override_settings
from django.urls import path
from django.utils.decorators import method_decorator
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.drf import IdempotencyMixin
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]


class Charges(IdempotencyMixin, APIView):
    idempotency_operation = "non-atomic.charges"

    def answer(self, request: Request, status: int) -> Response:
        Charge.objects.create(account="non-atomic", amount=1, currency="EUR")
        return Response({"atomic": connection.in_atomic_block}, status=status)

    def get(self, request: Request) -> Response:
        return self.answer(request, 200)

    def post(self, request: Request) -> Response:
        return self.answer(request, 201)


class OwnDispatch(Charges):
    @method_decorator(transaction.non_atomic_requests)
    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return super().dispatch(request, *args, **kwargs)


@method_decorator(transaction.non_atomic_requests, name="dispatch")
class OutByName(Charges):
    """The mixin's dispatch, decorated by name: method_decorator copies the attributes of
    the method it decorates last, over those its decorators set."""


urlpatterns = [
    path("out/", transaction.non_atomic_requests(Charges.as_view())),
    path("kept/", Charges.as_view()),
    path("own-dispatch/", OwnDispatch.as_view()),
    path("out-by-name/", OutByName.as_view()),
]


@pytest.fixture
def client(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize("url", ["/out/", "/own-dispatch/", "/out-by-name/"])
def test_a_mixin_views_own_non_atomic_requests_is_kept_for_its_unprotected_requests(
    atomic_requests, client, url
):
    assert client.get(url).json() == {"atomic": False}  # as without the mixin
    posted = client.post(url, headers={"Idempotency-Key": new_key()})
    assert posted.status_code == 201
    assert posted.json() == {"atomic": True}  # the engine's transaction
    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


def test_one_views_opt_out_is_not_anothers(atomic_requests, client):
    # The same class served twice: the view function wrapped in non_atomic_requests in the
    # URLconf, and the plain one, which keeps the request's transaction.
    assert client.get("/kept/").json() == {"atomic": True}
    assert client.get("/out/").json() == {"atomic": False}


@override_settings(IDEMPOTENCY={"REQUIRED": False})
@pytest.mark.parametrize(
    ("url", "atomic"), [("/out/", False), ("/own-dispatch/", False), ("/kept/", True)]
)
def test_a_request_without_a_key_where_keys_are_optional_runs_as_without_the_mixin(
    atomic_requests, client, url, atomic
):
    # No key, keys optional: no claim, and the view's own choice stands (the engine opened
    # the ATOMIC_REQUESTS transaction for it all the same, once).
    posted = client.post(url)
    assert posted.status_code == 201
    assert posted.json() == {"atomic": atomic}
    assert Charge.objects.count() == 1
    assert not IdempotencyRecord.objects.exists()
