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


class FloorRecord(models.Model):
    """The hand-written floor's record (``benchsite.floor``): the fewest columns the design
    needs. A unique key, and two indexes: by expiry (a purge) and the in-flight records (a
    recovery job)."""

    account = models.CharField(max_length=255)
    operation = models.CharField(max_length=255)
    key = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    status = models.CharField(max_length=16)
    lease_token = models.UUIDField(null=True)
    lease_expires_at = models.DateTimeField(null=True)
    expires_at = models.DateTimeField()
    response_status = models.PositiveSmallIntegerField(null=True)
    content_type = models.CharField(max_length=255, blank=True)
    response_body = models.BinaryField(null=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["account", "operation", "key"], name="floor_record_unique_key"
            )
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="floor_expires_idx"),
            models.Index(
                fields=["lease_expires_at"],
                name="floor_inflight_idx",
                condition=models.Q(status="in_progress"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.operation} {self.key}"
