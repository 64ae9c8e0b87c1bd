"""The clock boundaries of purge and recovery: just before and just after TTL and lease expiry."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from django.urls import get_resolver
from django.utils import timezone as django_tz
from freezegun import freeze_time

from django_idempotency import maintenance
from django_idempotency.models import IdempotencyAuditRecord, IdempotencyRecord, RecordStatus
from tests.helpers import completed, in_progress, new_key

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


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_request_reusing_a_key_after_the_ttl_archives_the_record_it_replaces(api, settings):
    settings.IDEMPOTENCY = {"AUDIT": True, "TTL": timedelta(hours=1)}
    # The URLconf (and what it imports) is loaded before the clock is frozen: some C
    # extensions refuse freezegun's datetime classes at import.
    get_resolver().url_patterns  # noqa: B018
    key = new_key()
    start = django_tz.now()  # near the login: a session frozen years ahead has expired
    with freeze_time(start):
        first = api.post("/charges/", {"amount": 100, "currency": "EUR"}, key=key)
    with freeze_time(start + timedelta(hours=1) - TICK):
        assert api.post("/charges/", {"amount": 100, "currency": "EUR"}, key=key).status_code == 201
    assert IdempotencyAuditRecord.objects.count() == 0
    with freeze_time(start + timedelta(hours=1)):
        again = api.post("/charges/", {"amount": 100, "currency": "EUR"}, key=key)
    assert "Idempotent-Replayed" not in again
    audit = IdempotencyAuditRecord.objects.get()
    assert (audit.key, audit.reason, audit.archived_at) == (
        key,
        "replaced",
        start + timedelta(hours=1),
    )
    assert bytes(audit.response_body) == first.content
    assert IdempotencyRecord.objects.get().created_at == start + timedelta(hours=1)
