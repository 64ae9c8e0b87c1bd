"""What the recipes do, one row per effect: tests and the demo count these rows.

None of them has a unique constraint on the sender's id on purpose: the recipes show that
the idempotency record alone keeps a redelivered event, message or command run from
acting twice.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class WebhookEvent(models.Model):
    """One handled webhook delivery: the sender, its event id and the event's type."""

    sender = models.CharField(max_length=64)
    event_id = models.CharField(max_length=255)
    type = models.CharField(max_length=255, blank=True)
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-received_at", "-id"]

    def __str__(self) -> str:
        return f"{self.sender} {self.type} {self.event_id}"


class Shipment(models.Model):
    """An order shipped by the queue consumer."""

    order_id = models.PositiveIntegerField()
    message_id = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"shipment of order {self.order_id}"


class Statement(models.Model):
    """A monthly statement sent to a customer by ``send_statements``."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    month = models.CharField(max_length=7, help_text="YYYY-MM")
    charges_total = models.PositiveIntegerField()
    sent_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"statement {self.month} for user {self.user_id}"
