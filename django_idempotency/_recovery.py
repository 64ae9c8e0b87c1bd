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

from django_idempotency import _policies, conf, signals
from django_idempotency._claims import Claim
from django_idempotency._outcomes import Outcome, failure_outcome
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
    key: str,
    operation: str,
    as_outcome: Callable[[Any], Outcome | None],
    now: datetime | None = None,
    counted: bool = False,
) -> Recovered:
    """Apply a recovery policy to the stale record ``claim`` holds.

    ``"retry"`` and ``"resume"`` run again. ``"fail"`` closes the record with the "outcome
    unknown" problem. A callable gets the record and answers ``None`` (run again) or an
    answer that ``as_outcome`` turns into what is stored (or into ``None``: undecided). An
    outcome is stored fenced and at once (``counted``: with the attempt counted, for the
    recovery job). ``StoreUnavailable`` when the record cannot be read or the outcome
    stored; a callable that raises propagates. Either way the caller decides what becomes of
    the lease.
    """
    declared = _policies.recovery_policy(policy)
    if declared.reruns:
        return Run(resumed=declared.resumable)
    if not declared.asks_callable:
        return _close(claim, failure_outcome(key, operation), None, now, counted)
    assert callable(policy)
    try:
        record = (
            IdempotencyRecord.objects.using(claim.alias)
            .filter(pk=claim.record_id, lease_token=claim.token, status=IN_PROGRESS)
            .first()
        )
    except db.Error as exc:
        raise StoreUnavailable(f"the stale record could not be read ({exc})") from exc
    if record is None:
        return Lost()
    answer = policy(record)
    if answer is None:
        return Run()
    outcome = as_outcome(answer)
    if outcome is None:
        return Undecided(answer)
    return _close(claim, outcome, answer, now, counted)


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
