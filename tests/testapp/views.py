"""Views that the tests drive. ``X-Test-*`` headers (outside the fingerprint) steer them."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_idempotency.decorators import idempotent
from tests.testapp import provider
from tests.testapp.models import Charge


def steer(request: HttpRequest, stage: str) -> None:
    """Test hooks at named stages: sleep, crash the process, or wait for a file to appear."""
    for directive in request.headers.get("X-Test", "").split(","):
        name, _, arg = directive.strip().partition(":")
        if name == f"sleep-{stage}":
            time.sleep(float(arg))
        elif name == f"kill-{stage}":
            os.kill(os.getpid(), signal.SIGKILL)
        elif name == f"raise-{stage}":
            raise RuntimeError(f"test asked to fail at {stage}")
        elif name == f"touch-{stage}":
            Path(arg).touch()
        elif name == f"wait-{stage}":
            deadline = time.monotonic() + 30
            while not Path(arg).exists() and time.monotonic() < deadline:
                time.sleep(0.01)


def make_charge(request: HttpRequest) -> HttpResponse:
    """The shared body of the charge views: provider call, then the local write."""
    steer(request, "start")
    try:
        payload = json.loads(request.body or b"{}")
        amount = int(payload["amount"])
        currency = str(payload["currency"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "amount and currency required"}, status=400)
    if amount <= 0:
        return JsonResponse({"error": "amount must be positive"}, status=422)
    account = request.idempotency.account if request.idempotency else "anonymous"  # type: ignore[attr-defined]
    provider_key = (
        request.idempotency.downstream_key("provider")  # type: ignore[attr-defined]
        if getattr(request, "idempotency", None)
        else f"no-key-{time.time_ns()}"
    )
    provider_id = provider.charge(provider_key, amount, currency)
    steer(request, "after-provider")
    charge = Charge.objects.create(
        account=account, amount=amount, currency=currency, provider_charge=str(provider_id)
    )
    steer(request, "after-write")
    response = JsonResponse(
        {"id": charge.pk, "amount": amount, "currency": currency, "provider": provider_id},
        status=201,
    )
    response["Location"] = f"/charges/{charge.pk}/"
    response["X-Request-Trace"] = str(time.time_ns())  # differs per attempt; not replayed
    return response


@idempotent
def charges(request: HttpRequest, shop: int | None = None) -> HttpResponse:
    if request.method == "GET":
        return JsonResponse({"count": Charge.objects.count()})
    return make_charge(request)


@idempotent(operation="charges.create-short-lease", lease=1, ttl=60)
def charges_short_lease(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


@idempotent(operation="charges.create-fail", lease=1, ttl=60, recovery="fail")
def charges_fail_policy(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


def recover_by_asking_provider(record):  # type: ignore[no-untyped-def]
    """A recovery callable: answers from our own Charge table when it holds the outcome."""
    if record.key.startswith("known-"):
        return JsonResponse({"recovered": record.key}, status=200)
    return None


@idempotent(
    operation="charges.create-callable", lease=1, ttl=60, recovery=recover_by_asking_provider
)
def charges_callable_policy(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


@idempotent(required=False)
def charges_optional(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


@idempotent(account=lambda request: request.headers.get("X-Tenant"))
def tenant_charges(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


@idempotent
def outcome(request: HttpRequest) -> HttpResponse:
    """Writes a Charge, then answers with the status, body and headers the payload asks for."""
    payload = json.loads(request.body or b"{}")
    Charge.objects.create(account="outcome", amount=1, currency="EUR")
    if payload.get("raise"):
        raise RuntimeError("view failed")
    if payload.get("stream"):
        return StreamingHttpResponse(iter([b"a", b"b"]), status=200)
    if payload.get("rollback"):
        transaction.set_rollback(True)
    body = payload.get("body", "x" * int(payload.get("size", 0)))
    response = HttpResponse(body, status=int(payload.get("status", 200)), content_type="text/plain")
    for name, value in payload.get("headers", {}).items():
        response[name] = value
    if payload.get("cookie"):
        response.set_cookie("session-ish", "secret")
    return response


@method_decorator(idempotent(operation="cbv.charges"), name="dispatch")
class ChargeView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse({"count": Charge.objects.count()})

    def post(self, request: HttpRequest) -> HttpResponse:
        return make_charge(request)


@idempotent(operation="peek")
def peek(request: HttpRequest) -> HttpResponse:
    """Reports what another connection sees of this request's record while the view runs."""
    from django.db import connection

    from django_idempotency.models import IdempotencyRecord

    if request.method == "GET":
        return JsonResponse({"atomic": connection.in_atomic_block})
    ctx = request.idempotency  # type: ignore[attr-defined]
    seen = (
        IdempotencyRecord.objects.using("provider")
        .filter(account=ctx.account, operation=ctx.operation, key=ctx.key)
        .values_list("status", flat=True)
        .first()
    )
    Charge.objects.create(account=ctx.account, amount=1, currency="EUR")
    return JsonResponse({"seen": seen, "atomic": connection.in_atomic_block})


async def make_async_charge(request: HttpRequest) -> HttpResponse:
    """An ``async def`` view body: the provider call and the local write through the async ORM."""
    from asgiref.sync import sync_to_async

    ctx = request.idempotency  # type: ignore[attr-defined]
    payload = json.loads(request.body or b"{}")
    provider_id = await sync_to_async(provider.charge)(
        ctx.downstream_key("provider"), int(payload["amount"]), str(payload["currency"])
    )
    if "sleep-after-provider" in request.headers.get("X-Test", ""):
        import asyncio

        await asyncio.sleep(float(request.headers["X-Test"].split(":")[1]))
    charge = await Charge.objects.acreate(
        account=ctx.account,
        amount=int(payload["amount"]),
        currency=str(payload["currency"]),
        provider_charge=str(provider_id),
    )
    if payload.get("fail"):
        return JsonResponse({"error": "asked to fail"}, status=500)
    response = JsonResponse({"id": charge.pk}, status=201)
    response["Location"] = f"/async/charges/{charge.pk}/"
    return response


@idempotent(operation="async.charges")
async def async_charges(request: HttpRequest) -> HttpResponse:
    return await make_async_charge(request)


@idempotent(operation="async.charges-short-lease", lease=1, ttl=60)
async def async_charges_short_lease(request: HttpRequest) -> HttpResponse:
    return await make_async_charge(request)
