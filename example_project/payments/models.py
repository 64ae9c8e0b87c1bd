"""The example's own data (charges and refunds) and the fake payment provider's ledger."""

from __future__ import annotations

import secrets

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

currency_code = RegexValidator(r"^[A-Z]{3}$", "An ISO 4217 code in capitals, e.g. EUR.")


class Charge(models.Model):
    """Money taken from a customer: one row per logical charge, whatever the retries."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="charges"
    )
    amount = models.PositiveIntegerField(
        validators=[MinValueValidator(1)], help_text="In the currency's minor unit (cents)."
    )
    currency = models.CharField(max_length=3, validators=[currency_code])
    description = models.CharField(max_length=200, blank=True)
    provider_charge_id = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(amount__gt=0), name="charge_amount_positive")
        ]

    def __str__(self) -> str:
        return f"{self.amount} {self.currency} ({self.provider_charge_id})"


class Refund(models.Model):
    """Money given back on a charge; the refunds of a charge never exceed its amount."""

    charge = models.ForeignKey(Charge, on_delete=models.PROTECT, related_name="refunds")
    amount = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    reason = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(amount__gt=0), name="refund_amount_positive")
        ]

    def __str__(self) -> str:
        return f"refund of {self.amount} on charge {self.charge_id}"


def new_provider_reference() -> str:
    return f"ch_{secrets.token_hex(12)}"


class ProviderCharge(models.Model):
    """The fake provider's ledger: one row per idempotency key it was sent, never two."""

    key = models.CharField(max_length=128, unique=True)
    reference = models.CharField(max_length=64, unique=True, default=new_provider_reference)
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.reference


class ProviderCall(models.Model):
    """Every call that reached the fake provider, whether it made a charge or not."""

    key = models.CharField(max_length=128, db_index=True)
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.key


class Ride(models.Model):
    """A ride booked through ``POST /api/rides/``, in the manner of Stripe's rocket-rides: the
    ride is created, then charged, then its receipt is mailed, each a step of one operation
    that resumes after a crash (``recovery="resume"``)."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="rides"
    )
    origin = models.CharField(max_length=200)
    target = models.CharField(max_length=200)
    amount = models.PositiveIntegerField(
        validators=[MinValueValidator(1)], help_text="In the currency's minor unit (cents)."
    )
    currency = models.CharField(max_length=3, validators=[currency_code])
    #: Set by the charge step, with the step's recorded result.
    provider_charge_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(amount__gt=0), name="ride_amount_positive")
        ]

    def __str__(self) -> str:
        return f"{self.origin} → {self.target}"


class SentMail(models.Model):
    """The fake mail service's outbox: one row per mail it was asked to send. A mail service
    takes no idempotency key: every call sends a mail."""

    recipient = models.CharField(max_length=254)
    subject = models.CharField(max_length=200)
    body = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.subject} to {self.recipient}"
