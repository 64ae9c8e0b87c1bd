"""DRF views whose key comes from ``idempotency_key`` or ``get_idempotency_key``."""

from __future__ import annotations

from typing import Any

from rest_framework.decorators import api_view
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import sources
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotencyMixin
from tests.testapp.source_views import record


def delivery_id(request: Any) -> str | None:
    """A plain function: stored on a class it would become a method."""
    value: str | None = request.headers.get("X-Delivery")
    return value


class Created(APIView):
    name = "drf"

    def post(self, request: Request) -> Response:
        charge = record(self.name)
        return Response({"charge": charge.pk}, status=201)


class FunctionKeyView(IdempotencyMixin, Created):
    name = "drf-function"
    idempotency_key = delivery_id


class LambdaKeyView(IdempotencyMixin, Created):
    name = "drf-lambda"
    idempotency_key = lambda request: request.headers.get("X-Delivery")  # noqa: E731


class StaticKeyView(IdempotencyMixin, Created):
    name = "drf-static"
    idempotency_key = staticmethod(delivery_id)


class SourceKeyView(IdempotencyMixin, Created):
    name = "drf-source"
    idempotency_key = sources.json("id")


class DottedKeyView(IdempotencyMixin, Created):
    name = "drf-dotted"
    idempotency_key = "tests.testapp.source_drf_views.delivery_id"


class MethodKeyView(IdempotencyMixin, Created):
    """``get_idempotency_key`` wins over the attribute."""

    name = "drf-method"
    idempotency_key = sources.header("X-Ignored")

    def get_idempotency_key(self, request: Request) -> str | None:
        value: str | None = request.query_params.get("delivery")
        return value


class WrongKeyView(IdempotencyMixin, Created):
    name = "drf-wrong"
    idempotency_key = 42


@api_view(["POST"])
@idempotent(key=sources.json("id"))
def api_json_key(request: Request) -> Response:
    charge = record("drf-api-view")
    return Response({"charge": charge.pk}, status=201)


class ReadsDataFirst(BasePermission):
    """A permission that parses the body before the claim: the stream is then consumed."""

    def has_permission(self, request: Any, view: Any) -> bool:
        return bool(request.user and request.user.is_authenticated and request.data is not None)


class DataReadFirstView(IdempotencyMixin, Created):
    name = "drf-data-first"
    permission_classes = [ReadsDataFirst]
    idempotency_key = sources.json("id")
