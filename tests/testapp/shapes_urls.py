"""Shapes a project writes that once looked protected and were not (issue: every shape
protects or is refused), each unsafe handler writing one ``Charge`` that the tests count:

- ``method_decorator(idempotent, name="dispatch")`` on a class whose handlers are
  ``async def``, alone or first in a list of decorators (``[idempotent, csrf_exempt]``);
- DRF format suffixes: ``transfers/`` and ``transfers.json`` (``format_suffix_patterns``),
  for the mixin and for ``@api_view``, a router's suffixed routes, and regex patterns
  included under an empty prefix (``payments/``: Django keeps the included route's ``^``);
- one view in every language (``i18n_patterns``: ``en/charges/``, ``fr/charges/``), which
  :data:`in_every_language` and :data:`default_language_unprefixed` spell, each a root
  URLconf of its own (tests/test_operations.py);
- one basename under two routers (``v1/`` and ``v2/``), which ``tests/test_operations.py``
  puts in a URLconf of its own (:data:`two_routers`), the check refusing it.
"""

from __future__ import annotations

from typing import Any

from django.conf.urls.i18n import i18n_patterns
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path, re_path
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import viewsets
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter, SimpleRouter
from rest_framework.urlpatterns import format_suffix_patterns
from rest_framework.views import APIView

from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotencyMixin
from tests.testapp.models import Charge


def written(account: str) -> dict[str, int]:
    """The side effect the tests count: one ``Charge`` per run."""
    return {"id": Charge.objects.create(account=account, amount=1, currency="EUR").pk}


async def awritten(account: str) -> dict[str, int]:
    charge = await Charge.objects.acreate(account=account, amount=1, currency="EUR")
    return {"id": charge.pk}


# -- an async class-based view, the decorator on dispatch -------------------------------------


