"""Shapes written with the public API that protect one endpoint twice, or before DRF's
authentication (``tests/test_layered_shapes.py``). Each unsafe handler writes one ``Charge``
that the tests count.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.views import APIView
from rest_framework.viewsets import ViewSet

from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotencyMixin
from tests.testapp.models import Charge


def written(account: str) -> dict[str, int]:
    return {"id": Charge.objects.create(account=account, amount=1, currency="EUR").pk}


@method_decorator(idempotent, name="post")
class MixinAndDecorator(IdempotencyMixin, APIView):
    """The mixin, and the decorator on the handler besides."""

    def post(self, request: Request) -> Response:
        return Response(written("mixin_and_decorator"), status=201)


@method_decorator(idempotent, name="dispatch")
@method_decorator(idempotent, name="post")
class DispatchAndHandler(View):
    """The decorator on dispatch, and on the handler besides."""

    def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(written("dispatch_and_handler"), status=201)


@method_decorator(idempotent, name="dispatch")
class DrfDispatch(APIView):
    """The decorator on a DRF view's dispatch: it would claim before DRF authenticates."""

    def post(self, request: Request) -> Response:
        return Response(written("drf_dispatch"), status=201)


@method_decorator(idempotent, name="create")
class DecoratedAction(ViewSet):
    """A viewset without the mixin, the decorator on its action (after DRF's checks)."""

    def create(self, request: Request) -> Response:
        return Response(written("decorated_action"), status=201)


router = SimpleRouter()
router.register("decorated-action", DecoratedAction, basename="decorated-action")

urlpatterns = [
    path("mixin-and-decorator/", MixinAndDecorator.as_view()),
    path("dispatch-and-handler/", DispatchAndHandler.as_view()),
    path("drf-dispatch/", DrfDispatch.as_view()),
    *router.urls,
]
