"""The maintenance jobs beside a caller's transaction: each batch, each record, is a short
transaction of its own, or the job is refused. Inside a caller's transaction a purge would
hold every row it deleted until that transaction ends (a claim reusing one of those keys
waits for all of it), and a recovery would call its policies inside it."""

from __future__ import annotations

import contextlib
import importlib.util
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.utils import timezone

from django_idempotency import crypto, maintenance, signals
from django_idempotency.models import IdempotencyRecord
from tests.factories import RecordFactory, UserFactory
from tests.helpers import in_thread, logged_in, postgres_only

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/admin/django_idempotency/idempotencyrecord/"
KEYS = {"ENCRYPTION_KEYS": ["jZ8nXq7eYbVt2XkB3y0n7O9dVb8Qm3cT5q6i0pW1rX4="]}


def elsewhere(call: Callable[[], Any]) -> Any:
    """``call()`` on a connection of its own: what every other client sees now."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(in_thread(call)).result(30)


def expired_records(count: int) -> None:
    for _ in range(count):
        RecordFactory(expires_at=timezone.now() - timedelta(hours=1))


def stale_record() -> IdempotencyRecord:
    return RecordFactory(
        status="in_progress",
        response_status=None,
        response_headers=[],
        response_body=None,
        lease_token=uuid.uuid4(),
        lease_expires_at=timezone.now() - timedelta(minutes=5),
    )


@postgres_only
@pytest.mark.usefixtures("atomic_requests")
def test_the_admins_purge_commits_each_batch_under_atomic_requests():
    """Under ATOMIC_REQUESTS the admin's request was one transaction: the purge's batches
    were savepoints, every row it deleted stayed locked (and visible to every other client)
    until the page was answered."""
    expired_records(5)
    kept = RecordFactory()
    seen: list[int] = []

    def count_from_elsewhere(sender: Any, **kwargs: Any) -> None:
        seen.append(elsewhere(lambda: IdempotencyRecord.objects.count()))

    client = logged_in(UserFactory(is_staff=True, is_superuser=True))
    signals.records_purged.connect(count_from_elsewhere)
    try:
        with override_settings(IDEMPOTENCY={"PURGE_BATCH_SIZE": 2}):
            response = client.post(
                URL,
                {"action": "purge_expired_records", "_selected_action": [kept.pk]},
                follow=True,
            )
    finally:
        signals.records_purged.disconnect(count_from_elsewhere)
    assert response.status_code == 200
    assert seen == [1]  # every batch had committed before the run ended
    assert IdempotencyRecord.objects.count() == 1


@postgres_only
@pytest.mark.usefixtures("atomic_requests")
def test_the_admins_mark_as_failed_commits_before_it_announces_under_atomic_requests():
    record = stale_record()
    seen: list[str] = []

    def status_from_elsewhere(sender: Any, **kwargs: Any) -> None:
        seen.append(elsewhere(lambda: IdempotencyRecord.objects.get(pk=record.pk).status))

    client = logged_in(UserFactory(is_staff=True, is_superuser=True))
    signals.lease_recovered.connect(status_from_elsewhere)
    try:
        response = client.post(
            URL, {"action": "mark_as_failed", "_selected_action": [record.pk]}, follow=True
        )
    finally:
        signals.lease_recovered.disconnect(status_from_elsewhere)
    assert response.status_code == 200
    assert seen == ["failed"]


@pytest.mark.parametrize(
    "job",
    [
        maintenance.purge_expired,
        maintenance.recover_stale_leases,
        pytest.param(
            maintenance.rotate_encryption,
            marks=pytest.mark.skipif(
                importlib.util.find_spec("cryptography") is None,
                reason="the key rotation needs cryptography, which the tox env core lacks",
            ),
        ),
    ],
)
def test_a_job_inside_the_callers_transaction_is_refused_before_anything_changes(job):
    expired_records(3)
    stale = stale_record()
    # Keys for the rotation only: without cryptography, configured keys refuse every job.
    keys = override_settings(IDEMPOTENCY=KEYS) if job is maintenance.rotate_encryption else None
    with keys or contextlib.nullcontext(), transaction.atomic():
        with pytest.raises(TransactionManagementError, match="outside any transaction"):
            job()
        assert connection.in_atomic_block
    assert IdempotencyRecord.objects.count() == 4
    stale.refresh_from_db()
    assert stale.status == "in_progress"
    assert stale.recovery_attempts == 0
    # Nothing sealed by the rotation either.
    stored = IdempotencyRecord.objects.values_list("response_headers", flat=True)
    assert all(crypto.sealed_with(headers) is None for headers in stored)
