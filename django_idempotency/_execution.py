"""The owner's execution: the operation's code and its completion, fenced by the lease.

:func:`run_owned` is what every entry point calls once it holds a claim: one transaction for
the body and the completion (:func:`run_fenced`), or, under the recovery policy
``"resume"``, the body's steps each in its own and then the completion
(:func:`run_resumable`). What happens to the claim when the body fails is decided here,
once: released (a retry runs afresh), given back (the policy decides at once), or kept (a
crash, a lost lease).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from django import db
from django.db import transaction

from django_idempotency import _retry, _store, _vendors
from django_idempotency._claims import KEEP_CLAIM, Claim, store_failed
from django_idempotency._outcomes import Outcome
from django_idempotency._policies import RECOVERY_POLICIES, recovery_policy
from django_idempotency._steps import outside_steps, recording
from django_idempotency.exceptions import OutcomeTooLarge, RecordUnreadable, StoreUnavailable

__all__ = ["Fenced", "run_fenced", "run_owned", "run_resumable"]

T = TypeVar("T")


@dataclass(frozen=True)
class Fenced(Generic[T]):
    """What a fenced execution gave: the body's result, and whether its outcome was stored
    (otherwise its work was rolled back and the claim released, or given back)."""

    result: T
    stored: bool


class _RolledBack(Exception):
    def __init__(self, result: Any, outcome: Outcome | None, raw: Any = None) -> None:
        self.result = result
        self.outcome = outcome
        self.raw = raw  # the driver's connection the block ran on


def run_owned(
    policy: Any,
    claim: Claim,
    body: Callable[[], T],
    judge: Callable[[T], Outcome | None],
    fresh: bool = False,
) -> Fenced[T]:
    """The owner's execution for ``policy``: resumable steps under ``"resume"``, else one
    fenced transaction. ``fresh``: the claim is new, not a takeover."""
    # A policy named by a word: its declaration read from the table without a call (every
    # request's path); any other (a callable, a dotted path) declared by recovery_policy.
    declared = RECOVERY_POLICIES.get(policy) if policy.__class__ is str else None
    if declared is None:
        declared = recovery_policy(policy)
    if declared.resumable:
        return run_resumable(claim, body, judge, fresh)
    return run_fenced(
        claim, body, judge, keep_on_store_failure=declared.keeps_claim_on_store_failure
    )


def run_fenced(
    claim: Claim,
    body: Callable[[], T],
    judge: Callable[[T], Outcome | None],
    keep_on_store_failure: bool = False,
) -> Fenced[T]:
    """Run ``body`` and complete the record in one transaction.

    ``judge(result)`` says what to store, or ``None``: then the body's work is rolled back and
    the claim released, so a retry runs afresh. When the body raises, the same happens and
    the exception propagates. What is no ``Exception`` (``_claims.CRASHES``: a crash, a
    cancellation, ``SystemExit`` or ``KeyboardInterrupt`` inside the body) is not the
    body's error: its work rolls back and the claim is kept, as a killed process leaves it.
    When the body marked its own transaction for rollback, its outcome (if storable) is
    stored after the rollback: it is still the deterministic answer of this request.
    Raises ``LeaseLost`` when another attempt owns the record now.

    When the completion (or its commit) fails after the body ran, or the database refuses
    the body's transaction as a deadlock or a conflict (a retry is asked for), the work
    rolls back and ``StoreUnavailable`` is raised; the claim is released, or, with
    ``keep_on_store_failure`` (every policy but ``"retry"``: the body's external calls may
    have happened), its lease is given back, so the policy decides as after a crash. The
    connection lost (the server gone, the backend terminated) is ``StoreUnavailable`` too:
    before the body started (``ran=False``) the claim is released whatever the policy; once
    it started, as a failed completion. Any other error of the body's propagates as it is.
    """
    alias = claim.alias
    started = completing = False
    raw = None  # the driver's connection the block runs on
    try:
        with outside_steps():
            try:
                with transaction.atomic(using=alias):
                    started = True
                    connection = db.connections[alias]
                    raw = connection.connection
                    rider = None
                    try:
                        # Where this block is the only one, its BEGIN rides with its first
                        # statement, and its COMMIT with the completion.
                        rider = _store.begin_riding(connection)
                        result = body()
                        completing = True
                        outcome = judge(result)
                        if outcome is None or transaction.get_rollback(using=alias):
                            raise _RolledBack(result, outcome, connection.connection)
                        claim.complete(outcome, commit=True)
                    finally:
                        if rider is not None and rider in connection.execute_wrappers:
                            connection.execute_wrappers.remove(rider)  # no statement took it
            except _RolledBack as rolled_back:
                if rolled_back.outcome is None:
                    claim.release()
                    return Fenced(rolled_back.result, stored=False)
                if db.connections[alias].connection is not rolled_back.raw:
                    # The block's rollback found its connection broken, and Django replaced
                    # it: the body caught the loss of its connection and answered. The
                    # answer of a transaction the store lost is never stored as final.
                    raise db.OperationalError(
                        "the connection was lost during the operation's transaction"
                    ) from None
                claim.complete(rolled_back.outcome)
                return Fenced(rolled_back.result, stored=True)
        return Fenced(result, stored=True)
    except KEEP_CLAIM:
        # A crash (or a cancellation) leaves the claim as a killed process would: held until
        # its lease runs out, then recovered by its policy. Never a silent release.
        raise
    except (db.Error, StoreUnavailable) as exc:
        # The completion or its commit, or an operation the body runs (its own run_once,
        # whose record could not be written): the store's failure, not the body's error.
        failed = completing or isinstance(exc, StoreUnavailable)
        # The connection itself lost (a server or node gone, a backend terminated), at the
        # transaction's start (a round trip on MariaDB) or in the body: the store's failure
        # too, never the body's error. Its transaction did not commit.
        lost = not failed and isinstance(exc, db.Error) and _lost(exc, alias, raw, started)
        # The database refusing the work's own transaction as a deadlock, a serialization
        # failure or a Galera certification conflict: it asks for a retry.
        refused = isinstance(exc, db.OperationalError) and _retry.is_retryable(exc)
        if (failed or refused or (lost and started)) and keep_on_store_failure:
            claim.give_back()
        else:
            claim.release()
        if isinstance(exc, StoreUnavailable):
            if exc.ran:
                raise
            raise _body_ran(exc) from exc
        if lost and not started:
            raise StoreUnavailable(
                f"nothing ran: the connection was lost before the operation's transaction "
                f"began, and the claim was released ({exc})"
            ) from exc
        # The completion's failure, the connection lost, or the work's transaction refused:
        # the work was rolled back.
        if failed or lost or refused:
            raise store_failed(exc) from exc
        raise
    except RecordUnreadable:
        # An operation the body runs (its own run_once) whose outcome cannot be read back:
        # the store cannot answer, after the body started, as when it fails (above).
        if keep_on_store_failure:
            claim.give_back()
        else:
            claim.release()
        raise
    except Exception:
        # The body's own error: a retry runs afresh. Whatever is no Exception (a crash, a
        # cancellation, the process told to exit) passes through above or here untouched:
        # the claim is kept as a killed process's would be.
        claim.release()
        raise


def _lost(exc: db.Error, alias: str, raw: Any, started: bool = True) -> bool:
    """Whether ``exc`` says that the connection of ``alias`` was lost. An
    ``InterfaceError`` once the body started is the driver's refusal of a closed cursor
    (the body's own error) or of a closed connection: only the latter fails the rollback
    of an atomic block, and Django then replaces the connection (``raw`` was the
    driver's connection before)."""
    if not _vendors.connection_lost(exc):
        return False
    if started and isinstance(exc, db.InterfaceError):
        return db.connections[alias].connection is not raw
    return True


def _body_ran(exc: StoreUnavailable) -> StoreUnavailable:
    """What the owner raises for ``exc``, a ``StoreUnavailable`` with ``ran`` false raised
    once its body had started: an operation the body runs (its own ``run_once``, whose claim
    could not be recorded) says that *it* did not run, but the body did, and its database
    work is rolled back. The client is told so, never that nothing ran: the body may have
    made its external calls already.
    """
    return StoreUnavailable(
        "the body ran, but an operation it runs could not be recorded: its database work was "
        f"rolled back and its claim released (or its lease given back) for a retry ({exc})",
        ran=True,
    )


def run_resumable(
    claim: Claim,
    body: Callable[[], T],
    judge: Callable[[T], Outcome | None],
    fresh: bool = False,
) -> Fenced[T]:
    """Run ``body`` as a resumable operation (``"resume"``): outside one transaction, its
    ``step()`` calls each committing with its recorded result; then store the outcome.

    The steps recorded by earlier attempts are read once, here (when that read fails:
    ``StoreUnavailable``, and a ``fresh`` claim, which has no steps, is released; a taken
    over one keeps its steps and gives its lease back). When the body raises (or ``judge``
    has nothing to store: a 5xx), the recorded steps are kept and the lease is given back at
    once, so the next attempt resumes at once. ``LeaseLost`` when another attempt owns the
    record now: at a step, or at the completion. The connection lost in the body (in a
    step, or between them), or a step's transaction refused as a deadlock or a conflict, is
    ``StoreUnavailable`` (``ran``), the lease given back.
    """
    try:
        recorded = _store.recorded_steps(claim.alias, claim.record_id)
    except db.Error as exc:
        claim.release() if fresh else claim.give_back()
        raise store_failed(exc, ran=False) from exc
    raw = db.connections[claim.alias].connection
    try:
        with recording(claim, recorded):
            result = body()
            outcome = judge(result)
    except KEEP_CLAIM:
        raise
    except db.Error as exc:
        claim.give_back()
        refused = isinstance(exc, db.OperationalError) and _retry.is_retryable(exc)
        if refused or _lost(exc, claim.alias, raw):
            # The connection lost in a step (or between them), or a step's transaction
            # refused as a deadlock, a serialization failure or a Galera certification
            # conflict (a retry is asked for): the store's failure, as in one transaction
            # (run_fenced); the steps recorded before it are kept.
            raise store_failed(exc) from exc
        raise
    except StoreUnavailable as exc:  # of an operation the body ran (its own run_once)
        claim.give_back()
        if exc.ran:
            raise
        raise _body_ran(exc) from exc
    except BaseException:
        claim.give_back()
        raise
    if outcome is None:
        claim.give_back()
        return Fenced(result, stored=False)
    try:
        with transaction.atomic(using=claim.alias):
            claim.complete(outcome)
    except db.Error as exc:  # the commit
        claim.give_back()
        raise store_failed(exc) from exc
    except (StoreUnavailable, OutcomeTooLarge):
        # OutcomeTooLarge: refused before it was sent; the recorded steps are kept, and
        # the lease given back as when the body raises.
        claim.give_back()
        raise
    return Fenced(result, stored=True)
