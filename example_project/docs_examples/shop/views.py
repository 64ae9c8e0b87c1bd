"""The shop's API: orders, through a DRF viewset that ``IdempotencyMixin`` protects."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from rest_framework import serializers, viewsets

from django_idempotency import context_of
from django_idempotency.drf import IdempotencyMixin
from django_idempotency.outbox import enqueue
from example_project.docs_examples.shop import payments
from example_project.docs_examples.shop.models import Order
from example_project.docs_examples.shop.tasks import send_confirmation


class OrderSerializer(serializers.ModelSerializer[Order]):
    class Meta:
        model = Order
        fields = ["id", "item", "amount", "currency", "payment", "created_at"]
        read_only_fields = ["id", "payment", "created_at"]


# --8<-- [start:viewset]
class OrderViewSet(IdempotencyMixin, viewsets.ModelViewSet[Order]):
    """The caller's orders. ``POST`` pays for one: once per ``Idempotency-Key``."""

    serializer_class = OrderSerializer
    http_method_names = ["get", "post", "head", "options"]

    def get_queryset(self) -> QuerySet[Order]:
        return Order.objects.filter(customer=self.request.user.pk)

    def perform_create(self, serializer: Any) -> None:
        data = serializer.validated_data
        context = context_of(self.request)  # request.idempotency, typed
        assert context is not None
        payment = payments.charge(
            data["amount"],
            data["currency"],
            # The same key on every retry of this order: the gateway pays once.
            idempotency_key=context.downstream_key("payment"),
        )
        with transaction.atomic():  # the order and its confirmation commit together
            order = serializer.save(customer=self.request.user, payment=payment)
            enqueue(send_confirmation, order.pk)
        # --8<-- [end:viewset]
