"""The payments API's charges again, through django-ninja, under ``/ninja/`` (Swagger UI at
``/ninja/docs``): the same charges, the same provider, protected by
``django_idempotency.ninja.idempotent``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth import authenticate
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.urls import reverse
from ninja import Field, NinjaAPI, Schema
from ninja.security import HttpBasicAuth, django_auth

from django_idempotency import context_of
from django_idempotency.ninja import idempotent
from example_project.payments import provider
from example_project.payments.models import Charge


class BasicAuth(HttpBasicAuth):
    """HTTP Basic against Django's users (``curl -u demo:demo``)."""

    def authenticate(self, request: HttpRequest, username: str, password: str) -> Any:
        return authenticate(request, username=username, password=password)


api = NinjaAPI(
    title="Example payments API (django-ninja)",
    version="1.0.0",
    description=(
        "Charges with safe retries: send an `Idempotency-Key` with every `POST`, the same key "
        "on every retry of one operation."
    ),
    urls_namespace="payments-ninja",
    auth=[BasicAuth(), django_auth],
)


class ChargeIn(Schema):
    amount: int = Field(gt=0, description="In the currency's minor unit (cents).")
    currency: str = Field(pattern=r"^[A-Z]{3}$", examples=["EUR"])
    description: str = Field("", max_length=200)


class ChargeOut(Schema):
    id: int
    amount: int
    currency: str
    description: str
    provider_charge_id: str
    created_at: datetime


# --8<-- [start:create-charge]
@api.post("/charges", response={201: ChargeOut}, operation_id="ninja_charge_create")
@idempotent
def create_charge(request: HttpRequest, payload: ChargeIn, response: HttpResponse) -> Charge:
    """Charge the caller once per `Idempotency-Key`; a retry gets this answer again."""
    # As in the DRF view: the provider call carries a key derived from the client's key, so
    # a retry after a crash is deduplicated by the provider, and the local row commits with
    # the idempotency record.
    context = context_of(request)  # request.idempotency, typed
    assert context is not None
    provider_charge = provider.charge(
        key=context.downstream_key("provider"),
        amount=payload.amount,
        currency=payload.currency,
        description=payload.description,
    )
    charge = Charge.objects.create(
        user=request.auth,  # type: ignore[attr-defined]
        amount=payload.amount,
        currency=payload.currency,
        description=payload.description,
        provider_charge_id=provider_charge.reference,
    )
    response["Location"] = reverse("payments-ninja:ninja-charge-detail", args=[charge.pk])
    return charge
    # --8<-- [end:create-charge]


@api.get("/charges", response=list[ChargeOut])
def list_charges(request: HttpRequest) -> Any:
    """The caller's latest charges."""
    return Charge.objects.filter(user=request.auth)[:20]  # type: ignore[attr-defined]


@api.get("/charges/{int:charge_id}", response=ChargeOut, url_name="ninja-charge-detail")
def get_charge(request: HttpRequest, charge_id: int) -> Charge:
    """One of the caller's charges."""
    return get_object_or_404(Charge, pk=charge_id, user=request.auth)  # type: ignore[attr-defined]
