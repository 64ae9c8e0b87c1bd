"""Prometheus metrics, fed by the signals of :mod:`django_idempotency.signals`.

Importing this module needs ``prometheus_client`` (``pip install
"django-idempotency[prometheus]"``); the app config imports it only when that package is
installed. The counters are registered in ``prometheus_client``'s default registry, so
whatever already exposes that registry (``prometheus_client.start_http_server``,
``django-prometheus``' ``/metrics`` view, a multiprocess collector) exposes them too.

Labels stay bounded: an operation is a name chosen in code (a route, a viewset action,
``task:<name>``), never anything a client sends; keys and accounts are never labels.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from django.db import DatabaseError, connections
from django.dispatch import receiver
from prometheus_client import REGISTRY, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from django_idempotency import _stats, outbox, signals
from django_idempotency.conf import app_settings
from django_idempotency.models import RecordStatus

T = TypeVar("T")

logger = logging.getLogger("django_idempotency")


class _RequestCounter(Counter):
    """A counter a request increments: its children are kept by label values, so that a
    request finds its own with one lookup instead of ``labels()``' checks and lock. Removing
    children (``remove``, ``remove_by_labels``, ``clear``) forgets the kept ones too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept: dict[tuple[str, ...], Counter] = {}

    def child(self, *values: str) -> Counter:
        """``labels(*values)``, kept."""
        found = self._kept.get(values)
        if found is None:
            found = self._kept[values] = self.labels(*values)
        return found

    def remove(self, *labelvalues: Any) -> None:
        self._kept.clear()
        super().remove(*labelvalues)

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        self._kept.clear()
        super().remove_by_labels(labels)

    def clear(self) -> None:
        self._kept.clear()
        super().clear()


claims = _RequestCounter(
    "django_idempotency_claims",
    "Keys claimed by a request, which then ran its view. takeover: a stale lease was taken over.",
    ["operation", "takeover"],
)
replays = _RequestCounter(
    "django_idempotency_replays",
    "Stored responses replayed to a retry.",
    ["operation"],
)
conflicts = _RequestCounter(
    "django_idempotency_conflicts",
    "Retries answered 409 because the original was still in progress.",
    ["operation"],
)
mismatches = _RequestCounter(
    "django_idempotency_mismatches",
    "Keys reused with a different request, answered 422.",
    ["operation"],
)
recoveries = Counter(
    "django_idempotency_recoveries",
    "Stale leases handled by a recovery policy, on a retry, by the recovery job or the admin."
    ' outcome="resumed": a retry took a resumable operation over, to resume it.',
    ["policy", "outcome"],
)
lease_losses = _RequestCounter(
    "django_idempotency_lease_losses",
    "Attempts rolled back because a newer attempt took their lease over.",
    ["operation"],
)
unreadable = Counter(
    "django_idempotency_unreadable",
    "Retries refused because their record's stored outcome cannot be read back (sealed with a"
    " key ENCRYPTION_KEYS does not hold, or damaged); nothing ran. key_id: the key that sealed"
    " it, empty when unknown.",
    ["operation", "key_id"],
)
purged = Counter(
    "django_idempotency_purged_records",
    "Records deleted by the purge: table=records, audit (the audit trail) or outbox (sent).",
    ["table"],
)


outbox_relayed = Counter(
    "django_idempotency_outbox_messages",
    "Outbox messages handled by the relay: outcome=sent, failed (retried later) or dead.",
    ["outcome"],
)
outbox_relay_errors = Counter(
    "django_idempotency_outbox_relay_errors",
    "Unexpected errors the outbox relay met (not failed sends): the batch in hand rolled back.",
)


def _query(read: Callable[[], T], what: str, failed: T) -> T:
    """What ``read()`` reads on scrape; ``failed`` when the database cannot answer.

    A scrape usually runs in a thread of the metrics server, outside any request, where
    nothing would close a connection this query opens: it is closed again here.
    """
    connection = connections[app_settings.DATABASE]
    opened_here = connection.connection is None
    try:
        return read()
    except DatabaseError:
        logger.warning("could not read %s", what, exc_info=True)
        return failed
    finally:
        if opened_here and not connection.in_atomic_block:
            connection.close()


def _read_database(read: Callable[[], float | None], what: str) -> float:
    """One figure read on scrape; NaN when the database cannot answer, 0 for ``None``."""
    value = _query(read, what, cast(float | None, math.nan))
    return float(value or 0.0)


def oldest_in_progress_seconds() -> float:
    """The in-progress gauge's value: one indexed query per scrape."""
    return _read_database(
        lambda: _stats.oldest_in_progress_seconds(), "the oldest in-progress idempotency record"
    )


class DatabaseGauge(Collector):
    """A gauge read from the database on scrape (``name``, ``documentation``, ``read``).

    A collector rather than a process-local gauge, so that it reports the database's state
    whichever process is scraped; in ``prometheus_client``'s multiprocess mode, register it
    in the registry that serves ``/metrics`` next to the ``MultiProcessCollector``.
    """

    name = ""
    documentation = ""

    def read(self) -> float:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        # Registration asks for the names: answering here keeps it from running the query.
        return [GaugeMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, value=self.read())


