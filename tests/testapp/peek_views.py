"""One body behind every HTTP entry point, for the tests of connections and transactions.

Each protected ``POST`` reports whether another connection sees its claim while it runs
(``seen``), whether it runs inside a transaction (``atomic``), and writes one ``Charge``
(account ``peek``): the effect the tests count. Each ``GET`` is unprotected and reports
whether it runs inside a transaction, which ``ATOMIC_REQUESTS`` must still give it.

``urlpatterns`` (included under ``peek/``): ``decorator/``, ``cbv/`` (a class-based view
whose ``post`` alone carries ``method_decorator(idempotent)``), and where DRF and ninja are
installed ``mixin/``, ``api-view/``, ``ninja/`` (a plain ninja ``GET`` beside a protected
``POST``) and ``ninja/async`` (an ``async def`` operation).
"""

from __future__ import annotations

import asyncio
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View

from django_idempotency import IdempotencyError, InProgress, StoreUnavailable, current, run_once
from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge


def peek(request: Any) -> dict[str, Any]:
    """What the body reports, and its effect on a protected request. With ``X-Burst`` (the
    burst tests, which count connections) it opens no connection of its own to look."""
    if request.method == "GET":
        return {"atomic": connection.in_atomic_block}
    context = current()
    assert context is not None
    seen = "X-Burst" in request.headers or (
        IdempotencyRecord.objects.using("provider")
        .filter(account=context.account, operation=context.operation, key=context.key)
        .exists()
    )
    Charge.objects.create(account="peek", amount=1, currency="EUR")
    return {"seen": seen, "atomic": connection.in_atomic_block}


def answer(request: HttpRequest) -> HttpResponse:
    return JsonResponse(peek(request), status=200 if request.method == "GET" else 201)


@idempotent(operation="peek.decorator")
def decorator_view(request: HttpRequest) -> HttpResponse:
    return answer(request)


class CbvView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return answer(request)

    @method_decorator(idempotent(operation="peek.cbv"))
    def post(self, request: HttpRequest) -> HttpResponse:
        return answer(request)


class CbvResumeView(CbvView):
    """``"resume"`` on ``post`` alone: under ASGI the view stays in ``ATOMIC_REQUESTS``'s
    transaction (the request's method cannot reach Django's wrapping), where the policy's
    steps could not commit as they finish."""

    @method_decorator(idempotent(operation="peek.cbv-resume", recovery="resume"))
    def post(self, request: HttpRequest) -> HttpResponse:
        return answer(request)


@method_decorator(idempotent(operation="peek.cbv-dispatch-resume", recovery="resume"), "dispatch")
class CbvDispatchResumeView(View):
    """The same under ``"resume"``, on ``dispatch``: every method reaches the engine, so the
    view leaves ``ATOMIC_REQUESTS``'s transaction under ASGI too."""

    def get(self, request: HttpRequest) -> HttpResponse:
        return answer(request)

    def post(self, request: HttpRequest) -> HttpResponse:
        return answer(request)


def run_once_view(request: HttpRequest) -> HttpResponse:
    """Unprotected: calls ``run_once`` with the request's key, inside whatever transaction
    the request is in (``ATOMIC_REQUESTS``)."""

    def body() -> dict[str, Any]:
        Charge.objects.create(account="peek", amount=1, currency="EUR")
        return {"atomic": connection.in_atomic_block}

    try:
        result = run_once(
            body, account="consumer:peek", operation="peek.run-once",
            key=request.headers["Idempotency-Key"],
        )  # fmt: skip
    except IdempotencyError as exc:
        code = {InProgress: 409, StoreUnavailable: 503}.get(type(exc), 500)
        return JsonResponse({"code": type(exc).__name__}, status=code)
    return JsonResponse(result, status=201)


urlpatterns: list[Any] = [
    path("decorator/", decorator_view),
    path("cbv/", CbvView.as_view()),
    path("cbv-resume/", CbvResumeView.as_view()),
    path("cbv-dispatch-resume/", CbvDispatchResumeView.as_view()),
    path("run-once/", run_once_view),
]

if settings.HAS_DRF:
    from rest_framework.decorators import api_view
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from django_idempotency.drf import IdempotencyMixin

    def drf_answer(request: Request) -> Response:
        return Response(peek(request), status=200 if request.method == "GET" else 201)

    class MixinView(IdempotencyMixin, APIView):
        idempotency_operation = "peek.mixin"

        def get(self, request: Request) -> Response:
            return drf_answer(request)

        def post(self, request: Request) -> Response:
            return drf_answer(request)

    class MixinDispatchView(MixinView):
        """The mixin first, and a ``dispatch`` of the view's own (logging, tracing): its
        function carries no mark of the mixin's ``dispatch``."""

        idempotency_operation = "peek.mixin-dispatch"

        def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            return super().dispatch(request, *args, **kwargs)

    @api_view(["GET", "POST"])
    @idempotent(operation="peek.api-view")
    def api_view_view(request: Request) -> Response:
        return drf_answer(request)

    urlpatterns += [
        path("mixin/", MixinView.as_view()),
        path("mixin-dispatch/", MixinDispatchView.as_view()),
        path("api-view/", api_view_view),
    ]

if settings.HAS_NINJA:
    from ninja import NinjaAPI, Schema
    from ninja.security import django_auth

    from django_idempotency.ninja import idempotent as ninja_idempotent
    from tests.testapp.ninja_api import BasicAuth

    api = NinjaAPI(urls_namespace="peek-ninja", auth=[BasicAuth(), django_auth])

    class Peeked(Schema):
        seen: bool
        atomic: bool

    @api.get("/sync")
    def ninja_get(request: HttpRequest) -> dict[str, Any]:
        """Plain ninja: no @idempotent on this operation."""
        return peek(request)

    @api.post("/sync", response={201: Peeked})
    @ninja_idempotent(operation="peek.ninja")
    def ninja_post(request: HttpRequest) -> dict[str, Any]:
        return peek(request)

    @api.post("/async", response={201: Peeked})
    @ninja_idempotent(operation="peek.ninja-async")
    async def ninja_async_post(request: HttpRequest) -> dict[str, Any]:
        await asyncio.sleep(0)
        return await sync_to_async(peek)(request)

    urlpatterns += [path("ninja/", api.urls)]
