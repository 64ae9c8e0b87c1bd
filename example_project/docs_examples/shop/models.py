"""The shop's orders: one row per logical order, whatever the retries."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Order(models.Model):
    """An item a customer bought, and the gateway's reference of its payment."""

    customer = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="shop_orders"
    )
    item = models.CharField(max_length=100)
    amount = models.PositiveIntegerField(help_text="In the currency's minor unit (cents).")
    currency = models.CharField(max_length=3)
    payment = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.item} ({self.payment})"
