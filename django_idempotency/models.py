"""The record that stores one claimed idempotency key and, once done, its response."""

from __future__ import annotations

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _


class RecordStatus(models.TextChoices):
    """Where a record stands in its state machine (see the README's "How it works")."""

    IN_PROGRESS = "in_progress", _("in progress")
    COMPLETED = "completed", _("completed")
    FAILED = "failed", _("failed")


class IdempotencyRecord(models.Model):
    """One logical operation: ``(account, operation, key)`` is unique.

    A row is created by the atomic claim (``in_progress`` with a lease and an owner token),
    becomes ``completed`` in the same transaction as the view's own writes, or ``failed``
    when a stale lease meets the ``"fail"`` recovery policy. A released claim is deleted.
    """

    account = models.CharField(max_length=255)
    operation = models.CharField(max_length=255)
    key = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    fingerprint_version = models.CharField(max_length=64, default="v1")
    status = models.CharField(
        max_length=16, choices=RecordStatus.choices, default=RecordStatus.IN_PROGRESS
    )
    lease_token = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    recovery_policy = models.CharField(max_length=255, default="retry")
    recovery_attempts = models.PositiveIntegerField(default=0)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_headers = models.JSONField(default=list, blank=True)
    response_body = models.BinaryField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    completed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()

    class Meta:
        verbose_name = _("idempotency record")
        verbose_name_plural = _("idempotency records")
        db_table = "django_idempotency_record"
        constraints = [
            models.UniqueConstraint(
                fields=["account", "operation", "key"], name="idempotency_record_unique_key"
            ),
        ]
        indexes = [
            # The purge scans by expiry; the recovery job by status and lease.
            models.Index(fields=["expires_at"], name="idempotency_expires_idx"),
            models.Index(fields=["status", "lease_expires_at"], name="idempotency_lease_idx"),
            models.Index(fields=["operation", "status"], name="idempotency_op_status_idx"),
            models.Index(fields=["created_at"], name="idempotency_created_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.operation} {self.key} ({self.status})"
