from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import QuerySet, Sum
from rest_framework import serializers

from example_project.payments.models import Charge, Refund


class ChargeSerializer(serializers.HyperlinkedModelSerializer[Charge]):
    """A charge; its ``url`` also becomes the ``Location`` header of a 201."""

    class Meta:
        model = Charge
        fields = [
            "url",
            "id",
            "amount",
            "currency",
            "description",
            "provider_charge_id",
            "created_at",
        ]
        read_only_fields = ["provider_charge_id", "created_at"]
        extra_kwargs = {"url": {"view_name": "charge-detail"}}


class OwnChargeField(serializers.PrimaryKeyRelatedField[Charge]):
    """A charge of the caller's: another caller's charge is "not found", never refundable."""

    def get_queryset(self) -> QuerySet[Charge]:
        return Charge.objects.filter(user_id=self.context["request"].user.pk)


class RefundSerializer(serializers.ModelSerializer[Refund]):
    """A refund on one of the caller's own charges; needs ``request`` in the context."""

    charge = OwnChargeField()

    class Meta:
        model = Refund
        fields = ["id", "charge", "amount", "reason", "created_at"]
        read_only_fields = ["created_at"]

    def create(self, validated_data: dict[str, Any]) -> Refund:
        with transaction.atomic():
            # Locking the charge serialises refunds of it made with different keys, so
            # two of them cannot both pass the check below.
            charge = Charge.objects.select_for_update().get(pk=validated_data["charge"].pk)
            refunded = Refund.objects.filter(charge=charge).aggregate(total=Sum("amount"))
            left = charge.amount - (refunded["total"] or 0)
            if validated_data["amount"] > left:
                raise serializers.ValidationError({"amount": f"Only {left} is left to refund."})
            return Refund.objects.create(**validated_data)
