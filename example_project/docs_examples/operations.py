"""Operations code shown in the documentation: the maintenance API, signals, metrics."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.dispatch import receiver
from django.utils import timezone
from prometheus_client import CollectorRegistry

# --8<-- [start:maintenance]
from django_idempotency import maintenance
from django_idempotency.models import IdempotencyRecord


def nightly() -> dict[str, Any]:
    purged = maintenance.purge_expired(batch_size=500, max_batches=100)
    recovered = maintenance.recover_stale_leases(limit=1000)
    return {
        "deleted": purged.deleted,
        "complete": purged.complete,  # False when max_batches stopped it
        "longest_batch_seconds": purged.longest_batch_seconds,
        "released": recovered.released,
        "failed": recovered.failed,
        "by_policy": recovered.policies,  # {"retry": 3, "fail": 1, ...}
    }


def backlog() -> dict[str, int]:
    now = timezone.now()
    return {
        "expired": IdempotencyRecord.objects.expired(now).count(),  # what the purge deletes
        "stale": IdempotencyRecord.objects.stale(now).count(),  # what recovery handles
    }


def stuck_claims() -> int:
    stale = IdempotencyRecord.objects.filter(status="in_progress")
    return maintenance.release_stale(stale)  # the admin's "Release stale claims"


# --8<-- [end:maintenance]

conflicts: Counter[str] = Counter()

# --8<-- [start:receiver]
from django_idempotency.signals import request_conflicted


@receiver(request_conflicted)
def count_conflicts(sender: type, operation: str, **kwargs: Any) -> None:
    conflicts[operation] += 1  # e.g. statsd.incr(f"idempotency.conflict.{operation}")


# --8<-- [end:receiver]


# --8<-- [start:multiprocess]
from prometheus_client import multiprocess

from django_idempotency.metrics import (
    OldestInProgressCollector,
    OutboxOldestPendingCollector,
    OutboxPendingCollector,
    ResumableRecordsCollector,
)


def metrics_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # reads PROMETHEUS_MULTIPROC_DIR
    registry.register(OldestInProgressCollector())
    registry.register(OutboxPendingCollector())
    registry.register(OutboxOldestPendingCollector())
    registry.register(ResumableRecordsCollector())
    return registry


# --8<-- [end:multiprocess]
