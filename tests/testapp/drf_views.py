from __future__ import annotations

from typing import Any

from rest_framework import generics, permissions, serializers, status, viewsets
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import context_of
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotencyMixin
from tests.testapp import provider
from tests.testapp.models import Charge
from tests.testapp.views import steer


class ChargeSerializer(serializers.ModelSerializer):
    class Meta:
        model = Charge
        fields = ["id", "amount", "currency", "provider_charge"]
        read_only_fields = ["id", "provider_charge"]

    def validate_amount(self, value: int) -> int:
        if value <= 0:
            raise serializers.ValidationError("must be positive")
        return value


class ChargeViewSet(IdempotencyMixin, viewsets.ModelViewSet):
    serializer_class = ChargeSerializer

    def get_queryset(self) -> Any:
        return Charge.objects.filter(account=f"user:{self.request.user.pk}").order_by("id")

    def perform_create(self, serializer: Any) -> None:
        request = self.request
        steer(request._request, "start")
        data = serializer.validated_data
        provider_id = provider.charge(
            request.idempotency.downstream_key("provider"), data["amount"], data["currency"]
        )
        steer(request._request, "after-provider")
        serializer.save(account=request.idempotency.account, provider_charge=str(provider_id))

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        response = super().create(request, *args, **kwargs)
        response["Location"] = f"/api/charges/{response.data['id']}/"
        return response


class OpenChargeViewSet(ChargeViewSet):
    """Anonymous callers allowed by DRF: the default account resolver refuses them."""

    permission_classes = [permissions.AllowAny]


class CustomOperationAPIView(IdempotencyMixin, APIView):
    idempotency_operation = "custom.op"
    idempotency_methods = ("POST", "PUT")

    def get_idempotency_account(self, request: Request) -> str | None:
        tenant = request.headers.get("X-Tenant")
        return f"tenant:{tenant}" if tenant else None

    def post(self, request: Request) -> Response:
        Charge.objects.create(account="custom", amount=1, currency="EUR")
        if request.data.get("fail"):
            raise serializers.ValidationError({"fail": "asked to fail after writing"})
        context = context_of(request)  # typed: no attr-defined ignore
        assert context is not None
        return Response({"ok": True, "op": context.operation}, status=201)

    def put(self, request: Request) -> Response:
        Charge.objects.create(account="custom-put", amount=1, currency="EUR")
        return Response({"put": True})


@api_view(["POST"])
@idempotent
def api_charge(request: Request) -> Response:
    serializer = ChargeSerializer(data=request.data)
    serializer.is_valid(raise_exception=True)
    provider_id = provider.charge(
        request.idempotency.downstream_key("provider"),
        serializer.validated_data["amount"],
        serializer.validated_data["currency"],
    )
    serializer.save(account=request.idempotency.account, provider_charge=str(provider_id))
    return Response(serializer.data, status=status.HTTP_201_CREATED)


class GenericChargeCreateView(IdempotencyMixin, generics.CreateAPIView):
    """A generic view: the operation is the route and the method."""

    serializer_class = ChargeSerializer

    def perform_create(self, serializer: Any) -> None:
        context = self.request.idempotency
        provider_id = provider.charge(
            context.downstream_key("provider"),
            serializer.validated_data["amount"],
            serializer.validated_data["currency"],
        )
        serializer.save(account=context.account, provider_charge=str(provider_id))
