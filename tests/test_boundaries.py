"""The clock boundaries of purge and recovery: just before and just after TTL and lease expiry."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from freezegun import freeze_time

from django_idempotency import maintenance
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.test_maintenance import completed, in_progress

pytestmark = pytest.mark.django_db

T = datetime(2031, 6, 1, 8, 30, tzinfo=timezone.utc)
TICK = timedelta(microseconds=1)
JUST_BEFORE, JUST_AFTER = T - TICK, T + TICK


@pytest.mark.parametrize(("moment", "purged"), [(JUST_BEFORE, 0), (T, 1), (JUST_AFTER, 1)])
def test_purge_at_ttl_expiry(moment, purged):
    completed(expires_in=timedelta(0), now=T)
    with freeze_time(moment):
        result = maintenance.purge_expired()
    assert result.deleted == purged
    assert IdempotencyRecord.objects.count() == 1 - purged


@pytest.mark.parametrize(("moment", "purged"), [(JUST_BEFORE, 0), (T, 1), (JUST_AFTER, 1)])
def test_purge_waits_for_the_lease_of_an_expired_in_progress_record(moment, purged):
    # The TTL ran out long ago; the owner's lease is what keeps the record.
    in_progress(lease_in=timedelta(0), expires_in=-timedelta(hours=1), now=T)
    with freeze_time(moment):
        result = maintenance.purge_expired()
    assert result.deleted == purged


@pytest.mark.parametrize(("moment", "found"), [(JUST_BEFORE, 0), (T, 1), (JUST_AFTER, 1)])
def test_recovery_at_lease_expiry(moment, found):
    record = in_progress(lease_in=timedelta(0), policy="fail", now=T)
    with freeze_time(moment):
        result = maintenance.recover_stale_leases()
    assert (result.found, result.failed) == (found, found)
    record.refresh_from_db()
    expected = RecordStatus.FAILED if found else RecordStatus.IN_PROGRESS
    assert record.status == expected


@pytest.mark.parametrize(
    ("moment", "recovered", "purged"), [(JUST_BEFORE, 1, 0), (T, 0, 1), (JUST_AFTER, 0, 1)]
)
def test_a_stale_lease_at_ttl_expiry_passes_from_recovery_to_the_purge(moment, recovered, purged):
    in_progress(lease_in=-timedelta(minutes=1), expires_in=timedelta(0), now=T, policy="fail")
    with freeze_time(moment):
        recovery = maintenance.recover_stale_leases(dry_run=True)
        purge = maintenance.purge_expired(dry_run=True)
    assert (recovery.found, purge.deleted) == (recovered, purged)


@pytest.mark.parametrize(("moment", "purged"), [(JUST_BEFORE, 0), (T, 1), (JUST_AFTER, 1)])
def test_audit_retention_boundary(moment, purged, settings):
    settings.IDEMPOTENCY = {"AUDIT": True, "AUDIT_RETENTION": timedelta(days=7)}
    completed(expires_in=-timedelta(seconds=1), now=T - timedelta(days=7))
    with freeze_time(T - timedelta(days=7)):
        assert maintenance.purge_expired().archived == 1
    with freeze_time(moment):
        result = maintenance.purge_expired()
    assert result.audit_deleted == purged
