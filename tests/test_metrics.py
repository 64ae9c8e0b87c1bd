"""Prometheus metrics: counters fed by the signals, and the oldest in-progress gauge."""

from __future__ import annotations

import math
import uuid
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection
from django.utils import timezone

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="the [prometheus] extra is not installed"
)

from django_idempotency import _stats, maintenance, metrics, signals  # noqa: E402
from django_idempotency.models import IdempotencyRecord, RecordStatus  # noqa: E402
from tests.factories import RecordFactory  # noqa: E402
from tests.helpers import new_key  # noqa: E402

REGISTRY = prometheus_client.REGISTRY
CHARGE = {"amount": 100, "currency": "EUR"}


def value(name: str, **labels: str) -> float:
    """One sample, read from its own metric: a registry-wide read would run the gauge's query."""
    for metric in (
        metrics.claims,
        metrics.replays,
        metrics.conflicts,
        metrics.mismatches,
        metrics.recoveries,
        metrics.lease_losses,
        metrics.purged,
    ):
        for family in metric.collect():
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
    return 0.0


def gauge() -> float | None:
    return REGISTRY.get_sample_value("django_idempotency_oldest_in_progress_seconds")


def send(signal, **kwargs) -> None:
    signal.send(sender=IdempotencyRecord, **kwargs)


@pytest.mark.parametrize(
    ("signal", "metric", "labels", "extra"),
    [
        (
            signals.record_claimed,
            "django_idempotency_claims_total",
            {"operation": "t.op", "takeover": "false"},
            {"takeover": False},
        ),
        (
            signals.record_claimed,
            "django_idempotency_claims_total",
            {"operation": "t.op", "takeover": "true"},
            {"takeover": True},
        ),
        (
            signals.response_replayed,
            "django_idempotency_replays_total",
            {"operation": "t.op"},
            {"status": 201},
        ),
        (
            signals.request_conflicted,
            "django_idempotency_conflicts_total",
            {"operation": "t.op"},
            {},
        ),
        (
            signals.payload_mismatched,
            "django_idempotency_mismatches_total",
            {"operation": "t.op"},
            {},
        ),
        (signals.lease_lost, "django_idempotency_lease_losses_total", {"operation": "t.op"}, {}),
    ],
)
def test_request_signals_count(signal, metric, labels, extra):
    before = value(metric, **labels)
    send(signal, request=None, account="user:1", operation="t.op", key="k", **extra)
    assert value(metric, **labels) == before + 1


def test_recoveries_count_by_policy_and_outcome():
    labels = {"policy": "fail", "outcome": "failed"}
    before = value("django_idempotency_recoveries_total", **labels)
    send(
        signals.lease_recovered,
        account="user:1",
        operation="t.op",
        key="k",
        policy="fail",
        outcome="failed",
    )
    assert value("django_idempotency_recoveries_total", **labels) == before + 1


def test_purged_rows_count_per_table():
    records = value("django_idempotency_purged_records_total", table="records")
    audit = value("django_idempotency_purged_records_total", table="audit")
    send(signals.records_purged, count=5, audit=2)
    assert value("django_idempotency_purged_records_total", table="records") == records + 5
    assert value("django_idempotency_purged_records_total", table="audit") == audit + 2


@pytest.mark.django_db
def test_keys_and_accounts_are_never_labels():
    send(
        signals.record_claimed,
        request=None,
        account="user:secret-account",
        operation="t.op",
        key="secret-key",
        takeover=False,
    )
    exposed = prometheus_client.generate_latest(REGISTRY).decode()
    assert "secret-key" not in exposed
    assert "secret-account" not in exposed


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_counters_follow_real_requests(api):
    operation = {"operation": "POST charges/"}
    claims = value("django_idempotency_claims_total", **operation, takeover="false")
    replays = value("django_idempotency_replays_total", **operation)
    mismatches = value("django_idempotency_mismatches_total", **operation)
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    api.post("/charges/", CHARGE, key=key)
    api.post("/charges/", {**CHARGE, "amount": 5}, key=key)
    assert value("django_idempotency_claims_total", **operation, takeover="false") == claims + 1
    assert value("django_idempotency_replays_total", **operation) == replays + 1
    assert value("django_idempotency_mismatches_total", **operation) == mismatches + 1


