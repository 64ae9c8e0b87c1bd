"""The payments API: charges through the DRF mixin, refunds through the decorator."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import status, viewsets
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import context_of
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotencyMixin
from django_idempotency.outbox import enqueue
from example_project.payments import provider
from example_project.payments.models import Charge
from example_project.payments.serializers import ChargeSerializer, RefundSerializer
from example_project.payments.tasks import send_receipt

# DRF's own error answers, for the OpenAPI schema (django_idempotency.openapi adds the
# Idempotency-Key header and this package's problem+json answers by itself).
INVALID = OpenApiResponse(
    description="The request is invalid: the messages by field, or a `detail` (unreadable body).",
    response={
        "type": "object",
        "properties": {"detail": {"type": "string"}},
        # DRF's messages come as a list per field; RefundSerializer.create() raises one as a
        # plain string.
        "additionalProperties": {"anyOf": [{"type": "array", "items": {}}, {"type": "string"}]},
    },
)
NOT_FOUND = OpenApiResponse(
    description="No such charge, or no such page.",
    response={"type": "object", "properties": {"detail": {"type": "string"}}},
)


@extend_schema_view(
    list=extend_schema(responses={200: ChargeSerializer(many=True), 404: NOT_FOUND}),
    retrieve=extend_schema(responses={200: ChargeSerializer, 404: NOT_FOUND}),
    create=extend_schema(responses={201: ChargeSerializer, 400: INVALID}),
)
# --8<-- [start:charge-viewset]
class ChargeViewSet(IdempotencyMixin, viewsets.ModelViewSet[Charge]):
    """The caller's charges. ``POST`` needs an ``Idempotency-Key``; operation ``charge.create``.

    Charges are never changed or deleted (refunds exist for that), so only ``GET`` and
    ``POST`` are routed.
    """

    serializer_class = ChargeSerializer
    http_method_names = ["get", "post", "head", "options"]

    def get_queryset(self) -> QuerySet[Charge]:
        user = self.request.user
        if not user.is_authenticated:  # refused by IsAuthenticated before it gets here
            return Charge.objects.none()
        return Charge.objects.filter(user=user)

    def perform_create(self, serializer: Any) -> None:
        data = serializer.validated_data
        # The provider call comes first and carries a key derived from the client's key: a
        # retry after a crash reaches the provider with the same key and is deduplicated
        # there, while the local row below commits together with the idempotency record.
        context = context_of(self.request)  # request.idempotency, typed
        assert context is not None
        provider_charge = provider.charge(
            key=context.downstream_key("provider"),
            amount=data["amount"],
            currency=data["currency"],
            description=data.get("description", ""),
        )
        charge = serializer.save(
            user=self.request.user, provider_charge_id=provider_charge.reference
        )
        # Written to the outbox in this request's transaction: the receipt exists exactly
        # when the charge committed, and the relay (manage.py relay_outbox) sends it.
        enqueue(send_receipt, charge.pk)
        # --8<-- [end:charge-viewset]
        if getattr(settings, "EXAMPLE_TASKS_RECEIPTS", False):
            # The same receipt through Django's Tasks framework (docs/tasks.md): an outbox
            # message too, handed to `manage.py db_worker --backend worker` by the relay.
            from example_project.payments.receipts import mail_receipt

            mail_receipt.enqueue(charge.pk)


@extend_schema(request=RefundSerializer, responses={201: RefundSerializer, 400: INVALID})
@api_view(["POST"])
@idempotent(operation="refund.create")
def create_refund(request: Request) -> Response:
    """Refund part or all of one of the caller's charges."""
    serializer = RefundSerializer(data=request.data, context={"request": request})
    serializer.is_valid(raise_exception=True)
    serializer.save()
    return Response(serializer.data, status=status.HTTP_201_CREATED)
