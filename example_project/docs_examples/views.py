"""Function views under ``@idempotent``: the quickstart's and the async view's code."""

from __future__ import annotations

from example_project.payments import provider
from example_project.payments.models import Charge

# --8<-- [start:function-views]
from datetime import timedelta

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import context_of
from django_idempotency.decorators import idempotent


@idempotent  # bare
def create_order(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"order": 1}, status=201)


@idempotent(operation="refunds.create", recovery="fail", ttl=timedelta(hours=1))
def create_refund(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"refund": 1}, status=201)


@api_view(["POST"])  # DRF: api_view outside, idempotent beneath
@idempotent
def create_transfer(request: Request) -> Response:
    return Response({"transfer": 1}, status=201)


@method_decorator(idempotent, name="dispatch")  # class-based views
class PayoutView(View):
    def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse({"payout": 1}, status=201)


# --8<-- [end:function-views]


# --8<-- [start:async-view]
@idempotent(operation="orders.create")
async def create_charge_async(request: HttpRequest) -> HttpResponse:
    assert request.user.is_authenticated
    charge = await Charge.objects.acreate(user=request.user, amount=1000, currency="EUR")
    return JsonResponse({"id": charge.pk}, status=201)


# --8<-- [end:async-view]


# --8<-- [start:downstream-key]
@idempotent(operation="charges.create")
def create_charge(request: HttpRequest) -> HttpResponse:
    ctx = context_of(request)  # request.idempotency, typed
    assert ctx is not None  # a protected POST always has one
    assert request.user.is_authenticated
    # The provider first, with a key derived from the client's: a retry after a crash
    # sends the same key, and the provider returns its first result.
    provider_charge = provider.charge(
        key=ctx.downstream_key("provider"), amount=1000, currency="EUR"
    )
    charge = Charge.objects.create(
        user=request.user,
        amount=1000,
        currency="EUR",
        provider_charge_id=provider_charge.reference,
    )
    return JsonResponse({"id": charge.pk}, status=201)


# --8<-- [end:downstream-key]
