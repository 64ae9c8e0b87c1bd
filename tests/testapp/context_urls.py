"""Views that write down what ``request.idempotency`` holds, under every entry point
(``tests/test_request_context.py`` uses them with ``pytest.mark.urls``).

Each view writes one ``Charge`` whose account says what it found: ``"none"`` when
``request.idempotency`` is ``None``, the context's account when the request is protected.
Reading the attribute is what a view does (``if request.idempotency: ...``): a request
without it fails there.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import URLPattern, URLResolver, path

from django_idempotency.decorators import idempotent
from tests.testapp.models import Charge


def found(request: Any) -> dict[str, str]:
    """What the view finds in ``request.idempotency``, written down as a charge."""
    context = request.idempotency  # an AttributeError when the entry point left it unset
    account = "none" if context is None else context.account
    Charge.objects.create(account=account, amount=1, currency="EUR")
    return {"context": account}


@idempotent(operation="context.plain")
def plain(request: HttpRequest) -> HttpResponse:
    return JsonResponse(found(request))


urlpatterns: list[URLPattern | URLResolver] = [path("context/plain/", plain)]

if settings.HAS_DRF:
    from rest_framework.decorators import api_view
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from django_idempotency.drf import IdempotencyMixin

    class MixinView(IdempotencyMixin, APIView):
        idempotency_operation = "context.mixin"

        def get(self, request: Request) -> Response:
            return Response(found(request))

        def post(self, request: Request) -> Response:
            return Response(found(request))

        def put(self, request: Request) -> Response:
            return Response(found(request))

        def delete(self, request: Request) -> Response:
            return Response(found(request))

    class OwnDispatchView(MixinView):
        """A dispatch of the view's own that calls APIView's, past the mixin's."""

        def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            return APIView.dispatch(self, request, *args, **kwargs)

    @api_view(["GET", "POST", "PUT", "DELETE"])
    @idempotent(operation="context.api-view")
    def api_view_function(request: Request) -> Response:
        return Response(found(request))

    urlpatterns += [
        path("context/mixin/", MixinView.as_view()),
        path("context/api-view/", api_view_function),
        path("context/own-dispatch/", OwnDispatchView.as_view()),
    ]

if settings.HAS_NINJA:
    from ninja import NinjaAPI
    from ninja.security import django_auth

    from django_idempotency.ninja import idempotent as ninja_idempotent

    api = NinjaAPI(urls_namespace="tests-context-ninja", auth=django_auth)

    @api.get("/sync")
    @ninja_idempotent(operation="context.ninja-get")
    def ninja_get(request: HttpRequest) -> dict[str, str]:
        return found(request)

    @api.post("/sync")
    @ninja_idempotent(operation="context.ninja-post")
    def ninja_post(request: HttpRequest) -> dict[str, str]:
        return found(request)

    @api.put("/sync")
    @ninja_idempotent(operation="context.ninja-put")
    def ninja_put(request: HttpRequest) -> dict[str, str]:
        return found(request)

    @api.delete("/sync")
    @ninja_idempotent(operation="context.ninja-delete")
    def ninja_delete(request: HttpRequest) -> dict[str, str]:
        return found(request)

    @api.get("/async")
    @ninja_idempotent(operation="context.ninja-async-get")
    async def ninja_async_get(request: HttpRequest) -> dict[str, str]:
        from asgiref.sync import sync_to_async

        return await sync_to_async(found)(request)

    @api.put("/async")
    @ninja_idempotent(operation="context.ninja-async-put")
    async def ninja_async_put(request: HttpRequest) -> dict[str, str]:
        from asgiref.sync import sync_to_async

        return await sync_to_async(found)(request)

    urlpatterns += [path("context/ninja/", api.urls)]
