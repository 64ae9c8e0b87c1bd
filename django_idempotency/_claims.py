"""A claim and its owner's verbs: one for each transition of :mod:`.states`.

::

    claim(op)        absent ─────────> in_progress   (or the record in the way, unchanged)
    Claim.complete   in_progress ────> completed     on the caller's connection, with the work
    Claim.close      in_progress ────> failed        a recovery policy's outcome (or completed),
                                                     committed at once
    Claim.release    in_progress ────> absent        a retry runs afresh at once
    Claim.give_back  in_progress ────> in_progress   the lease ends now: the next ask recovers

Every verb is fenced by the lease token (:mod:`._store`): a claim that another attempt took
over is never touched. ``release`` and ``give_back`` never raise: when the database cannot be
reached they leave the record to its lease, whose recovery policy then decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django import db
from django.db import connections, transaction
from django.utils import timezone

from django_idempotency import _autonomous, _store
from django_idempotency._context import Operation
from django_idempotency._outcomes import Outcome
from django_idempotency.conf import app_settings
from django_idempotency.exceptions import SimulatedCrash, StoreUnavailable, seconds_left
from django_idempotency.states import IN_PROGRESS

__all__ = [
    "CRASHES",
    "KEEP_CLAIM",
    "Claim",
    "LeaseLost",
    "claim",
    "fetch",
    "retry_after",
    "store_failed",
    "wait_for",
]

logger = logging.getLogger("django_idempotency")


class LeaseLost(Exception):
    """A fenced statement matched no row: another attempt took the lease over, and this
    attempt's database work was rolled back."""


#: What ends an attempt as a killed process would: a test's ``SimulatedCrash``, the
#: cancellation of an ``async`` caller (a client that disconnected, a server shutting down),
#: and the process told to stop inside the body: ``SystemExit`` (a Celery pool process sent
#: SIGTERM, by a cold shutdown, ``revoke(terminate=True)`` or a service manager stopping the
#: worker's whole process group; a server's worker told to quit) and ``KeyboardInterrupt``.
#: None is an error of the body's. The claim is kept, its lease runs out, and the recovery
#: policy decides: ``"fail"`` never runs the body again. (The owner's execution keeps the
#: claim for any other ``BaseException`` that is not an ``Exception`` too, such as a
#: greenlet killed in a gevent pool.)
CRASHES: tuple[type[BaseException], ...] = (
    SimulatedCrash,
    asyncio.CancelledError,
    SystemExit,
    KeyboardInterrupt,
)
#: What an owner's execution lets through without releasing the claim: a crash, and a lost
#: lease (the record is another attempt's now).
KEEP_CLAIM: tuple[type[BaseException], ...] = (LeaseLost, *CRASHES)


def claim(op: Operation) -> tuple[_store.ClaimResult, Claim | None]:
    """Claim ``op``'s record (see :func:`._store.claim`), now, committed at once whatever
    transaction the caller is in (see :mod:`._autonomous`): what the claim found, and the
    owner's ``Claim`` when this attempt claimed the record (``None`` otherwise)."""
    result = _claim(op, timezone.now())
    if not result.claimed:
        return result, None
    state = result.state
    assert state.lease_token is not None
    return result, Claim(op.alias, state.id, state.lease_token)


def _claim(op: Operation, now: datetime) -> _store.ClaimResult:
    connection = connections[op.alias]
    # Connected in autocommit outside any atomic block (the request path's usual state) is
    # no caller's transaction: known from the attributes, without asking _autonomous. (The
    # flag outlives a closed connection: an entry with AUTOCOMMIT off reconnects without.)
    if (
        connection.autocommit
        and not connection.in_atomic_block
        and connection.settings_dict.get("AUTOCOMMIT", True)
    ) or not _autonomous.in_callers_transaction(connection):
        # The usual case: autocommit (or a test case's transaction), where the claim
        # commits at once on the caller's own connection.
        return _store.claim(op, now)
    _autonomous.refuse_unkeepable(op.alias, op.recovery_policy, op.operation)
    if _autonomous.separate(op.alias):
        # The caller's transaction may hold this key's outcome already, not yet committed
        # (an earlier call with the key in the same transaction): its own view of the
        # record answers, where the second connection would see the claim in progress,
        # or wait for the caller's lock on the row to take a stale lease over.
        own = _store.fetch(op)
        if own is not None and own.status != IN_PROGRESS and not own.replaceable_by(op, now):
            return _store.ClaimResult(state=own, claimed=False)
    with _autonomous.claiming(op.alias) as deadline:
        return _store.claim(op, now, deadline)


def fetch(op: Operation) -> _store.RecordState | None:
    """``op``'s record as it is now (committed state, whatever the caller's transaction)."""
    with _autonomous.claiming(op.alias):
        return _store.fetch(op)


