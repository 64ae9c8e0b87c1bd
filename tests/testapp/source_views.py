"""Views whose key comes from a source other than the ``Idempotency-Key`` header.

Each records one ``Charge`` (its ``account`` column names the view) per run, so tests count
how often a view ran.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import sources
from django_idempotency.decorators import idempotent
from tests.testapp.models import Charge


def record(view: str) -> Charge:
    return Charge.objects.create(account=view, amount=1, currency="EUR")


@csrf_exempt
@idempotent(key=sources.json("data.object.id"), account=sources.fixed("sender:json"))
def json_key(request: HttpRequest) -> HttpResponse:
    charge = record("json")
    return JsonResponse({"charge": charge.pk}, status=201)


@csrf_exempt
@idempotent(key=sources.json("id"), account=sources.fixed("sender:json"), required=False)
def json_key_optional(request: HttpRequest) -> HttpResponse:
    charge = record("json-optional")
    return JsonResponse({"charge": charge.pk}, status=201)


def number_key(request: HttpRequest) -> Any:
    return 42  # not a string: an invalid key


@csrf_exempt
@idempotent(key=number_key, account=sources.fixed("sender:number"))
def wrong_type_key(request: HttpRequest) -> HttpResponse:
    record("wrong-type")
    return JsonResponse({}, status=201)


def query_key(request: HttpRequest) -> str | None:
    return request.GET.get("id")


@csrf_exempt
@idempotent(key="tests.testapp.source_views.query_key", account=sources.fixed("sender:q"))
def dotted_key(request: HttpRequest) -> HttpResponse:
    charge = record("dotted")
    return JsonResponse({"charge": charge.pk}, status=201)


def sender_view(account: str) -> Any:
    # One operation for both senders: only the account tells their records apart.
    @csrf_exempt
    @idempotent(
        operation="webhooks.shared",
        key=sources.header("webhook-id"),
        account=sources.fixed(account),
    )
    def view(request: HttpRequest) -> HttpResponse:
        charge = record(account)
        return JsonResponse({"charge": charge.pk})

    return view


sender_a = sender_view("sender:a")
sender_b = sender_view("sender:b")


@idempotent(key=sources.form("idempotency_key"))
def form_submit(request: HttpRequest) -> HttpResponse:
    charge = record("form")
    return HttpResponseRedirect(f"/sources/form/done/{charge.pk}/")
