"""A URLconf with every kind of view the audit resolves, one of each kind unprotected
(``tests/test_audit.py`` checks ``manage.py idempotency_audit`` over it, line for line).

Each unsafe handler writes a ``Charge``: the audit tests send each listed ``POST`` twice with
one key and count the rows, so what the audit says of a view is what the view does.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.http import require_GET, require_POST
from ninja import NinjaAPI, Router
from rest_framework import serializers, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter
from rest_framework.views import APIView

from django_idempotency import sources
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotencyMixin
from django_idempotency.ninja import idempotent as ninja_idempotent
from tests.testapp.models import Charge


def written(account: str) -> dict[str, int]:
    """The side effect the tests count: one ``Charge`` per run."""
    return {"id": Charge.objects.create(account=account, amount=1, currency="EUR").pk}


# -- function views -------------------------------------------------------------------------


@require_POST
@idempotent(operation="orders.create", recovery="fail", ttl=timedelta(hours=1))
def create_order(request: HttpRequest) -> HttpResponse:
    return JsonResponse(written("create_order"), status=201)


def create_order_unprotected(request: HttpRequest) -> HttpResponse:
    """Any method reaches it: its POST and its PATCH are listed."""
    return JsonResponse(written("create_order_unprotected"), status=201)


@require_GET
def health(request: HttpRequest) -> HttpResponse:
    """GET only: not listed."""
    return JsonResponse({"ok": True})


@idempotent(operation="orders.async")
async def create_order_async(request: HttpRequest) -> HttpResponse:
    charge = await Charge.objects.acreate(account="create_order_async", amount=1, currency="EUR")
    return JsonResponse({"id": charge.pk}, status=201)


# -- class-based views ----------------------------------------------------------------------


@method_decorator(idempotent(key=sources.header("X-Request-Id")), name="dispatch")
class PayoutView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse({"payouts": []})

    def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(written("payout"), status=201)


class PayoutViewUnprotected(View):
    def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(written("payout_unprotected"), status=201)


class NoteView(View):
    @method_decorator(idempotent(required=False, ttl=90))
    def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(written("note"), status=201)

    def patch(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(written("note_patch"), status=201)


# -- DRF ------------------------------------------------------------------------------------


class ChargeSerializer(serializers.ModelSerializer):
    class Meta:
        model = Charge
        fields = ["id", "amount", "currency"]

    def create(self, validated_data: dict[str, Any]) -> Charge:
        return Charge.objects.create(account="drf", **validated_data)


class ChargeViewSet(IdempotencyMixin, viewsets.ModelViewSet):
    queryset = Charge.objects.all()
    serializer_class = ChargeSerializer
    idempotency_recovery = "fail"

    @action(detail=True, methods=["post"])
    def refund(self, request: Request, pk: str) -> Response:
        return Response(written("refund_action"), status=201)


class ChargeViewSetUnprotected(viewsets.ModelViewSet):
    queryset = Charge.objects.all()
    serializer_class = ChargeSerializer


class TransferView(IdempotencyMixin, APIView):
    idempotency_methods = ("POST", "PUT")
    idempotency_operation = "transfers.create"
    idempotency_key = sources.json("transfer_id")

    def post(self, request: Request) -> Response:
        return Response(written("transfer"), status=201)

    def put(self, request: Request) -> Response:
        return Response(written("transfer_put"))


class TransferViewUnprotected(APIView):
    def post(self, request: Request) -> Response:
        return Response(written("transfer_unprotected"), status=201)

    def patch(self, request: Request) -> Response:
        return Response(written("transfer_patch"))


@api_view(["POST"])
@idempotent(lease=timedelta(seconds=5))
def create_refund(request: Request) -> Response:
    return Response(written("refund"), status=201)


@api_view(["GET", "POST"])
def create_refund_unprotected(request: Request) -> Response:
    return Response(written("refund_unprotected"), status=201)


router = DefaultRouter()
router.register("charges", ChargeViewSet, basename="charge")
router.register("open-charges", ChargeViewSetUnprotected, basename="open-charge")

# -- django-ninja: an API and a router of its --------------------------------------------------

api = NinjaAPI(urls_namespace="audit-ninja")
ninja_router = Router()


@ninja_router.post("/items", operation_id="items_create")
@ninja_idempotent(recovery="tests.testapp.views.recover_by_asking_provider")
def create_item(request: HttpRequest) -> dict[str, int]:
    return written("item")


@ninja_router.get("/items")
def list_items(request: HttpRequest) -> list[int]:
    return list(Charge.objects.values_list("pk", flat=True))


@ninja_router.patch("/items/{int:item_id}")
def update_item(request: HttpRequest, item_id: int) -> dict[str, int]:
    return written("item_patch")


api.add_router("/shop", ninja_router)

# -- an included URLconf, with a namespace --------------------------------------------------

included = [path("orders/", create_order, name="order-create")]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("health/", health),
    path("orders/", create_order_unprotected, name="order-create-unprotected"),
    path("orders/async/", create_order_async),
    path("payouts/", PayoutView.as_view()),
    path("payouts/unprotected/", PayoutViewUnprotected.as_view()),
    path("notes/", NoteView.as_view()),
    path("transfers/", TransferView.as_view()),
    path("transfers/unprotected/", TransferViewUnprotected.as_view()),
    path("refunds/", create_refund),
    path("refunds/unprotected/", create_refund_unprotected),
    path("api/", include(router.urls)),
    path("ninja/", api.urls),
    path("v2/", include((included, "v2"), namespace="v2")),
]
