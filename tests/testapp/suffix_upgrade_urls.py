"""A DRF ``@api_view`` under ``format_suffix_patterns`` (``refunds/`` and ``refunds.json``),
protected, for tests/test_upgrade.py: release 0.2.0 named a request to ``refunds.json`` by
that spelling's route; this release names both spellings by ``refunds/``."""

from __future__ import annotations

from django.urls import path
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.urlpatterns import format_suffix_patterns

from django_idempotency.decorators import idempotent

#: Every run of the view's body.
RAN: list[str] = []


@api_view(["POST"])
@authentication_classes([])
@permission_classes([AllowAny])
@idempotent(account=lambda request: "acct")
def create_refund(request: Request, format: str | None = None) -> Response:
    RAN.append("today")
    return Response({"made": "today"}, status=201)


urlpatterns = format_suffix_patterns([path("refunds/", create_refund)])