class OldestInProgressCollector(DatabaseGauge):
    """``django_idempotency_oldest_in_progress_seconds``, read from the database on scrape."""

    name = "django_idempotency_oldest_in_progress_seconds"
    documentation = "Age of the oldest in-progress record (0 when none), read on scrape."

    def read(self) -> float:
        return oldest_in_progress_seconds()


class OutboxPendingCollector(DatabaseGauge):
    """``django_idempotency_outbox_pending``: messages waiting to be sent."""

    name = "django_idempotency_outbox_pending"
    documentation = "Outbox messages pending (due or backing off), read on scrape."

    def read(self) -> float:
        return _read_database(lambda: outbox.pending_count(), "the pending outbox messages")


class OutboxOldestPendingCollector(DatabaseGauge):
    """``django_idempotency_outbox_oldest_pending_seconds``: how late the relay is."""

    name = "django_idempotency_outbox_oldest_pending_seconds"
    documentation = "Age of the oldest pending outbox message (0 when none), read on scrape."

    def read(self) -> float:
        return _read_database(
            lambda: outbox.oldest_pending_seconds(), "the oldest pending outbox message"
        )


class ResumableRecordsCollector(Collector):
    """``django_idempotency_resumable_records``: records under the recovery policy
    ``"resume"``, by ``status``, read from the database on scrape (their partial index).
    Every status is NaN when the database cannot answer."""

    name = "django_idempotency_resumable_records"
    documentation = (
        'Records of resumable operations (recovery policy "resume") by status, read on scrape.'
    )

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=["status"])]

    def collect(self) -> Iterable[Metric]:
        counts = _query(_stats.resumable_by_status, "the resumable idempotency records", None)
        family = GaugeMetricFamily(self.name, self.documentation, labels=["status"])
        for status in RecordStatus.values:
            family.add_metric([status], math.nan if counts is None else float(counts[status]))
        yield family


oldest_in_progress = OldestInProgressCollector()
REGISTRY.register(oldest_in_progress)
outbox_pending = OutboxPendingCollector()
REGISTRY.register(outbox_pending)
outbox_oldest_pending = OutboxOldestPendingCollector()
REGISTRY.register(outbox_oldest_pending)
resumable_records = ResumableRecordsCollector()
REGISTRY.register(resumable_records)


def _operation(kwargs: dict[str, Any]) -> str:
    return str(kwargs.get("operation", ""))


@receiver(signals.record_claimed, dispatch_uid="django_idempotency.metrics.claimed")
def _claimed(**kwargs: Any) -> None:
    claims.child(_operation(kwargs), "true" if kwargs.get("takeover") else "false").inc()


@receiver(signals.response_replayed, dispatch_uid="django_idempotency.metrics.replayed")
def _replayed(**kwargs: Any) -> None:
    replays.child(_operation(kwargs)).inc()


@receiver(signals.request_conflicted, dispatch_uid="django_idempotency.metrics.conflicted")
def _conflicted(**kwargs: Any) -> None:
    conflicts.child(_operation(kwargs)).inc()


@receiver(signals.payload_mismatched, dispatch_uid="django_idempotency.metrics.mismatched")
def _mismatched(**kwargs: Any) -> None:
    mismatches.child(_operation(kwargs)).inc()


@receiver(signals.lease_recovered, dispatch_uid="django_idempotency.metrics.recovered")
def _recovered(**kwargs: Any) -> None:
    recoveries.labels(str(kwargs.get("policy", "")), str(kwargs.get("outcome", ""))).inc()


@receiver(signals.lease_lost, dispatch_uid="django_idempotency.metrics.lease_lost")
def _lease_lost(**kwargs: Any) -> None:
    lease_losses.child(_operation(kwargs)).inc()


@receiver(signals.record_unreadable, dispatch_uid="django_idempotency.metrics.unreadable")
def _unreadable(**kwargs: Any) -> None:
    unreadable.labels(_operation(kwargs), str(kwargs.get("key_id") or "")).inc()


@receiver(signals.records_purged, dispatch_uid="django_idempotency.metrics.purged")
def _purged(**kwargs: Any) -> None:
    purged.labels("records").inc(int(kwargs.get("count") or 0))
    purged.labels("audit").inc(int(kwargs.get("audit") or 0))
    purged.labels("outbox").inc(int(kwargs.get("outbox") or 0))


@receiver(signals.outbox_relayed, dispatch_uid="django_idempotency.metrics.outbox_relayed")
def _outbox_relayed(**kwargs: Any) -> None:
    for outcome in ("sent", "failed", "dead"):
        outbox_relayed.labels(outcome).inc(int(kwargs.get(outcome) or 0))


@receiver(signals.outbox_relay_failed, dispatch_uid="django_idempotency.metrics.relay_failed")
def _outbox_relay_failed(**kwargs: Any) -> None:
    outbox_relay_errors.inc()
