"""A key's record, read afresh, and its lease or TTL moved into the past: no sleeping."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_idempotency.models import IdempotencyRecord


def record_for(
    key: str | IdempotencyRecord,
    *,
    account: str | None = None,
    operation: str | None = None,
) -> IdempotencyRecord:
    """The record of ``key``, read afresh from the ``DATABASE`` setting's database.

    ``account`` and ``operation`` narrow it down when several records share the key
    (``"user:42"``, ``"order.create"``), as the resolver and the view gave them (or as
    stored, ``sha256:...`` for a name stored by its hash); among those left, the newest.
    A record passed instead of a key is read again. Fails the test when there is none.
    """
    from django_idempotency.conf import app_settings
    from django_idempotency.models import IdempotencyRecord

    records = IdempotencyRecord.objects.using(app_settings.DATABASE)
    if isinstance(key, IdempotencyRecord):
        found = records.filter(pk=key.pk).first()
        assert found is not None, f"record {key.pk} is gone (released or purged)"
        return found
    selection = records.filter(key=key)
    # A name the table cannot keep apart as it is is stored by its hash: either spelling
    # (the one given only where a driver can send it: no NUL, no lone surrogate).
    if account is not None:
        selection = selection.filter(account__in=_spellings(account))
    if operation is not None:
        selection = selection.filter(operation__in=_spellings(operation))
    newest = selection.order_by("-created_at", "-pk").first()
    assert newest is not None, (
        f"no idempotency record for key {key!r}"
        + (f", account {account!r}" if account is not None else "")
        + (f", operation {operation!r}" if operation is not None else "")
        + ": the request was not protected, or its claim was released"
    )
    return newest


def _spellings(name: str) -> set[str]:
    """How ``name`` may be stored: as the operation stores it, and as it is where a database
    can hold it (a stored form read from a record)."""
    from django_idempotency._storable import storable_name, text_problem

    return {storable_name(name)} | ({name} if text_problem(name) is None else set())


def _moved(record: IdempotencyRecord, **columns: Any) -> IdempotencyRecord:
    from django_idempotency.conf import app_settings
    from django_idempotency.models import IdempotencyRecord

    IdempotencyRecord.objects.using(app_settings.DATABASE).filter(pk=record.pk).update(**columns)
    return record_for(record)


def expire_lease(
    key: str | IdempotencyRecord,
    *,
    account: str | None = None,
    operation: str | None = None,
) -> IdempotencyRecord:
    """End the lease of an in-progress record now, as if its owner had run out of time:
    the next retry (or the recovery job) meets a stale lease and applies the recovery
    policy. No sleeping. Fails the test when the record is not in progress.

    The record is found as `record_for` finds it; returns it as it is now.
    """
    from django.utils import timezone

    from django_idempotency.states import IN_PROGRESS

    record = record_for(key, account=account, operation=operation)
    assert record.status == IN_PROGRESS, (
        f"the record of key {record.key!r} is {record.status}: only an in-progress record "
        "holds a lease"
    )
    return _moved(record, lease_expires_at=timezone.now() - timedelta(seconds=1))


def expire_ttl(
    key: str | IdempotencyRecord,
    *,
    account: str | None = None,
    operation: str | None = None,
) -> IdempotencyRecord:
    """Move a record's expiry (its TTL) into the past: the next request with its key is a
    new request, and the purge may delete it. No sleeping.

    An in-progress record whose lease is still live stays owned until the lease runs out
    too (`expire_lease`). The record is found as `record_for` finds it; returns it as it is
    now.
    """
    from django.utils import timezone

    record = record_for(key, account=account, operation=operation)
    return _moved(record, expires_at=timezone.now() - timedelta(seconds=1))