@pytest.mark.django_db
def test_counters_follow_the_maintenance_jobs():
    now = timezone.now()
    purged = value("django_idempotency_purged_records_total", table="records")
    recovered = value("django_idempotency_recoveries_total", policy="retry", outcome="released")
    RecordFactory.create_batch(2, expires_at=now - timedelta(hours=1))
    RecordFactory(
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=now - timedelta(seconds=1),
    )
    maintenance.purge_expired()
    maintenance.recover_stale_leases()
    assert value("django_idempotency_purged_records_total", table="records") == purged + 2
    assert (
        value("django_idempotency_recoveries_total", policy="retry", outcome="released")
        == recovered + 1
    )


# -- the gauge ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_oldest_in_progress_gauge_reads_the_database():
    assert gauge() == 0.0
    RecordFactory(
        status=RecordStatus.IN_PROGRESS,
        created_at=timezone.now() - timedelta(minutes=3),
        lease_expires_at=timezone.now() + timedelta(minutes=1),
    )
    RecordFactory(created_at=timezone.now() - timedelta(hours=3))  # completed: not counted
    assert gauge() == pytest.approx(180, abs=5)


@pytest.mark.django_db
def test_oldest_in_progress_gauge_is_nan_when_the_database_fails(monkeypatch):
    def unreachable(*args, **kwargs):
        raise DatabaseError("connection refused")

    monkeypatch.setattr(_stats, "oldest_in_progress_seconds", unreachable)
    assert math.isnan(gauge())


@pytest.mark.skipif(
    connection.vendor == "sqlite", reason="Django never closes SQLite's in-memory test database"
)
@pytest.mark.django_db(transaction=True)
def test_a_scrape_closes_the_connection_it_opened():
    # A metrics server thread has no request cycle to close its connection.
    connection.close()
    assert metrics.oldest_in_progress_seconds() == 0.0
    assert connection.connection is None


@pytest.mark.django_db
def test_a_scrape_keeps_a_connection_it_did_not_open():
    connection.ensure_connection()
    metrics.oldest_in_progress_seconds()
    assert connection.connection is not None


def test_registering_the_gauge_runs_no_query():
    # No django_db mark: a query here would fail the test.
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.OldestInProgressCollector())


@pytest.mark.django_db
def test_the_gauge_serves_another_registry_too():
    # As in multiprocess mode, next to a MultiProcessCollector.
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.OldestInProgressCollector())
    RecordFactory(
        status=RecordStatus.IN_PROGRESS,
        created_at=timezone.now() - timedelta(seconds=90),
        lease_expires_at=timezone.now() + timedelta(minutes=1),
    )
    sample = registry.get_sample_value("django_idempotency_oldest_in_progress_seconds")
    assert sample == pytest.approx(90, abs=5)


# -- resumable operations --------------------------------------------------------------------


def resumable_gauge() -> dict[str, float]:
    return {
        status: REGISTRY.get_sample_value(
            "django_idempotency_resumable_records", {"status": status}
        )
        for status in RecordStatus.values
    }


@pytest.mark.django_db
def test_the_resumable_records_gauge_reads_them_by_status():
    assert resumable_gauge() == {"in_progress": 0.0, "completed": 0.0, "failed": 0.0}
    RecordFactory.create_batch(2, recovery_policy="resume")
    RecordFactory(recovery_policy="resume", status=RecordStatus.FAILED)
    RecordFactory(
        recovery_policy="resume",
        status=RecordStatus.IN_PROGRESS,
        lease_expires_at=timezone.now() + timedelta(minutes=1),
    )
    RecordFactory.create_batch(3)  # "retry": not resumable
    assert resumable_gauge() == {"in_progress": 1.0, "completed": 2.0, "failed": 1.0}