def wait_for(
    op: Operation, state: _store.RecordState, wait: timedelta, release: bool = False
) -> _store.RecordState | None:
    """Poll ``op``'s record, in progress as ``state``, until its owner is done; never longer
    than ``wait``, with short reads that hold no lock. ``release``: between its reads it
    holds no connection outside a transaction either (the thread's connection is closed, or
    given back to its pool, before each pause, and opened again by the next read); else the
    thread keeps the connection its reads use.

    The record once done (completed or failed); ``None`` when it went away, was replaced or
    its lease went stale (claim it again); the record still in progress when ``wait`` ran
    out. A failed read raises the database's error.
    """
    deadline = time.monotonic() + wait.total_seconds()
    pause = 0.02
    latest = state
    while (remaining := deadline - time.monotonic()) > 0:
        if release and not connections[op.alias].in_atomic_block:
            connections[op.alias].close()
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, 0.25)
        found = fetch(op)
        if found is None or found.id != state.id:  # gone, or replaced
            return None
        if found.status != IN_PROGRESS:
            return found
        if found.lease_expires_at and found.lease_expires_at <= timezone.now():
            return None
        latest = found
    return latest


def retry_after(lease_expires_at: datetime | None) -> int:
    """What a duplicate refused while the owner runs is told to wait: the whole seconds left
    of the owner's lease, rounded up, at least 1 (and at most ``RETRY_AFTER_MAX`` where
    it is set)."""
    left = seconds_left(lease_expires_at)
    bound = app_settings.RETRY_AFTER_MAX
    return left if bound is None else min(left, bound)


def store_failed(exc: Exception, ran: bool = True) -> StoreUnavailable:
    """The refusal of an attempt whose outcome (or step) could not be recorded, after its
    body ran; ``ran=False``: a read that comes before the body failed."""
    if not ran:
        return StoreUnavailable(f"nothing ran: the operation's record could not be read ({exc})")
    return StoreUnavailable(
        "the body ran, but its outcome could not be recorded: its database work was rolled "
        f"back and its claim released (or its lease given back) for a retry ({exc})",
        ran=True,
    )


@dataclass(frozen=True, slots=True)
class Claim:
    """A claim this attempt owns: its record, and the lease token that fences every verb."""

    alias: str
    record_id: int
    token: Any

    def complete(self, outcome: Outcome, now: datetime | None = None, commit: bool = False) -> None:
        """Store ``outcome`` on the caller's connection, so that it commits with the work
        (``commit``: and send the transaction's ``COMMIT`` with it, see
        :func:`._store.claiming.complete`).

        :class:`LeaseLost` when another attempt owns the record; ``StoreUnavailable`` when
        the statement fails.
        """
        try:
            stored = self._store(outcome, now, commit)
        except db.Error as exc:
            raise store_failed(exc) from exc
        if not stored:
            raise LeaseLost

    def close(self, outcome: Outcome, now: datetime | None = None, counted: bool = False) -> bool:
        """Store a recovery policy's ``outcome`` at once, outside any transaction of the
        caller's: it decides the record for every retry, whatever the caller does next.
        ``counted``: count the attempt on the record in the same transaction (the recovery
        job). ``False`` when the record is no longer this claim's."""
        with _autonomous.claiming(self.alias), transaction.atomic(using=self.alias):
            if counted and not _store.count_attempt(self.alias, self.record_id, self.token):
                return False
            return self._store(outcome, now)

    def record_policy(self, policy: str) -> bool:
        """Store ``policy`` (a recovery policy's stored name) on the stale record this claim
        took over, before the body runs under it, committed at once: should this attempt
        crash too, its own policy decides. ``False`` when the record is no longer this
        claim's; ``StoreUnavailable`` when the statement fails."""
        try:
            with _autonomous.claiming(self.alias):
                return _store.record_policy(self.alias, self.record_id, self.token, policy)
        except db.Error as exc:
            raise StoreUnavailable(
                f"nothing ran: the recovery policy could not be recorded ({exc})"
            ) from exc

    def release(self) -> None:
        """Delete the claim, committed at once (the claim was): a retry runs afresh at once.

        A connection that broke (a terminated backend, a restarted server), and the claim's
        own connection inside a caller's transaction after any failure, is replaced and the
        release tried once more (there, each try bounded by ``CLAIM_TIMEOUT``), so that an
        attempt that failed for the connection's sake leaves no claim behind; failing that,
        the record is left to its lease.
        """
        self._at_once(lambda: _store.release(self.alias, self.record_id, self.token), "release")

    def give_back(self, now: datetime | None = None) -> None:
        """End the lease now, keeping the record in progress (stale) for the next ask, which
        recovers it at once rather than after a whole new lease."""
        moment = now or timezone.now()
        self._at_once(
            lambda: _store.give_back(self.alias, self.record_id, self.token, moment), "give back"
        )

    def _store(self, outcome: Outcome, now: datetime | None, commit: bool = False) -> bool:
        return _store.complete(
            self.alias,
            self.record_id,
            self.token,
            status=outcome.status,
            response_status=outcome.response_status,
            response_headers=outcome.headers,
            response_body=outcome.body,
            now=now or timezone.now(),
            commit=commit,
        )

    def _at_once(self, statement: Callable[[], object], what: str) -> None:
        for attempt in (1, 2):
            try:
                with _autonomous.claiming(self.alias):
                    statement()
                return
            except db.Error:
                if attempt == 1 and _autonomous.discard_broken(self.alias):
                    continue
                # The lease runs out on its own; the recovery policy takes it from there.
                logger.exception(
                    "could not %s the claim of record %s; its lease will run out and its "
                    "recovery policy decides",
                    what,
                    self.record_id,
                )
                return
