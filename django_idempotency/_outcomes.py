"""Outcomes: what a record stores and answers to every retry, and the refusal of one that
cannot be read back."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django_idempotency import _problems, signals
from django_idempotency._context import IdempotencyContext
from django_idempotency.crypto import Unreadable
from django_idempotency.exceptions import RecordUnreadable
from django_idempotency.models import IdempotencyRecord
from django_idempotency.states import COMPLETED, FAILED

__all__ = ["Outcome", "failure_outcome", "refuse_unreadable"]

logger = logging.getLogger("django_idempotency")


@dataclass(frozen=True)
class Outcome:
    """What is stored and answered to every retry: a status, headers and body bytes."""

    response_status: int
    headers: list[list[str]]
    body: bytes
    status: str = COMPLETED


def failure_outcome(key: str, operation: str) -> Outcome:
    """What the ``"fail"`` recovery policy stores: the "outcome unknown" problem."""
    detail = (
        f"The request with key {key!r} for {operation} stopped before it finished; whether it "
        "took effect is unknown and needs reconciliation. It will not be run again."
    )
    return Outcome(
        _problems.OUTCOME_UNKNOWN.status,
        [["Content-Type", _problems.PROBLEM_CONTENT_TYPE]],
        _problems.OUTCOME_UNKNOWN.body(detail),
        FAILED,
    )


def refuse_unreadable(
    context: IdempotencyContext, problem: Unreadable, request: Any = None
) -> RecordUnreadable:
    """Log and signal (``record_unreadable``) a retry refused because its record's stored
    outcome cannot be read back; the exception that refuses it (the HTTP side answers it as
    ``503`` ``idempotency_record_unreadable``). Nothing runs: within its TTL an outcome that
    cannot be read is never produced a second time."""
    # The record is named by its id and the sealing key by its public id: never the client's
    # key, and never a key of ENCRYPTION_KEYS.
    logger.warning(
        "the stored outcome of record %s (%s) cannot be read back (%s); the retry was "
        "refused and nothing ran%s",
        context.record_id,
        context.operation,
        problem,
        f": configure the key {problem.key_id} again" if problem.key_id else "",
        extra={"key_id": problem.key_id},
    )
    if signals.record_unreadable.has_listeners(IdempotencyRecord):
        signals.record_unreadable.send(
            sender=IdempotencyRecord,
            request=request,
            account=context.account,
            operation=context.operation,
            key=context.key,
            key_id=problem.key_id,
            reason=str(problem),
        )
    remedy = (
        f"; it is answered again once a key that opens it (id {problem.key_id}) is in "
        "ENCRYPTION_KEYS"
        if problem.key_id
        else ""
    )
    return RecordUnreadable(
        f"the outcome of key {context.key!r} for {context.operation} is stored but cannot be "
        f"read back ({problem}). It was not run again{remedy}.",
        key_id=problem.key_id,
    )