@method_decorator(idempotent, name="dispatch")
class AsyncPayoutView(View):
    async def get(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse({"payouts": await Charge.objects.filter(account="payout").acount()})

    async def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(await awritten("async_payout"), status=201)


@method_decorator(idempotent(operation="refunds.async"), name="dispatch")
class AsyncRefundView(View):
    async def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(await awritten("async_refund"), status=201)


@method_decorator([idempotent(operation="refunds.async-listed"), csrf_exempt], name="dispatch")
class AsyncListedRefundView(View):
    """The decorator first in method_decorator's list: it wraps csrf_exempt's plain function,
    which hands back the handler's coroutine."""

    async def get(self, request: HttpRequest) -> HttpResponse:
        count = await Charge.objects.filter(account="async_listed").acount()
        return JsonResponse({"refunds": count})

    async def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(await awritten("async_listed"), status=201)


class AsyncNoteView(View):
    """The decorator on the async handler itself."""

    @method_decorator(idempotent(operation="notes.async"))
    async def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(await awritten("async_note"), status=201)


# -- DRF format suffixes -----------------------------------------------------------------------


class TransferView(IdempotencyMixin, APIView):
    def post(self, request: Request, format: str | None = None) -> Response:
        return Response(written("transfer"), status=201)


@api_view(["POST"])
@idempotent
def create_refund(request: Request, format: str | None = None) -> Response:
    return Response(written("refund"), status=201)


@api_view(["POST"])
@idempotent
def create_payment(request: Request, format: str | None = None) -> Response:
    return Response(written("payment"), status=201)


class LedgerViewSet(IdempotencyMixin, viewsets.ViewSet):
    def create(self, request: Request, format: str | None = None) -> Response:
        return Response(written(f"ledger:{request.path}"), status=201)


router = DefaultRouter()
router.register("ledger", LedgerViewSet, basename="ledger")

urlpatterns = [
    path("payouts/", AsyncPayoutView.as_view()),
    path("refunds/async/", AsyncRefundView.as_view()),
    path("refunds/async/listed/", AsyncListedRefundView.as_view()),
    path("notes/async/", AsyncNoteView.as_view()),
    *format_suffix_patterns(
        [path("transfers/", TransferView.as_view()), path("refunds/", create_refund)]
    ),
    path("api/", include(router.urls)),
    path("", include(format_suffix_patterns([re_path(r"^payments/$", create_payment)]))),
]


# -- with and without a trailing slash ----------------------------------------------------------


@idempotent
def create_deposit(request: HttpRequest) -> HttpResponse:
    return JsonResponse(written("deposit"), status=201)


class WithdrawalView(View):
    @method_decorator(idempotent)
    def post(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse(written("withdrawal"), status=201)


@idempotent
def create_fee(request: HttpRequest) -> HttpResponse:
    return JsonResponse(written("fee"), status=201)


@idempotent
def create_grant(request: HttpRequest) -> HttpResponse:
    return JsonResponse(written("grant"), status=201)


#: One endpoint written twice, with and without its trailing slash: a function view, a class
#: view (``as_view()`` called for each), a regex; and, listed without the slash first,
#: another function view. Beside them, a view of its own at ``grants`` below ``grants/``'s.
with_and_without_slash = [
    path("deposits/", create_deposit),
    path("deposits", create_deposit),
    path("withdrawals/", WithdrawalView.as_view()),
    path("withdrawals", WithdrawalView.as_view()),
    re_path(r"^fees/$", create_fee),
    re_path(r"^fees$", create_fee),
    path("grants/", create_grant),
    path("grants", create_deposit),
]


@api_view(["POST"])
@idempotent
def create_remit(request: Request, format: str | None = None) -> Response:
    return Response(written("remit"), status=201)


@idempotent
def create_rebate(request: HttpRequest) -> HttpResponse:
    return JsonResponse(written("rebate"), status=201)


@idempotent
def create_bonus(request: HttpRequest, kind: str) -> HttpResponse:
    return JsonResponse(written(f"bonus:{kind}"), status=201)


#: The same, spelled less plainly: DRF's format suffixes of both spellings
#: (``remits.<drf_format_suffix:format>`` twice, after ``remits/`` and after ``remits``); a
#: ``path()`` beside a ``re_path()`` (``rebates/`` and ``^rebates$``); and one view given
#: other URL arguments at each spelling (``bonuses/`` pays cash, ``bonuses`` vouchers): two
#: endpoints of one function.
slash_spelled_otherwise = [
    *format_suffix_patterns([path("remits/", create_remit), path("remits", create_remit)]),
    path("rebates/", create_rebate),
    re_path(r"^rebates$", create_rebate),
    path("bonuses/", create_bonus, {"kind": "cash"}),
    path("bonuses", create_bonus, {"kind": "voucher"}),
]


@idempotent
def create_levy(request: HttpRequest) -> HttpResponse:
    return JsonResponse(written("levy"), status=201)


def _slash_routers() -> list[Any]:
    """A viewset under a router with trailing slashes and one without, at one prefix."""
    slashed, unslashed = SimpleRouter(), SimpleRouter(trailing_slash=False)
    slashed.register("ledger", LedgerViewSet, basename="ledger")
    unslashed.register("ledger", LedgerViewSet, basename="ledger")
    return [path("api/", include(slashed.urls)), path("api/", include(unslashed.urls))]


#: One endpoint written with and without its trailing slash at two levels of the URLconf:
#: ``levies/`` in an app's list included under ``api/``, ``api/levies`` at the root; and a
#: viewset under two routers, with and without trailing slashes, each included under
#: ``api/``.
slash_at_two_levels = [
    path("api/", include([path("levies/", create_levy)])),
    path("api/levies", create_levy),
    *_slash_routers(),
]


# -- one basename under two routers --------------------------------------------------------------


def routers(**v2: Any) -> list[Any]:
    """``v1/ledger/`` and ``v2/ledger/``: the same viewset, the basename ``ledger`` (or what
    ``v2`` says) under two routers."""
    v1_router, v2_router = SimpleRouter(), SimpleRouter()
    v1_router.register("ledger", LedgerViewSet, basename="ledger")
    v2_router.register(
        "ledger", v2.pop("viewset", LedgerViewSet), basename=v2.pop("basename", "ledger")
    )
    return [path("v1/", include(v1_router.urls)), path("v2/", include(v2_router.urls))]


class LedgerV2ViewSet(LedgerViewSet):
    """v2 with an operation of its own: accepted."""

    idempotency_operation = "ledger-v2.create"


two_routers = routers()
two_routers_own_basename = routers(basename="ledger-v2")
two_routers_own_operation = routers(viewset=LedgerV2ViewSet)


# -- one view in every language ----------------------------------------------------------------


@api_view(["POST"])
@idempotent
def create_booking(request: Request, format: str | None = None) -> Response:
    return Response(written("booking"), status=201)


def _in_languages(prefix_default_language: bool) -> list[Any]:
    """``charges/`` (the async payout view's twin, a function view) and ``bookings/`` (a regex
    with DRF's format suffix) under ``i18n_patterns``: ``en/charges/`` and ``fr/charges/``."""
    return i18n_patterns(
        path("charges/", create_refund),
        *format_suffix_patterns([re_path(r"^bookings/$", create_booking)]),
        prefix_default_language=prefix_default_language,
    )


in_every_language = _in_languages(prefix_default_language=True)
# A view of its own at ``fr/charges/``, outside i18n_patterns and before it (so it is the one
# Django resolves there): another endpoint, never the i18n view's French spelling.
beside_a_language = [
    path("fr/charges/", TransferView.as_view()),
    *_in_languages(prefix_default_language=True),
]
default_language_unprefixed = _in_languages(prefix_default_language=False)
