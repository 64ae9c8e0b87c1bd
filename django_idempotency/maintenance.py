"""Purge, recovery and key rotation: the one implementation behind the commands, the Celery
tasks and the admin.

Everything here is bounded: the purge deletes and the rotation reseals in batches, each in a
short transaction of its own, and recovery handles one record per short transaction. Nothing
holds a lock while it waits on anything else, so all three run beside live traffic and
beside each other.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from django.db import connections
from django.db.models import Count, QuerySet
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency import (
    _autonomous,
    _once,
    _outcomes,
    _policies,
    _recovery,
    _store,
    _validation,
    crypto,
)
from django_idempotency._claims import Claim
from django_idempotency._purge import Progress, PurgeResult
from django_idempotency.conf import app_settings
from django_idempotency.models import IdempotencyRecord
from django_idempotency.states import stale_lease_q, stale_q

logger = logging.getLogger("django_idempotency")

__all__ = [
    "PurgeResult",
    "RecoveryResult",
    "mark_failed",
    "purge_expired",
    "recover_stale_leases",
    "release_stale",
    "resumable_stale",
    "rotate_encryption",
]


@dataclass
class RecoveryResult:
    """What one recovery run did to stale leases (or, with ``dry_run``, found)."""

    found: int = 0
    released: int = 0
    failed: int = 0
    completed: int = 0
    # The record changed meanwhile (completed, released or taken over by a retry).
    skipped: int = 0
    # The policy raised, could not be imported, or answered a response that cannot be kept;
    # the attempt is counted on the record and the next run tries again.
    errors: int = 0
    # Under the recovery policy "resume": left in progress for the operation's next attempt,
    # which runs its body again and skips the recorded steps (a job has no body to run).
    resumable: int = 0
    dry_run: bool = False
    policies: dict[str, int] = field(default_factory=dict)


def _alias(using: str | None, job: str) -> str:
    """The database alias ``using`` names, ``DATABASE`` when it is ``None``, for ``job``.

    Any other alias must be in ``DATABASES`` (``ConnectionDoesNotExist`` otherwise), the
    empty one too: a queryset's ``using("")`` would quietly fall back on the routers'
    database, and a purge meant for no database would purge the default one.

    ``TransactionManagementError`` inside a transaction of the caller's on that database
    (``transaction.atomic()``, ``ATOMIC_REQUESTS``, autocommit turned off), as the outbox
    relay: there each batch would be a savepoint, every row the job touched would stay
    locked until that transaction ends (a claim reusing a purged key waits for all of it),
    the whole run would roll back with it after its signals were sent, and a recovery
    callable would be called inside it.
    """
    alias = app_settings.DATABASE if using is None else using
    if _autonomous.in_callers_transaction(connections[alias]):
        raise TransactionManagementError(
            f"the {job} must run outside any transaction on {alias!r} (transaction.atomic(), "
            "ATOMIC_REQUESTS, autocommit turned off): each of its batches commits on its "
            "own, and inside a transaction every row it touched would stay locked until that "
            "transaction ends. Run it outside any transaction on that database."
        )
    return alias


# -- purge ------------------------------------------------------------------------------------


def purge_expired(
    *,
    using: str | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
    progress: Progress | None = None,
) -> PurgeResult:
    """Delete expired records, audit records and sent outbox messages past their retention.

    The command, the Celery task and the admin action all call this; it is
    ``IdempotencyRecord.objects.using(using).delete_expired(...)``, whose batches are
    described in ``django_idempotency._purge.purge``.
    """
    return IdempotencyRecord.objects.using(_alias(using, "purge")).delete_expired(
        batch_size=batch_size,
        max_batches=max_batches,
        dry_run=dry_run,
        now=now,
        progress=progress,
    )


# -- key rotation -----------------------------------------------------------------------------


def rotate_encryption(
    *,
    using: str | None = None,
    batch_size: int | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> crypto.RotationResult:
    """Seal every stored response (records and audit records) with the first key of
    ``ENCRYPTION_KEYS``, in bounded batches beside live traffic.

    The ``rotate_idempotency_encryption`` command calls this; its batches are described in
    ``django_idempotency.crypto.rotate``.
    """
    return crypto.rotate(
        using=_alias(using, "key rotation"),
        batch_size=batch_size,
        dry_run=dry_run,
        progress=progress,
    )


# -- recovery ---------------------------------------------------------------------------------

RELEASED = "released"
FAILED = "failed"
COMPLETED = "completed"


@dataclass(frozen=True)
class _Stale:
    id: int
    token: uuid.UUID | None
    account: str
    operation: str
    key: str
    policy: str
    fingerprint_version: str


_STALE_FIELDS = (
    "pk",
    "lease_token",
    "account",
    "operation",
    "key",
    "recovery_policy",
    "fingerprint_version",
)


class _Unstorable(Exception):
    """A recovery callable answered with a response that cannot be kept and replayed."""


def recover_stale_leases(
    *,
    using: str | None = None,
    limit: int | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
) -> RecoveryResult:
    """Apply each stale lease's stored recovery policy, without waiting for a retry.

    ``"retry"``: the record is released (deleted), so the next retry runs afresh.
    ``"fail"``: the record becomes ``failed`` with the "outcome unknown" problem, replayed to
    every retry. A callable gets the record: a response completes it, ``None`` releases it.
    ``"resume"``: the record is left as it is and counted in ``resumable``. Only the
    operation's next attempt can resume it (it runs the body and skips the recorded steps);
    releasing it would delete its recorded steps, and they would run again. ``limit`` bounds
    the records handled: the resumable ones are counted apart and take none of it.
    Every step is fenced by the stale owner's lease token, so a record that completed or was
    taken over meanwhile is left alone. Attempts are counted on the record
    (``recovery_attempts``) and ``lease_recovered`` is sent for each record handled.
    """
    limit = _validation.counted_argument("limit", limit)
    alias = _alias(using, "recovery")
    now = now or timezone.now()
    result = RecoveryResult(dry_run=dry_run)
    policies: Counter[str] = Counter()
    stale = IdempotencyRecord.objects.using(alias).filter(stale_q(now))
    # Resumable records are left as they are, so every run meets them again: counted apart,
    # never paged through, the limit is spent on the records this job recovers (met first,
    # the same resumable records would take it on every run).
    resumable = _policies.names_where("resumable")
    left = stale.filter(recovery_policy__in=resumable).values_list("recovery_policy")
    for policy, count in left.annotate(count=Count("pk")).order_by():
        result.found += count
        result.resumable += count
        policies[policy] += count
    for row in _stale_rows(stale.exclude(recovery_policy__in=resumable), limit):
        result.found += 1
        policies[row.policy] += 1
        if dry_run:
            continue
        try:
            outcome = _apply(alias, row, _recovery.resolve_recovery(row.policy), now)
        except Exception:
            # The record is named by its id: the client's key does not belong in logs.
            logger.exception(
                "recovery policy %s failed for record %s (%s)", row.policy, row.id, row.operation
            )
            _count_attempt(alias, row)
            result.errors += 1
            continue
        if outcome is None:
            result.skipped += 1
            continue
        setattr(result, outcome, getattr(result, outcome) + 1)
        _recovery.announce(row, row.id, row.policy, outcome)
    result.policies = dict(policies)
    return result


def release_stale(queryset: QuerySet[IdempotencyRecord]) -> int:
    """Release the in-progress records of ``queryset`` whose lease ran out (the admin action).

    Fenced like the recovery job: a record that completed or was taken over is untouched.
    A resumable record (recovery policy ``"resume"``) is never released: that would delete
    its recorded steps, and its next attempt would run them again. Returns how many were
    released.
    """
    resumable = _policies.names_where("resumable")
    return _force(queryset.exclude(recovery_policy__in=resumable), _policies.RETRY.name)


def resumable_stale(queryset: QuerySet[IdempotencyRecord]) -> int:
    """How many records of ``queryset`` are resumable (``"resume"``) with a stale lease:
    what `release_stale` leaves alone."""
    return int(
        queryset.filter(
            stale_lease_q(timezone.now()), recovery_policy__in=_policies.names_where("resumable")
        ).count()
    )


def mark_failed(queryset: QuerySet[IdempotencyRecord]) -> int:
    """Close the in-progress records of ``queryset`` whose lease ran out as ``failed``.

    Every retry then gets the "outcome unknown" problem and the side effect never runs
    again. Fenced by the lease token. A resumable record is closed too (someone decided that
    its operation must not go on); its recorded steps stay with it until the purge, for
    reconciliation. Returns how many were marked.
    """
    return _force(queryset, _policies.FAIL.name)


def _force(queryset: QuerySet[IdempotencyRecord], policy: str) -> int:
    now = timezone.now()
    stale = queryset.filter(stale_lease_q(now))
    done = 0
    for row in _stale_rows(stale, None):
        outcome = _apply(queryset.db, row, policy, now)
        if outcome is not None:
            done += 1
            _recovery.announce(row, row.id, policy, outcome)
    return done


def _stale_rows(stale: QuerySet[IdempotencyRecord], limit: int | None) -> Iterator[_Stale]:
    # Pages keyed by id: a record left in place (an error) is never met twice in one run,
    # and no page is larger than a purge batch.
    page = app_settings.PURGE_BATCH_SIZE
    last, taken = 0, 0
    while limit is None or taken < limit:
        size = page if limit is None else min(page, limit - taken)
        rows = list(stale.filter(pk__gt=last).order_by("pk").values_list(*_STALE_FIELDS)[:size])
        for row in rows:
            yield _Stale(*row)
        if len(rows) < size:
            return
        taken += len(rows)
        last = rows[-1][0]


def _apply(alias: str, row: _Stale, policy: _recovery.Policy, now: datetime) -> str | None:
    """Apply one policy; the outcome, or ``None`` when the record changed meanwhile.

    The rule is the request path's (:func:`._recovery.recover`); only what follows differs:
    where a retry would run the view, the record is released for the next retry to run
    afresh. The callable is called outside any transaction: it may ask a provider what
    happened, and no lock may be held while it waits.
    """
    if row.token is None:
        return None
    stale = Claim(alias, row.id, row.token)
    recovered = _recovery.recover(
        stale,
        policy,
        account=row.account,
        key=row.key,
        operation=row.operation,
        # A record of run_once stores a result, a request's record a response.
        as_outcome=_once.outcome_of
        if row.fingerprint_version == _once.FINGERPRINT_VERSION
        else _outcomes.outcome_of,
        now=now,
        counted=True,
    )
    match recovered:
        case _recovery.Lost():
            return None
        case _recovery.Run():
            return RELEASED if _store.release(alias, row.id, row.token) else None
        case _recovery.Undecided(answer=answer):
            status = getattr(answer, "status_code", None)
            raise _Unstorable(f"recovery answered {status}, which cannot be replayed")
        case _recovery.Closed():
            return recovered.name


def _count_attempt(alias: str, row: _Stale) -> None:
    if row.token is not None:
        _store.count_attempt(alias, row.id, row.token)