@pytest.mark.django_db
def test_the_resumable_records_gauge_is_nan_when_the_database_fails(monkeypatch):
    def unreachable(*args, **kwargs):
        raise DatabaseError("connection refused")

    monkeypatch.setattr(_stats, "resumable_by_status", unreachable)
    assert all(math.isnan(v) for v in resumable_gauge().values())


def test_registering_the_resumable_gauge_runs_no_query():
    prometheus_client.CollectorRegistry().register(metrics.ResumableRecordsCollector())


def recoveries(policy: str, outcome: str) -> float:
    return value("django_idempotency_recoveries_total", policy=policy, outcome=outcome)


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_resume_of_run_once_is_counted_apart_from_retries():
    from django_idempotency import run_once, step
    from django_idempotency.exceptions import SimulatedCrash
    from django_idempotency.testing import expire_lease
    from tests.testapp.models import Charge

    crash = [True]

    def body() -> int:
        pk = step("ride", lambda: Charge.objects.create(account="ride", amount=1).pk)
        if crash.pop():
            raise SimulatedCrash
        return pk

    identity = {"account": "consumer:rides", "operation": "rides.book", "key": "k-1"}
    resumed, retried = recoveries("resume", "resumed"), recoveries("resume", "retried")
    with pytest.raises(SimulatedCrash):
        run_once(body, **identity, recovery="resume")
    expire_lease("k-1")
    crash.append(False)
    run_once(body, **identity, recovery="resume")
    run_once(body, **identity, recovery="resume")  # a replay: no recovery
    assert recoveries("resume", "resumed") == resumed + 1
    assert recoveries("resume", "retried") == retried
    assert Charge.objects.filter(account="ride").count() == 1


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_resume_of_a_view_is_counted_apart_from_retries(api):
    from django_idempotency.testing import crash_after, expire_lease
    from tests.testapp.models import Charge, ProviderCall

    key = new_key()
    resumed, retried = recoveries("resume", "resumed"), recoveries("resume", "retried")
    with crash_after("tests.testapp.steps.charge"):
        api.post("/steps/book/", key=key)
    expire_lease(key)
    assert api.post("/steps/book/", key=key).status_code == 201
    assert recoveries("resume", "resumed") == resumed + 1
    assert recoveries("resume", "retried") == retried
    # The ride once; the charge's call twice (the crash came inside that step), one key.
    assert Charge.objects.filter(account="ride").count() == 1
    charges = ProviderCall.objects.exclude(key__startswith="receipt:")
    assert charges.count() == 2
    assert len(set(charges.values_list("key", flat=True))) == 1
    assert ProviderCall.objects.filter(key__startswith="receipt:").count() == 1


@pytest.mark.django_db
def test_the_recovery_job_counts_no_recovery_of_a_resumable_record():
    left = {policy: recoveries("resume", policy) for policy in ("released", "resumed")}
    RecordFactory(
        recovery_policy="resume",
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    assert maintenance.recover_stale_leases().resumable == 1
    assert {policy: recoveries("resume", policy) for policy in left} == left


@pytest.mark.parametrize("forget", ["clear", "remove", "remove_by_labels"])
def test_a_request_counter_counts_again_after_its_children_are_removed(forget):
    # The request counters keep their children; removing them must not leave a kept child
    # that nothing exports any more.
    send(signals.response_replayed, operation="t.kept", status=201)
    assert value("django_idempotency_replays_total", operation="t.kept") >= 1
    if forget == "clear":
        metrics.replays.clear()
    elif forget == "remove":
        metrics.replays.remove("t.kept")
    else:
        if not hasattr(prometheus_client.Counter, "remove_by_labels"):
            pytest.skip("this prometheus_client has no remove_by_labels")
        metrics.replays.remove_by_labels({"operation": "t.kept"})
    assert value("django_idempotency_replays_total", operation="t.kept") == 0
    send(signals.response_replayed, operation="t.kept", status=201)
    send(signals.response_replayed, operation="t.kept", status=201)
    assert value("django_idempotency_replays_total", operation="t.kept") == 2
