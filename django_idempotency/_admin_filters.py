"""The admin changelists' filters: each one served by an index, none counting the table."""

from __future__ import annotations

from typing import Any, cast

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_idempotency import _stats, crypto
from django_idempotency.conf import app_settings
from django_idempotency.models import (
    IdempotencyRecord,
    OutboxMessage,
    OutboxStatus,
    RecordStatus,
    expired_q,
)


def records_of(queryset: Any) -> QuerySet[IdempotencyRecord]:
    # The stubs type a filtered QuerySet[Any] as Any; this names what it is.
    return cast("QuerySet[IdempotencyRecord]", queryset)


class OperationFilter(admin.SimpleListFilter):
    """Filter by operation; the choices are read through an index, bounded in number."""

    title = _("operation")
    parameter_name = "operation"
    # The choices are computed on every changelist view; past this many the list is cut
    # (a name can still be filtered on through the URL or the search box).
    max_choices = 100

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = _stats.operations(limit=self.max_choices)
        current = self.value()
        if current and current not in names:
            names.append(current)
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        return records_of(queryset.filter(operation=value)) if value else None


class ExpiredFilter(admin.SimpleListFilter):
    """What the purge would delete now: past ``expires_at`` and not held by a live lease."""

    title = _("expired")
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("yes", _("Expired, not yet purged")), ("no", _("Not expired"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "yes":
            return records_of(queryset.filter(expired_q(timezone.now())))
        if self.value() == "no":
            return records_of(queryset.exclude(expired_q(timezone.now())))
        return None


class LeaseFilter(admin.SimpleListFilter):
    """In-progress records whose lease is still running, or has run out (stale)."""

    title = _("lease")
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("live", _("Live lease")), ("stale", _("Stale lease"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        now = timezone.now()
        in_progress = queryset.filter(status=RecordStatus.IN_PROGRESS)
        if self.value() == "live":
            return records_of(in_progress.filter(lease_expires_at__gt=now))
        if self.value() == "stale":
            return records_of(in_progress.filter(lease_expires_at__lte=now))
        return None


class ReadableFilter(admin.SimpleListFilter):
    """Completed and failed records whose stored outcome no key of ``ENCRYPTION_KEYS`` opens:
    their retries are refused until the key that sealed them is configured again. (A token
    damaged under a configured key is found only when read: its page says so.)"""

    title = _("outcome readable")
    parameter_name = "readable"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("no", _("No: sealed with a key not in ENCRYPTION_KEYS"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "no":
            return records_of(crypto.unopenable(queryset.exclude(status=RecordStatus.IN_PROGRESS)))
        return None


class TaskFilter(admin.SimpleListFilter):
    """Filter by task. The choices are the tasks of pending and dead messages (what an
    operator looks for, few and found through the status index), plus the chosen one; any
    task can be filtered on through the URL."""

    title = _("task")
    parameter_name = "task"
    max_choices = 100

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        waiting = OutboxMessage.objects.using(app_settings.DATABASE).filter(
            status__in=[OutboxStatus.PENDING, OutboxStatus.DEAD]
        )
        names = sorted(set(waiting.values_list("task", flat=True)[: self.max_choices * 10]))
        names = names[: self.max_choices]
        current = self.value()
        if current and current not in names:
            names.append(current)
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        return queryset.filter(task=self.value()) if self.value() else queryset
