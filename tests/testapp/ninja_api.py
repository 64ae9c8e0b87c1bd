"""django-ninja operations that the tests drive, under ``/ninja/`` (only where ninja is installed).

They share the charge's side effects with the Django views (``record_charge``) and the
``X-Test`` steering, so the same tests count the same effects against them.
"""

from __future__ import annotations

import json
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth import authenticate
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI, Router, Schema
from ninja.errors import HttpError
from ninja.security import HttpBasicAuth, HttpBearer, django_auth

from django_idempotency.ninja import idempotent
from tests.testapp import provider
from tests.testapp.models import Charge, ProviderCall
from tests.testapp.views import outcome as django_outcome
from tests.testapp.views import record_charge, steer, tenant_account

# The Django view's body, without its own @idempotent: here ninja's decorator protects it.
plain_outcome = django_outcome.__wrapped__  # type: ignore[attr-defined]


class BasicAuth(HttpBasicAuth):
    """HTTP Basic against Django's users: what the live-server tests send (ninja's session
    authentication wants a CSRF token, which a plain HTTP client does not have)."""

    def authenticate(self, request: HttpRequest, username: str, password: str) -> Any:
        return authenticate(request, username=username, password=password)


class UserToken(HttpBearer):
    """``Authorization: Bearer user-<pk>``: the authentication result is a user, while
    ``request.user`` stays anonymous (no session)."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        from django.contrib.auth.models import User

        if not token.startswith("user-"):
            return None
        return User.objects.filter(pk=token.removeprefix("user-")).first()


class ServiceToken(HttpBearer):
    """``Authorization: Bearer service-<pk>`` or ``user-<pk>``: the result of the first is
    an authenticated instance of another model than the user model (a service account),
    with the primary key the user of the second has."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        from django.contrib.auth.models import User

        kind, _, pk = token.partition("-")
        if kind == "user":
            return User.objects.filter(pk=pk).first()
        if kind != "service" or not pk.isdigit():
            return None
        service = ProviderCall(pk=int(pk), key="service")
        service.is_authenticated = True  # type: ignore[attr-defined]
        return service


class OpaqueToken(HttpBearer):
    """An authentication result that is no user: it names no account by itself."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        return {"token": token} if token == "opaque" else None


api = NinjaAPI(urls_namespace="tests-ninja", auth=[BasicAuth(), django_auth])
router = Router()


class ChargeIn(Schema):
    amount: int
    currency: str


class ChargeOut(Schema):
    id: int
    amount: int
    currency: str
    provider: int


class ChargeUpdate(Schema):
    amount: int


def charge_out(charge: Charge) -> dict[str, Any]:
    return {
        "id": charge.pk,
        "amount": charge.amount,
        "currency": charge.currency,
        "provider": int(charge.provider_charge),
    }


@router.post("/charges", response={201: ChargeOut})
@idempotent
def create_charge(request: HttpRequest, payload: ChargeIn, response: HttpResponse) -> Any:
    steer(request, "start")
    if payload.amount <= 0:
        raise HttpError(422, "amount must be positive")
    charge = record_charge(request, payload.amount, payload.currency)
    response["Location"] = f"/ninja/charges/{charge.pk}"
    return charge_out(charge)


@router.get("/charges")
@idempotent
def count_charges(request: HttpRequest) -> dict[str, int]:
    return {"count": Charge.objects.count()}


@router.patch("/charges/{int:charge_id}", response=ChargeOut)
@idempotent
def update_charge(request: HttpRequest, charge_id: int, payload: ChargeUpdate) -> Any:
    charge = Charge.objects.get(pk=charge_id)
    charge.amount = payload.amount
    charge.save(update_fields=["amount"])
    # Every PATCH that runs leaves a trace the tests count: a replay leaves none.
    Charge.objects.create(account="patch", amount=1, currency="EUR")
    return charge_out(charge)


@router.post("/charges/optional", response={201: ChargeOut})
@idempotent(required=False)
def create_charge_optional(request: HttpRequest, payload: ChargeIn) -> Any:
    return charge_out(record_charge(request, payload.amount, payload.currency))


@router.post("/charges/named", response={201: ChargeOut}, operation_id="charges_create")
@idempotent
def create_charge_named(request: HttpRequest, payload: ChargeIn) -> Any:
    return charge_out(record_charge(request, payload.amount, payload.currency))


@router.post("/charges/by-id", response={201: ChargeOut})
@idempotent(operation="charges.by-id", key=lambda request: request.headers.get("X-Event-Id"))
def create_charge_by_event(request: HttpRequest, payload: ChargeIn) -> Any:
    return charge_out(record_charge(request, payload.amount, payload.currency))


@router.post("/charges/token", response={201: ChargeOut}, auth=UserToken())
@idempotent
def create_charge_with_token(request: HttpRequest, payload: ChargeIn) -> Any:
    return charge_out(record_charge(request, payload.amount, payload.currency))


@router.post("/charges/service", response={201: ChargeOut}, auth=ServiceToken())
@idempotent
def create_charge_as_a_service(request: HttpRequest, payload: ChargeIn) -> Any:
    return charge_out(record_charge(request, payload.amount, payload.currency))


@router.post("/charges/opaque", response={201: ChargeOut}, auth=OpaqueToken())
@idempotent
def create_charge_with_opaque_token(request: HttpRequest, payload: ChargeIn) -> Any:
    return charge_out(record_charge(request, payload.amount, payload.currency))


@router.post("/charges/tenant", response={201: ChargeOut}, auth=None)
@idempotent(account=tenant_account)
def create_charge_for_tenant(request: HttpRequest, payload: ChargeIn) -> Any:
    """No authentication: the account is the ``X-Tenant`` header (no database before the
    claim, so the store-unavailable test reaches the claim)."""
    return charge_out(record_charge(request, payload.amount, payload.currency))


@router.post("/outcome")
@idempotent
def outcome(request: HttpRequest) -> HttpResponse:
    """The Django test view's outcomes, plus ninja's ``HttpError`` after a write."""
    payload = json.loads(request.body or b"{}")
    if "http_error" in payload:
        Charge.objects.create(account="outcome", amount=1, currency="EUR")
        raise HttpError(int(payload["http_error"]), "asked to fail")
    return plain_outcome(request)


@router.post("/async/charges", response={201: ChargeOut})
@idempotent(operation="ninja.async-charges")
async def create_charge_async(request: HttpRequest, payload: ChargeIn) -> Any:
    """An ``async def`` operation: the provider call and the write through the async ORM."""
    context = request.idempotency  # type: ignore[attr-defined]
    provider_id = await sync_to_async(provider.charge)(
        context.downstream_key("provider"), payload.amount, payload.currency
    )
    if "sleep-after-provider" in request.headers.get("X-Test", ""):
        import asyncio

        await asyncio.sleep(float(request.headers["X-Test"].split(":")[1]))
    charge = await Charge.objects.acreate(
        account=context.account,
        amount=payload.amount,
        currency=payload.currency,
        provider_charge=str(provider_id),
    )
    if payload.amount == 500:
        raise HttpError(500, "asked to fail after writing")
    return charge_out(charge)


api.add_router("/", router)
