"""One DRF create endpoint, five ways: unprotected, by hand (the floor), and by each library.

Every variant runs the same serializer, the same ``perform_create`` and the same
authentication; only the idempotency layer differs. ``delay`` (the storm's routes) stands
for a call to a payment provider before the local write, so that a storm's duplicates
arrive while the first request is still running.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from rest_framework import mixins, serializers, views, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from benchmarks.benchsite.models import Charge


class ChargeSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = Charge
        fields = ["id", "amount", "currency", "description", "created_at"]
        read_only_fields = ["id", "created_at"]

    def validate_currency(self, value: str) -> str:
        if len(value) != 3 or not value.isupper():
            raise serializers.ValidationError("an ISO 4217 code in capitals")
        return value


class PlainChargeViewSet(mixins.CreateModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()
    delay = 0.0

    def perform_create(self, serializer: Any) -> None:
        if self.delay:
            time.sleep(self.delay)
        serializer.save(user=self.request.user)


def protected(base: type[PlainChargeViewSet]) -> type[PlainChargeViewSet]:
    """``base`` with the idempotency layer of ``settings.PROTECTION`` (dfi: in the middleware)."""
    variant = settings.PROTECTION
    if variant == "plain":
        return base
    if variant == "ours":
        from django_idempotency.drf import IdempotencyMixin

        return type(f"Ours{base.__name__}", (IdempotencyMixin, base), {})
    if variant == "floor":
        from benchmarks.benchsite.floor import FloorMixin

        return type(f"Floor{base.__name__}", (FloorMixin, base), {})
    if variant == "dik":
        from idempotency_key.decorators import idempotency_key

        def create_dik(self: Any, request: Request, *args: Any, **kwargs: Any) -> Response:
            return base.create(self, request, *args, **kwargs)

        return type(f"Dik{base.__name__}", (base,), {"create": idempotency_key(create_dik)})
    if variant == "dfi":
        # drf-idempotency protects through its middleware (its Quick Start; see settings):
        # its @idempotent() on a viewset method renders DRF's Response before DRF has
        # chosen a renderer and fails with ".accepted_renderer not set on Response".
        return base
    raise AssertionError(variant)


class SlowPlainChargeViewSet(PlainChargeViewSet):
    delay = float(getattr(settings, "BENCH_STORM_DELAY", 0.02))


ChargeViewSet = protected(PlainChargeViewSet)
StormChargeViewSet = protected(SlowPlainChargeViewSet)


class AuthenticatedNoop(views.APIView):
    """Authentication, permission checks and a constant answer: the floor of any replay.

    A replay happens after DRF's authentication (the key is scoped by the caller), so no
    idempotency layer can answer a retry faster than this endpoint.
    """

    def post(self, request: Request) -> Response:
        return Response({"ok": True})
