"""Recovery: what becomes of a record whose owner stopped before it finished.

A claim that took over a stale lease (the request path, ``run_once``, a task, a tool call)
and the recovery job apply the same rule, :func:`recover`, and read its answer with one
``match``: :class:`Run` (run the operation again; the recovery job releases the record
instead), :class:`Closed` (an outcome is stored and answered to every retry),
:class:`Undecided` (a callable answered something that cannot be stored) or :class:`Lost`
(the record changed meanwhile and was left alone).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from django import db

from django_idempotency import _autonomous, _policies, conf, signals
from django_idempotency._claims import Claim
from django_idempotency._context import IdempotencyContext, running
from django_idempotency._outcomes import Outcome, failure_outcome
from django_idempotency._steps import outside_steps
from django_idempotency.exceptions import StoreUnavailable
from django_idempotency.models import IdempotencyRecord
from django_idempotency.states import FAILED, IN_PROGRESS

__all__ = [
    "Closed",
    "Lost",
    "Policy",
    "Recovered",
    "Run",
    "Undecided",
    "announce",
    "deciding",
    "recover",
    "recovery_name",
    "resolve_recovery",
]

logger = logging.getLogger("django_idempotency")

Policy = str | Callable[[Any], Any]


@dataclass(frozen=True)
class Run:
    """Run the operation again (``"retry"``, ``"resume"``, or a callable that answered
    ``None``); ``resumed``: after its recorded steps."""

    resumed: bool = False

    @property
    def name(self) -> str:
        return "resumed" if self.resumed else "retried"


@dataclass(frozen=True)
class Closed:
    """The record is closed with ``outcome``, answered to every retry: ``"fail"``'s outcome
    unknown, or a callable's ``answer``."""

    outcome: Outcome
    answer: Any = None

    @property
    def name(self) -> str:
        return "failed" if self.outcome.status == FAILED else "completed"


@dataclass(frozen=True)
class Undecided:
    """The callable answered something that cannot be stored (``answer``: a 5xx, say)."""

    answer: Any


@dataclass(frozen=True)
class Lost:
    """The record changed meanwhile (completed, released or taken over): left alone."""


Recovered = Run | Closed | Undecided | Lost


def recover(
    claim: Claim,
    policy: Policy,
    *,
    account: str,
    key: str,
    operation: str,
    as_outcome: Callable[[Any], Outcome | None],
    now: datetime | None = None,
    counted: bool = False,
    runs_under: str | None = None,
) -> Recovered:
    """Apply a recovery policy to the stale record ``claim`` holds.

    ``"retry"`` and ``"resume"`` run again. ``"fail"`` closes the record with the "outcome
    unknown" problem. A callable gets the record and answers ``None`` (run again) or an
    answer that ``as_outcome`` turns into what is stored (or into ``None``: undecided);
    while it runs, :func:`current` is the recovered operation's context (``account``,
    ``key``, ``operation``: its ``downstream_key`` is the crashed attempt's, whatever
    operation the caller runs), and ``step()`` belongs to no operation. An
    outcome is stored fenced and at once (``counted``: with the attempt counted, for the
    recovery job). ``StoreUnavailable`` when the record cannot be read or the outcome
    stored; a callable that raises propagates. Either way the caller decides what becomes of
    the lease.

    ``runs_under``: the stored name of the policy the operation would run again under, where
    it is not the one the record was claimed under (see :func:`deciding`); before the answer
    is to run again, the record takes it (``Lost`` when it is no longer this claim's).
    """
    declared = _policies.recovery_policy(policy)
    if declared.reruns:
        return _run(claim, runs_under, resumed=declared.resumable)
    if not declared.asks_callable:
        return _close(claim, failure_outcome(key, operation), None, now, counted)
    assert callable(policy)
    try:
        # Read where the claim was made: inside a caller's transaction whose snapshot is
        # older than the takeover (MariaDB's REPEATABLE READ), the caller's own connection
        # would not see it, and the record would be taken for lost.
        with _autonomous.claiming(claim.alias):
            record = (
                IdempotencyRecord.objects.using(claim.alias)
                .filter(pk=claim.record_id, lease_token=claim.token, status=IN_PROGRESS)
                .first()
            )
    except db.Error as exc:
        raise StoreUnavailable(f"the stale record could not be read ({exc})") from exc
    if record is None:
        return Lost()
    recovered = IdempotencyContext(key, operation, account, record_id=claim.record_id)
    with running(recovered), outside_steps():
        answer = policy(record)
    if answer is None:
        return _run(claim, runs_under)
    outcome = as_outcome(answer)
    if outcome is None:
        return Undecided(answer)
    return _close(claim, outcome, answer, now, counted)


