from __future__ import annotations

from django.conf import settings
from django.db import models


class Charge(models.Model):
    """The side effect every benchmark counts: one row per executed create."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)
    description = models.CharField(max_length=200, blank=True, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.amount} {self.currency}"
