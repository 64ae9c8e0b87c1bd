from __future__ import annotations

from django.db import models


class Charge(models.Model):
    """The local side effect the tests count."""

    account = models.CharField(max_length=255)
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)
    provider_charge = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.amount} {self.currency}"


class ProviderCharge(models.Model):
    """A fake payment provider's ledger: one row per distinct idempotency key it was sent."""

    key = models.CharField(max_length=128, unique=True)
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)

    def __str__(self) -> str:
        return self.key


class ProviderCall(models.Model):
    """Every call that reached the fake provider, deduplicated or not."""

    key = models.CharField(max_length=128)

    def __str__(self) -> str:
        return self.key
