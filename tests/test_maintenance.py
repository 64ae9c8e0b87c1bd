"""The maintenance module and its commands: purge in batches, the audit trail, recovery."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from io import StringIO
from typing import Any
from unittest import mock

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.db import DatabaseError, connection, transaction
from django.http import HttpResponse, JsonResponse
from django.test import override_settings

from django_idempotency import checks, maintenance, signals
from django_idempotency.models import (
    IdempotencyAuditRecord,
    IdempotencyRecord,
    IdempotencyStep,
    RecordStatus,
)
from tests.helpers import NOW, bulk_records, completed, in_progress, keys

pytestmark = pytest.mark.django_db

AUDIT_ON = override_settings(IDEMPOTENCY={"AUDIT": True})


def remaining_keys() -> set[str]:
    return set(IdempotencyRecord.objects.values_list("key", flat=True))


# -- purge ------------------------------------------------------------------------------------


def test_purge_deletes_expired_records_and_keeps_the_rest():
    completed(expires_in=-timedelta(seconds=1), key="old")
    completed(expires_in=timedelta(seconds=1), key="young")
    in_progress(lease_in=timedelta(seconds=30), expires_in=-timedelta(seconds=1), key="held")
    in_progress(lease_in=-timedelta(seconds=1), expires_in=-timedelta(seconds=1), key="dead")
    in_progress(lease_in=-timedelta(seconds=1), key="stale-but-young")

    result = maintenance.purge_expired(now=NOW)

    assert result.deleted == 2
    assert result.batches == 1
    assert result.complete
    assert remaining_keys() == {"young", "held", "stale-but-young"}


def test_purge_in_bounded_batches():
    bulk_records(10_000, expires_at=NOW - timedelta(minutes=1), prefix="expired")
    bulk_records(100, expires_at=NOW + timedelta(minutes=1), prefix="live")
    seen: list[tuple[int, int]] = []

    result = maintenance.purge_expired(
        batch_size=500, now=NOW, progress=lambda b, r: seen.append((b, r))
    )

    assert result.deleted == 10_000
    assert result.batches >= 20
    assert result.longest_batch_seconds > 0
    assert seen[-1] == (result.batches, 10_000)
    assert remaining_keys() == {f"live-{n}" for n in range(100)}


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's planner settings")
@pytest.mark.parametrize("audit", [False, True], ids=["plain", "audit"])
def test_a_batch_never_exceeds_its_size_whatever_the_plan(audit):
    """With the statistics a table of mixed age can have, PostgreSQL may plan the batch's
    DELETE as a nested loop that runs the pick (``LIMIT ... FOR UPDATE SKIP LOCKED``) again
    for every row; each run skips the rows already deleted and locks the next batch. The
    settings below make that plan the cheapest: the batch still deletes its size and no more."""
    bulk_records(2_000, expires_at=NOW - timedelta(minutes=1), prefix="expired")
    with connection.cursor() as cursor:
        for setting in ("hashjoin", "mergejoin", "material", "hashagg", "sort"):
            cursor.execute(f"SET LOCAL enable_{setting} = off")

    with override_settings(IDEMPOTENCY={"AUDIT": audit}):
        result = maintenance.purge_expired(batch_size=500, max_batches=1, now=NOW)

    assert (result.deleted, result.batches, result.complete) == (500, 1, False)
    assert IdempotencyRecord.objects.count() == 1_500
    assert IdempotencyAuditRecord.objects.count() == (500 if audit else 0)


def test_max_batches_stops_the_run_and_says_so():
    bulk_records(25, expires_at=NOW - timedelta(minutes=1), prefix="expired")

    first = maintenance.purge_expired(batch_size=10, max_batches=2, now=NOW)
    assert (first.deleted, first.batches, first.complete) == (20, 2, False)
    second = maintenance.purge_expired(batch_size=10, max_batches=2, now=NOW)
    assert (second.deleted, second.batches, second.complete) == (5, 1, True)


@override_settings(IDEMPOTENCY={"PURGE_MAX_BATCHES": 1, "PURGE_BATCH_SIZE": 3})
def test_settings_give_the_defaults():
    bulk_records(10, expires_at=NOW - timedelta(minutes=1), prefix="expired")
    result = maintenance.purge_expired(now=NOW)
    assert (result.deleted, result.batches, result.complete) == (3, 1, False)


def test_dry_run_counts_and_deletes_nothing():
    bulk_records(25, expires_at=NOW - timedelta(minutes=1), prefix="expired")
    received: list[Any] = []
    signals.records_purged.connect(received.append, dispatch_uid="dry")
    try:
        result = maintenance.purge_expired(batch_size=10, dry_run=True, now=NOW)
        capped = maintenance.purge_expired(batch_size=10, max_batches=2, dry_run=True, now=NOW)
    finally:
        signals.records_purged.disconnect(dispatch_uid="dry")
    assert (result.deleted, result.batches, result.dry_run, result.complete) == (25, 3, True, True)
    assert (capped.deleted, capped.batches, capped.complete) == (20, 2, False)
    assert IdempotencyRecord.objects.count() == 25
    assert received == []


def test_purge_sends_records_purged():
    completed(expires_in=-timedelta(seconds=1))
    received: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        received.append(kwargs)

    signals.records_purged.connect(receiver, dispatch_uid="test")
    try:
        maintenance.purge_expired(now=NOW)
    finally:
        signals.records_purged.disconnect(dispatch_uid="test")
    assert len(received) == 1
    assert received[0]["sender"] is IdempotencyRecord
    assert (received[0]["count"], received[0]["audit"]) == (1, 0)


def test_manager_delete_expired_is_the_same_purge():
    completed(expires_in=-timedelta(seconds=1))
    result = IdempotencyRecord.objects.delete_expired(now=NOW)
    assert result.deleted == 1
    assert IdempotencyRecord.objects.count() == 0


def test_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match="batch_size must be a whole number from 1"):
        maintenance.purge_expired(batch_size=0)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "3", 2**63])
def test_every_maintenance_entry_refuses_the_counts_its_command_refuses(value: Any):
    """The relay's ``batch_size`` takes what ``OUTBOX_BATCH_SIZE`` admits; the purge's, the
    recovery's and the rotation's counts (the Python API and the beat tasks alike) take what
    their commands and settings admit, a whole number from 1 to 2147483647, and refuse the
    rest before touching anything: ``limit=0`` does not quietly recover nothing."""
    pytest.importorskip("cryptography")
    from cryptography.fernet import Fernet

    from django_idempotency import tasks

    completed(expires_in=-timedelta(seconds=1), key="expired")
    stale = in_progress(lease_in=-timedelta(seconds=1), key="stale")
    plain = completed(expires_in=timedelta(hours=1), key="plain", response_body=b"{}")
    refused = []
    calls = [
        lambda: maintenance.purge_expired(batch_size=value, now=NOW),
        lambda: maintenance.purge_expired(max_batches=value, now=NOW),
        lambda: tasks.purge_expired.apply(kwargs={"max_batches": value}).get(),
        lambda: maintenance.recover_stale_leases(limit=value, now=NOW),
        lambda: tasks.recover_stale_leases.apply(kwargs={"limit": value}).get(),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="whole number from 1 to 2147483647"):
            call()
        refused.append(call)
    with keys(Fernet.generate_key().decode()):
        with pytest.raises(ValueError, match="whole number from 1 to 2147483647"):
            maintenance.rotate_encryption(batch_size=value)
        refused.append(maintenance.rotate_encryption)
    assert len(refused) == 6
    assert remaining_keys() == {"expired", "stale", "plain"}
    stale.refresh_from_db()
    plain.refresh_from_db()
    assert (stale.status, stale.recovery_attempts) == (RecordStatus.IN_PROGRESS, 0)
    assert bytes(plain.response_body) == b"{}"


# -- the audit trail --------------------------------------------------------------------------


def test_purge_without_audit_copies_nothing():
    completed(expires_in=-timedelta(seconds=1))
    result = maintenance.purge_expired(now=NOW)
    assert (result.deleted, result.archived) == (1, 0)
    assert IdempotencyAuditRecord.objects.count() == 0


@AUDIT_ON
def test_purge_with_audit_copies_each_record_first():
    old = completed(
        expires_in=-timedelta(seconds=1),
        key="audited",
        response_headers=[["Content-Type", "application/json"], ["Location", "/charges/1/"]],
        response_body=b'{"id": 1}',
    )
    dead = in_progress(lease_in=-timedelta(seconds=2), expires_in=-timedelta(seconds=1))
    completed(expires_in=timedelta(seconds=1), key="young")

    result = maintenance.purge_expired(batch_size=1, now=NOW)

    assert (result.deleted, result.archived, result.batches) == (2, 2, 2)
    assert remaining_keys() == {"young"}
    audit = IdempotencyAuditRecord.objects.get(record_id=old.pk)
    assert (audit.account, audit.operation, audit.key) == (old.account, old.operation, "audited")
    assert audit.status == RecordStatus.COMPLETED
    assert audit.response_status == 201
    assert audit.response_headers == old.response_headers
    assert bytes(audit.response_body) == b'{"id": 1}'
    assert audit.expires_at == old.expires_at
    assert (audit.archived_at, audit.reason) == (NOW, "purged")
    stale = IdempotencyAuditRecord.objects.get(record_id=dead.pk)
    assert stale.status == RecordStatus.IN_PROGRESS
    assert stale.response_body is None


@AUDIT_ON
def test_archive_expired_copies_the_record_a_claim_replaces():
    completed(expires_in=-timedelta(seconds=1), key="reused")
    completed(expires_in=timedelta(seconds=1), key="alive")
    with transaction.atomic():
        copied = IdempotencyRecord.objects.archive_expired(
            "user:1", "charges.create", "reused", now=NOW
        )
        # The form the claim uses: on a queryset for the idempotency database.
        untouched = IdempotencyRecord.objects.using("default").archive_expired(
            "user:1", "charges.create", "alive", now=NOW
        )
    assert (copied, untouched) == (1, 0)
    audit = IdempotencyAuditRecord.objects.get()
    assert (audit.key, audit.reason) == ("reused", "replaced")


@AUDIT_ON
@pytest.mark.django_db(transaction=True)
def test_a_takeover_copies_only_the_record_it_replaces():
    """Between a claim's read and its takeover, the record it read was purged and another of
    the key, expired already, took its place: the takeover replaces nothing (the claim then
    looks again), and nothing is copied, as nothing was replaced."""
    from django_idempotency._context import Operation
    from django_idempotency._store import claiming

    read = completed(expires_in=-timedelta(seconds=1), key="swapped")
    op = Operation(
        "default", "user:1", "charges.create", "swapped", "a" * 64, "v1", "retry",
        timedelta(seconds=60), timedelta(hours=1),
    )  # fmt: skip
    state = claiming.fetch(op)
    assert state is not None
    read.delete()
    other = completed(expires_in=-timedelta(seconds=1), key="swapped")
    assert claiming._take_over(op, NOW, uuid.uuid4(), state) is None
    assert IdempotencyAuditRecord.objects.count() == 0
    assert IdempotencyRecord.objects.get().lease_token == other.lease_token


def test_archive_expired_does_nothing_with_the_audit_off():
    completed(expires_in=-timedelta(seconds=1), key="reused")
    with transaction.atomic():
        assert (
            IdempotencyRecord.objects.archive_expired("user:1", "charges.create", "reused", now=NOW)
            == 0
        )
    assert IdempotencyAuditRecord.objects.count() == 0


@override_settings(IDEMPOTENCY={"AUDIT": True, "AUDIT_RETENTION": timedelta(days=30)})
def test_audit_records_are_purged_after_their_retention():
    completed(expires_in=-timedelta(days=40), key="ancient")
    maintenance.purge_expired(now=NOW - timedelta(days=31))
    completed(expires_in=-timedelta(days=30), key="recent")
    maintenance.purge_expired(now=NOW - timedelta(days=29))
    assert IdempotencyAuditRecord.objects.count() == 2

    result = maintenance.purge_expired(now=NOW, batch_size=1)

    assert (result.deleted, result.audit_deleted, result.audit_batches) == (0, 1, 1)
    assert list(IdempotencyAuditRecord.objects.values_list("key", flat=True)) == ["recent"]


def test_audit_records_are_append_only():
    audit = IdempotencyAuditRecord.objects.create(
        record_id=1,
        account="a",
        operation="o",
        key="k",
        request_hash="0" * 64,
        fingerprint_version="v1",
        status=RecordStatus.COMPLETED,
        recovery_policy="retry",
        recovery_attempts=0,
        created_at=NOW,
        expires_at=NOW,
        reason="purged",
    )
    audit.key = "changed"
    with pytest.raises(TypeError, match="append-only"):
        audit.save()


# -- recovery ---------------------------------------------------------------------------------

CALLS: list[str] = []


def answer_ok(record: IdempotencyRecord) -> HttpResponse:
    """A recovery callable that found the outcome at the provider."""
    CALLS.append(record.key)
    return JsonResponse({"recovered": record.key}, status=201, headers={"Location": "/x/"})


def answer_none(record: IdempotencyRecord) -> None:
    """A recovery callable that found nothing: the operation may run again."""
    CALLS.append(record.key)


def answer_error(record: IdempotencyRecord) -> HttpResponse:
    """A recovery callable whose provider is down."""
    CALLS.append(record.key)
    raise ConnectionError("provider down")


def answer_5xx(record: IdempotencyRecord) -> HttpResponse:
    """A recovery callable that answers something that must not be replayed."""
    CALLS.append(record.key)
    return HttpResponse(status=502)


def answer_after_takeover(record: IdempotencyRecord) -> HttpResponse:
    """A retry takes the lease over while the callable asks the provider."""
    CALLS.append(record.key)
    IdempotencyRecord.objects.filter(pk=record.pk).update(lease_token=uuid.uuid4())
    return JsonResponse({}, status=201)


@pytest.fixture
def calls() -> list[str]:
    CALLS.clear()
    return CALLS


@pytest.fixture
def recovered() -> Any:
    events: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        events.append(kwargs)

    signals.lease_recovered.connect(receiver, dispatch_uid="test-recovered")
    yield events
    signals.lease_recovered.disconnect(dispatch_uid="test-recovered")


STALE = -timedelta(seconds=1)
LIVE = timedelta(seconds=30)


def test_retry_policy_releases_stale_leases(recovered):
    in_progress(lease_in=STALE, key="stale", policy="retry")
    in_progress(lease_in=LIVE, key="live", policy="retry")
    completed(expires_in=timedelta(hours=1), key="done")

    result = maintenance.recover_stale_leases(now=NOW)

    assert (result.found, result.released, result.skipped, result.errors) == (1, 1, 0, 0)
    assert remaining_keys() == {"live", "done"}
    assert [(e["key"], e["policy"], e["outcome"]) for e in recovered] == [
        ("stale", "retry", "released")
    ]


def test_fail_policy_stores_the_outcome_unknown_problem(recovered):
    record = in_progress(lease_in=STALE, key="stale", policy="fail")

    result = maintenance.recover_stale_leases(now=NOW)

    assert (result.found, result.failed) == (1, 1)
    record.refresh_from_db()
    assert record.status == RecordStatus.FAILED
    assert record.recovery_attempts == 1
    assert record.lease_token is None
    assert record.completed_at == NOW
    assert record.response_headers == [["Content-Type", "application/problem+json"]]
    body = json.loads(bytes(record.response_body))
    assert body["code"] == "idempotency_outcome_unknown"
    assert record.response_status == body["status"]
    assert [e["outcome"] for e in recovered] == ["failed"]


def test_callable_answer_completes_the_record(calls, recovered):
    path = f"{__name__}.answer_ok"
    record = in_progress(lease_in=STALE, key="stale", policy=path)

    result = maintenance.recover_stale_leases(now=NOW)

    assert (result.completed, calls) == (1, ["stale"])
    record.refresh_from_db()
    assert (record.status, record.response_status) == (RecordStatus.COMPLETED, 201)
    assert json.loads(bytes(record.response_body)) == {"recovered": "stale"}
    assert ["Location", "/x/"] in record.response_headers
    assert record.recovery_attempts == 1
    assert [(e["policy"], e["outcome"]) for e in recovered] == [(path, "completed")]


def test_callable_none_releases_the_record(calls, recovered):
    in_progress(lease_in=STALE, key="stale", policy=f"{__name__}.answer_none")
    result = maintenance.recover_stale_leases(now=NOW)
    assert (result.released, calls) == (1, ["stale"])
    assert remaining_keys() == set()
    assert [e["outcome"] for e in recovered] == ["released"]


@pytest.mark.parametrize("policy", ["answer_error", "answer_5xx", "no_such_function"])
def test_a_policy_that_cannot_answer_counts_an_attempt_and_keeps_the_record(
    policy, calls, recovered
):
    record = in_progress(lease_in=STALE, key="stale", policy=f"{__name__}.{policy}")

    first = maintenance.recover_stale_leases(now=NOW)
    second = maintenance.recover_stale_leases(now=NOW)

    assert (first.errors, second.errors) == (1, 1)
    record.refresh_from_db()
    assert record.status == RecordStatus.IN_PROGRESS
    assert record.recovery_attempts == 2
    assert recovered == []


def test_a_record_taken_over_meanwhile_is_left_alone(calls):
    record = in_progress(lease_in=STALE, key="stale", policy=f"{__name__}.answer_after_takeover")
    result = maintenance.recover_stale_leases(now=NOW)
    assert (result.found, result.skipped, result.completed) == (1, 1, 0)
    record.refresh_from_db()
    assert record.status == RecordStatus.IN_PROGRESS
    assert record.recovery_attempts == 0


def test_recovery_leaves_stale_records_past_their_ttl_to_the_purge():
    in_progress(lease_in=-timedelta(seconds=2), expires_in=-timedelta(seconds=1), policy="fail")
    result = maintenance.recover_stale_leases(now=NOW)
    assert result.found == 0


def test_recovery_dry_run_and_limit(calls, recovered):
    for n in range(3):
        in_progress(lease_in=STALE, key=f"retry-{n}", policy="retry")
    in_progress(lease_in=STALE, key="fail", policy="fail")

    dry = maintenance.recover_stale_leases(now=NOW, dry_run=True)
    assert (dry.found, dry.released, dry.dry_run) == (4, 0, True)
    assert dry.policies == {"retry": 3, "fail": 1}
    assert IdempotencyRecord.objects.count() == 4
    assert recovered == []

    limited = maintenance.recover_stale_leases(now=NOW, limit=2)
    assert limited.found == 2
    rest = maintenance.recover_stale_leases(now=NOW)
    assert rest.found == 2
    assert IdempotencyRecord.objects.get().status == RecordStatus.FAILED


def test_a_limit_is_spent_on_records_the_recovery_can_recover(recovered):
    """Resumable records are left to their next attempt, so every run meets them again:
    met first (the oldest), they took the whole ``limit`` of every run, and a stale lease
    behind them was never recovered. Now they are counted apart, and the limit is spent on
    the records the job recovers. Counted: the records closed, the signals sent."""
    for n in range(3):
        in_progress(lease_in=STALE, key=f"resume-{n}", policy="resume")
    in_progress(lease_in=STALE, key="fail", policy="fail")
    first = maintenance.recover_stale_leases(now=NOW, limit=2)
    assert (first.found, first.resumable, first.failed) == (4, 3, 1)
    assert first.policies == {"resume": 3, "fail": 1}
    again = maintenance.recover_stale_leases(now=NOW, limit=2)
    assert (again.found, again.resumable, again.failed) == (3, 3, 0)
    assert IdempotencyRecord.objects.get(key="fail").status == RecordStatus.FAILED
    assert [(e["key"], e["outcome"]) for e in recovered] == [("fail", "failed")]
    assert set(
        IdempotencyRecord.objects.filter(key__startswith="resume-").values_list("status", flat=True)
    ) == {RecordStatus.IN_PROGRESS}
    dry = maintenance.recover_stale_leases(now=NOW, limit=1, dry_run=True)
    assert (dry.found, dry.resumable, dry.policies) == (3, 3, {"resume": 3})


@override_settings(IDEMPOTENCY={"PURGE_BATCH_SIZE": 2})
def test_recovery_pages_through_many_records():
    for n in range(5):
        in_progress(lease_in=STALE, key=f"stale-{n}", policy=f"{__name__}.answer_error")
    result = maintenance.recover_stale_leases(now=NOW)
    assert (result.found, result.errors) == (5, 5)


def test_admin_helpers_touch_only_stale_in_progress_records(recovered):
    in_progress(lease_in=-timedelta(seconds=1), now=datetime.now(timezone.utc), key="a")
    in_progress(lease_in=-timedelta(seconds=1), now=datetime.now(timezone.utc), key="b")
    in_progress(lease_in=timedelta(minutes=5), now=datetime.now(timezone.utc), key="live")
    completed(expires_in=timedelta(hours=1), now=datetime.now(timezone.utc), key="done")

    assert maintenance.release_stale(IdempotencyRecord.objects.filter(key__in=["a", "live"])) == 1
    assert maintenance.mark_failed(IdempotencyRecord.objects.all()) == 1

    statuses = dict(IdempotencyRecord.objects.values_list("key", "status"))
    assert statuses == {
        "b": RecordStatus.FAILED,
        "live": RecordStatus.IN_PROGRESS,
        "done": RecordStatus.COMPLETED,
    }
    assert [(e["key"], e["policy"], e["outcome"]) for e in recovered] == [
        ("a", "retry", "released"),
        ("b", "fail", "failed"),
    ]


# -- the commands -----------------------------------------------------------------------------


def run(command: str, *args: str) -> str:
    out = StringIO()
    call_command(command, *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_purge_command():
    bulk_records(25, expires_at=datetime.now(timezone.utc) - timedelta(days=1), prefix="expired")
    completed(expires_in=timedelta(days=365), key="young")

    dry = run("purge_idempotency", "--dry-run", "--batch-size", "10")
    assert dry.strip() == (
        "Would purge 25 expired idempotency records in 3 batches and 0 audit records in 0 batches."
    )
    assert IdempotencyRecord.objects.count() == 26

    out = run("purge_idempotency", "--batch-size", "10", "--max-batches", "2", "-v", "2")
    lines = out.splitlines()
    # The total first (what --max-batches lets this run delete), then a running count of it.
    assert lines[:3] == [
        "20 rows to delete",
        "batch 1: 10 of 20 rows deleted",
        "batch 2: 20 of 20 rows deleted",
    ]
    assert lines[3].startswith("Purged 20 expired idempotency records in 2 batches")
    assert lines[3].endswith("More remain: --max-batches stopped the run.")
    assert IdempotencyRecord.objects.count() == 6  # the count deleted nothing

    assert run("purge_idempotency", "--database", "default", "-v", "0") == ""
    assert remaining_keys() == {"young"}


def test_purge_command_fails_loudly():
    broken = mock.patch.object(maintenance, "purge_expired", side_effect=DatabaseError("gone"))
    with broken, pytest.raises(CommandError, match="purge failed: gone"):
        run("purge_idempotency")
    with pytest.raises(CommandError, match="no-such-db"):
        run("purge_idempotency", "--database", "no-such-db")
    with pytest.raises(CommandError):
        run("purge_idempotency", "--batch-size", "0")


def test_recovery_leaves_resumable_records_to_their_next_attempt(recovered):
    record = in_progress(lease_in=STALE, key="resumable", policy="resume")
    IdempotencyStep.objects.create(record=record, name="ride", result="1")
    in_progress(lease_in=STALE, key="retry", policy="retry")

    dry = maintenance.recover_stale_leases(now=NOW, dry_run=True)
    assert (dry.found, dry.resumable, dry.policies) == (2, 1, {"resume": 1, "retry": 1})
    result = maintenance.recover_stale_leases(now=NOW)

    assert (result.found, result.released, result.resumable, result.errors) == (2, 1, 1, 0)
    record.refresh_from_db()
    assert (record.status, record.recovery_attempts) == (RecordStatus.IN_PROGRESS, 0)
    assert IdempotencyStep.objects.filter(record=record).count() == 1
    assert [(e["key"], e["outcome"]) for e in recovered] == [("retry", "released")]
    # Every run finds it again, until its next attempt resumes it.
    assert maintenance.recover_stale_leases(now=NOW).resumable == 1


def test_the_admin_helpers_release_no_resumable_record_and_mark_it_failed(recovered):
    now = datetime.now(timezone.utc)
    record = in_progress(lease_in=-timedelta(seconds=1), now=now, key="r", policy="resume")
    IdempotencyStep.objects.create(record=record, name="ride", result="1")
    selected = IdempotencyRecord.objects.all()

    assert maintenance.resumable_stale(selected) == 1
    assert maintenance.release_stale(selected) == 0
    assert IdempotencyStep.objects.filter(record=record).count() == 1
    assert maintenance.mark_failed(selected) == 1
    record.refresh_from_db()
    assert record.status == RecordStatus.FAILED
    assert IdempotencyStep.objects.filter(record=record).count() == 1
    assert maintenance.resumable_stale(selected) == 0
    assert [(e["policy"], e["outcome"]) for e in recovered] == [("fail", "failed")]


def test_recover_command(calls):
    now = datetime.now(timezone.utc)
    in_progress(lease_in=-timedelta(seconds=1), now=now, key="retry", policy="retry")
    in_progress(lease_in=-timedelta(seconds=1), now=now, key="fail", policy="fail")

    in_progress(lease_in=-timedelta(seconds=1), now=now, key="resume", policy="resume")

    dry = run("recover_idempotency", "--dry-run", "-v", "2")
    assert dry.splitlines() == [
        "policy fail: 1 stale leases",
        "policy resume: 1 stale leases",
        "policy retry: 1 stale leases",
        "Would recover 2 stale leases (1 resumable left to their next attempt).",
    ]
    out = run("recover_idempotency", "--limit", "5")
    assert out.strip() == (
        "Recovered 2 stale leases: 1 released, 1 failed, 0 completed, 0 changed meanwhile, "
        "0 errors; 1 resumable left to their next attempt."
    )
    assert remaining_keys() == {"fail", "resume"}


def test_recover_command_exits_non_zero_on_errors(calls):
    now = datetime.now(timezone.utc)
    in_progress(lease_in=-timedelta(seconds=1), now=now, policy=f"{__name__}.answer_error")
    with pytest.raises(CommandError, match="1 stale leases could not be recovered"):
        run("recover_idempotency")


# -- system checks ----------------------------------------------------------------------------


def check_ids() -> list[str]:
    return [str(message.id) for message in checks.check_settings()]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, []),
        ({"AUDIT": True, "AUDIT_RETENTION": 3600, "PURGE_MAX_BATCHES": 10}, []),
        ({"AUDIT": "yes"}, ["django_idempotency.E020"]),
        ({"AUDIT_RETENTION": timedelta(0)}, ["django_idempotency.E021"]),
        ({"AUDIT_RETENTION": "90d"}, ["django_idempotency.E021"]),
        ({"PURGE_MAX_BATCHES": 0}, ["django_idempotency.E022"]),
        ({"PURGE_MAX_BATCHES": True}, ["django_idempotency.E022"]),
    ],
)
def test_maintenance_checks(settings, expected):
    with override_settings(IDEMPOTENCY=settings):
        assert check_ids() == expected


@pytest.mark.django_db(databases="__all__")  # the model checks may ask every database
def test_check_command_reports_maintenance_errors():
    invalid = override_settings(IDEMPOTENCY={"AUDIT": 1})
    with invalid, pytest.raises(SystemCheckError, match="E020"):
        call_command("check", stdout=StringIO(), stderr=StringIO())