def _run(claim: Claim, runs_under: str | None, resumed: bool = False) -> Run | Lost:
    if runs_under is not None and not claim.record_policy(runs_under):
        return Lost()
    return Run(resumed=resumed)


def deciding(claimed_under: str | None, policy: Policy) -> Policy:
    """The policy that decides a stale lease claimed under ``claimed_under`` (the record's
    stored policy; ``None`` where unknown) and taken over by an attempt under ``policy``.

    The same policy decides as always. Otherwise the crashed attempt's promise holds, and
    the stricter of the two decides: a claim under ``"retry"`` promised nothing (the new
    policy decides); one under ``"fail"`` is never run again; one under ``"resume"`` is
    resumed only by a body that resumes, and is closed as ``"fail"`` closes it otherwise
    (its recorded steps would run again); a callable claimed under is asked before a body
    under ``"retry"`` or ``"resume"`` runs, and a callable that can no longer be imported
    closes the record as ``"fail"`` does. A new callable over an old one decides.
    """
    if claimed_under is None or claimed_under == recovery_name(policy):
        return policy
    stored = _policies.recovery_policy(claimed_under)
    current = _policies.recovery_policy(policy)
    if stored.reruns and not stored.resumable:  # "retry"
        return policy
    if stored.asks_callable and not current.asks_callable and current.reruns:
        try:
            asked: Any = resolve_recovery(claimed_under)
        except Exception:  # whatever the import raised: never run blindly
            asked = None
        if callable(asked):
            found: Policy = asked
            return found
        logger.warning(
            "the recovery policy %s that a stale record was claimed under cannot be "
            "imported: the record is closed as 'fail' closes it",
            claimed_under,
        )
        return _policies.FAIL.name
    if stored.asks_callable and current.asks_callable:
        return policy
    return _policies.FAIL.name


def _close(
    claim: Claim, outcome: Outcome, answer: Any, now: datetime | None, counted: bool
) -> Closed | Lost:
    try:
        closed = claim.close(outcome, now=now, counted=counted)
    except db.Error as exc:
        raise StoreUnavailable(
            f"the recovery policy's outcome could not be stored ({exc})"
        ) from exc
    return Closed(outcome, answer) if closed else Lost()


def recovery_name(recovery: str | Callable[..., Any]) -> str:
    """How a recovery policy is stored on the record, so the recovery job can apply it."""
    if isinstance(recovery, str):
        return recovery
    name = getattr(recovery, "__qualname__", None)
    if name is None:  # an instance with __call__: named after its class, as no path imports it
        kind = type(recovery)
        return f"{kind.__module__}.{kind.__qualname__}()"
    return f"{recovery.__module__}.{name}"


def resolve_recovery(recovery: str | Callable[..., Any]) -> Any:
    """``"retry"``, ``"fail"``, ``"resume"``, or the callable a dotted path names."""
    if isinstance(recovery, str) and recovery not in _policies.RECOVERY_POLICIES:
        return conf.resolve_callable(recovery)
    return recovery


class Named(Protocol):
    """Whose record and which: an ``IdempotencyContext``, an ``Operation``, a stale row."""

    @property
    def account(self) -> str: ...
    @property
    def operation(self) -> str: ...
    @property
    def key(self) -> str: ...


def announce(named: Named, record_id: int | None, policy: str, outcome: str) -> None:
    """Log and signal (``lease_recovered``) what a recovery policy did with a record."""
    # The record is named by its id: the client's key does not belong in logs.
    logger.info(
        "recovery policy %s on record %s (%s): %s", policy, record_id, named.operation, outcome
    )
    if signals.lease_recovered.has_listeners(IdempotencyRecord):
        signals.lease_recovered.send(
            sender=IdempotencyRecord,
            account=named.account,
            operation=named.operation,
            key=named.key,
            policy=policy,
            outcome=outcome,
        )
