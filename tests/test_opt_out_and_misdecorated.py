"""Two shapes beside the engine's own transaction, each once a defect:

- A view's own ``@transaction.non_atomic_requests`` is kept under ``@idempotent`` for the
  requests it does not protect: the engine opened the ``ATOMIC_REQUESTS`` transaction for
  them all the same (sync and ``async def`` alike). Beneath the decorator or above it.
- ``@idempotent`` straight on a handler of a class-based view (not through
  ``method_decorator``) answered 500 on every request while ``idempotency_audit`` listed the
  endpoint as protected: it is refused where it is written, when the class is made.

The DRF mixin's side of the first is tests/test_drf_non_atomic.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import AsyncClient, Client, RequestFactory, override_settings
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]


def answer(request: HttpRequest) -> HttpResponse:
    Charge.objects.create(account="opt-out", amount=1, currency="EUR")
    status = 201 if request.method == "POST" else 200
    return JsonResponse({"atomic": connection.in_atomic_block}, status=status)


@idempotent
@transaction.non_atomic_requests
def out_beneath(request: HttpRequest) -> HttpResponse:
    return answer(request)


@transaction.non_atomic_requests
@idempotent
def out_above(request: HttpRequest) -> HttpResponse:
    return answer(request)


@idempotent
def kept(request: HttpRequest) -> HttpResponse:
    return answer(request)


#: The task each request of ``async_out`` ran in.
TASKS: list[asyncio.Task[object] | None] = []


@idempotent
@transaction.non_atomic_requests
async def async_out(request: HttpRequest) -> HttpResponse:
    TASKS.append(asyncio.current_task())
    return await sync_to_async(answer)(request)


@method_decorator([idempotent, never_cache], name="dispatch")
class ListOnDispatch(View):
    # method_decorator with a list, @idempotent first: the decorators after it wrap the
    # method bound to its view, and functools.wraps gives their function the method's name
    # and signature (its first parameter self). It is no method: it takes a request.
    def post(self, request: HttpRequest) -> HttpResponse:
        return answer(request)


class ListOnTheHandler(View):
    @method_decorator([idempotent, csrf_exempt])
    def post(self, request: HttpRequest) -> HttpResponse:
        return answer(request)


urlpatterns = [
    path("out-beneath/", out_beneath),
    path("out-above/", out_above),
    path("kept/", kept),
    path("async-out/", async_out),
    path("list-on-dispatch/", ListOnDispatch.as_view()),
    path("list-on-the-handler/", ListOnTheHandler.as_view()),
]


@pytest.mark.parametrize("url", ["/out-beneath/", "/out-above/"])
def test_a_views_own_non_atomic_requests_is_kept_for_its_unprotected_requests(
    atomic_requests, user, url
):
    client = Client()
    client.force_login(user)
    assert client.get(url).json() == {"atomic": False}  # as undecorated
    # Its protected requests run in the engine's transaction, as every protected one does.
    posted = client.post(url, headers={"Idempotency-Key": new_key()})
    assert posted.status_code == 201
    assert posted.json() == {"atomic": True}
    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


@override_settings(IDEMPOTENCY={"REQUIRED": False})
@pytest.mark.parametrize(
    ("url", "atomic"), [("/out-beneath/", False), ("/out-above/", False), ("/kept/", True)]
)
def test_a_request_without_a_key_where_keys_are_optional_runs_as_undecorated(
    atomic_requests, user, url, atomic
):
    # A POST without a key, keys optional: no claim, the view runs as it would undecorated,
    # out of the request's transaction where the view opted out. Once a defect: the engine
    # opened the ATOMIC_REQUESTS transaction for it all the same.
    client = Client()
    client.force_login(user)
    posted = client.post(url)
    assert posted.status_code == 201
    assert posted.json() == {"atomic": atomic}
    assert Charge.objects.count() == 1
    assert not IdempotencyRecord.objects.exists()


def test_a_view_that_does_not_opt_out_keeps_the_requests_transaction(atomic_requests):
    assert Client().get("/kept/").json() == {"atomic": True}
    assert Charge.objects.count() == 1


def test_an_async_views_own_non_atomic_requests_is_kept_and_takes_no_hop(atomic_requests):
    TASKS.clear()

    async def scenario() -> tuple[HttpResponse, asyncio.Task[object] | None]:
        try:
            response = await AsyncClient().get("/async-out/")
            return response, asyncio.current_task()
        finally:
            await sync_to_async(connections.close_all)()

    response, task = asyncio.run(scenario())
    assert json.loads(response.content) == {"atomic": False}
    assert [task] == TASKS  # awaited as it stands: no transaction to open for it
    assert Charge.objects.count() == 1
    assert not IdempotencyRecord.objects.exists()


def sync_handler() -> type[View]:
    class Misdecorated(View):
        @idempotent
        def post(self, request: HttpRequest) -> HttpResponse:
            return answer(request)

    return Misdecorated


def async_handler() -> type[View]:
    class AsyncMisdecorated(View):
        @idempotent
        async def post(self, request: HttpRequest) -> HttpResponse:
            return await sync_to_async(answer)(request)

    return AsyncMisdecorated


def with_arguments() -> type[View]:
    class MisdecoratedWithArguments(View):
        @idempotent(operation="charges.create", methods=["POST"])
        def post(self, request: HttpRequest) -> HttpResponse:
            return answer(request)

    return MisdecoratedWithArguments


def beneath_another() -> type[View]:
    class MisdecoratedAboveAnother(View):
        @idempotent
        @login_required
        def post(self, request: HttpRequest) -> HttpResponse:
            return answer(request)

    return MisdecoratedAboveAnother


def beneath_classmethod() -> type:
    class Views:
        # Its first argument would be the class: every request answered 500 (an
        # AttributeError in the engine) while the audit listed the endpoint protected.
        @classmethod
        @idempotent
        def create(cls, request: HttpRequest) -> HttpResponse:
            return answer(request)

    return Views


@pytest.mark.parametrize(
    ("shape", "name"),
    [
        (beneath_classmethod, "Views.create"),
        (sync_handler, "Misdecorated.post"),
        (async_handler, "AsyncMisdecorated.post"),
        (with_arguments, "MisdecoratedWithArguments.post"),
        (beneath_another, "MisdecoratedAboveAnother.post"),
    ],
)
def test_idempotent_straight_on_a_handler_is_refused_where_it_is_written(shape, name):
    # Its first argument would be the view, not a request: every request would answer 500
    # while the audit listed the endpoint protected. Refused when the class is made, saying
    # how to write it.
    with pytest.raises(ImproperlyConfigured, match=r"method_decorator\(idempotent") as refused:
        shape()
    assert name in str(refused.value)


def test_the_ways_to_write_it_on_a_class_based_view_are_accepted():
    # method_decorator on the handler or on dispatch hands the decorator the method bound to
    # its view (tests/test_async_class_views.py sends them keys); a function in a class's
    # body that takes a request is a function view.
    class OnTheHandler(View):
        @method_decorator(idempotent)
        def post(self, request: HttpRequest) -> HttpResponse:
            return answer(request)

    @method_decorator(idempotent(operation="charges.create"), name="dispatch")
    class OnDispatch(View):
        def post(self, request: HttpRequest) -> HttpResponse:
            return answer(request)

    class Views:
        @staticmethod
        @idempotent
        def create(request: HttpRequest) -> HttpResponse:
            return answer(request)

    request = RequestFactory().get("/")
    assert OnTheHandler.as_view()(request).status_code == 405  # no get: Django's answer
    assert OnDispatch.as_view()(request).status_code == 405
    assert json.loads(Views.create(request).content) == {"atomic": False}
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("url", ["/list-on-dispatch/", "/list-on-the-handler/"])
def test_method_decorator_with_a_list_that_puts_idempotent_first_protects(user, url):
    # Once a defect: the function of the decorator beneath @idempotent, copied from the
    # bound method by functools.wraps, was taken for a method written in a class's body,
    # and every request answered 500 (ImproperlyConfigured, saying to use method_decorator).
    client = Client()
    client.force_login(user)
    key = new_key()
    first = client.post(url, headers={"Idempotency-Key": key})
    replay = client.post(url, headers={"Idempotency-Key": key})
    assert (first.status_code, replay.status_code) == (201, 201)
    assert replay["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
