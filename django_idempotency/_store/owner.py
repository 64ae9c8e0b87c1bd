"""The statements of a claim's owner, each fenced by its lease token: the release, the
give-back of a lease, a recovery attempt counted, and the steps of a resumable operation
(the completion, the other statement of every first request, is beside the claim, in
:mod:`.claiming`). A statement whose fence matches no row says so (``False``):
another attempt owns the record now, and the caller's work must not commit.
"""

from __future__ import annotations

import functools
import uuid
from datetime import datetime
from typing import Any

from django.db import connections
from django.db.models import Field

from django_idempotency._store.statements import (
    cursor,
    owned_by,
    prepared,
    step_table,
    table,
)
from django_idempotency._vendors import of
from django_idempotency.exceptions import OutcomeTooLarge
from django_idempotency.models import IdempotencyStep
from django_idempotency.states import IN_PROGRESS

__all__ = [
    "count_attempt",
    "forget_steps",
    "give_back",
    "record_policy",
    "record_step",
    "recorded_steps",
    "refuse_too_large",
    "release",
]


def _owned(
    alias: str,
    sql: str,
    params: list[Any],
    record_id: int,
    token: uuid.UUID,
    fence: Any = None,
) -> bool:
    """Run ``sql``, whose ``WHERE`` is :func:`.statements.owned_by`, with ``params`` and then
    the record this attempt owns; ``False`` when it matched no row (the lease was lost).
    ``fence``: the token as the driver takes it, where the caller has prepared it."""
    if fence is None:
        # psycopg adapts a UUID as it is; the other drivers take the field's own form of it.
        fence = token if of(alias).native_values else prepared(alias, "lease_token", token)
    owner = [record_id, fence, IN_PROGRESS]
    with cursor(alias) as statement:
        statement.execute(sql, [*params, *owner])
        return int(statement.rowcount) > 0


@functools.lru_cache(maxsize=8)
def _release_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    return f"DELETE FROM {table(alias)} WHERE {owned_by(q)}"


def release(alias: str, record_id: int, token: uuid.UUID) -> bool:
    """Delete a claim this attempt still owns, so that a retry runs afresh."""
    return _owned(alias, _release_sql(alias), [], record_id, token)


@functools.lru_cache(maxsize=8)
def _give_back_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    return f"UPDATE {table(alias)} SET {q('lease_expires_at')} = %s WHERE {owned_by(q)}"


def give_back(alias: str, record_id: int, token: uuid.UUID, now: datetime) -> bool:
    """End this attempt's lease at ``now`` without releasing the record.

    For a recovery that could not decide (its callable raised): the record stays in
    progress with a stale lease, so the next retry, or the recovery job, asks again at once
    instead of after a whole new lease.
    """
    ends = prepared(alias, "lease_expires_at", now)
    return _owned(alias, _give_back_sql(alias), [ends], record_id, token)


@functools.lru_cache(maxsize=8)
def _record_policy_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    return f"UPDATE {table(alias)} SET {q('recovery_policy')} = %s WHERE {owned_by(q)}"


def record_policy(alias: str, record_id: int, token: uuid.UUID, policy: str) -> bool:
    """Store the recovery policy this attempt runs under on the stale record it took over
    (which kept the one it was claimed under until its recovery decided); ``False``: the
    lease was lost."""
    return _owned(alias, _record_policy_sql(alias), [policy], record_id, token)


@functools.lru_cache(maxsize=8)
def _count_attempt_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    counted = f"{q('recovery_attempts')} = {q('recovery_attempts')} + 1"
    return f"UPDATE {table(alias)} SET {counted} WHERE {owned_by(q)}"


def count_attempt(alias: str, record_id: int, token: uuid.UUID) -> bool:
    """Count one recovery attempt on a record this claim owns; ``False``: the lease was lost."""
    return _owned(alias, _count_attempt_sql(alias), [], record_id, token)


@functools.lru_cache(maxsize=8)
def _record_step_sql(alias: str) -> str:
    """One statement records a step, fenced by the owner's lease token.

    The row of the record is read ``FOR SHARE``: a takeover (an ``UPDATE`` of that row) waits
    for the step's transaction, so a step either commits before the takeover, and the new
    owner reads it, or finds the record no longer its own and records nothing.
    """
    connection = connections[alias]
    q = connection.ops.quote_name
    columns = ", ".join(q(c) for c in ("record_id", "name", "result", "created_at"))
    lock = of(alias).share_lock if connection.features.has_select_for_update else ""
    return (
        f"INSERT INTO {step_table(alias)} ({columns})"
        f" SELECT {q('id')}, %s, %s, %s FROM {table(alias)} WHERE {owned_by(q)}{lock}"
    )


def refuse_too_large(alias: str, body: bytes, text: str) -> None:
    """``OutcomeTooLarge`` before a statement carrying ``body`` and ``text`` (an outcome's
    body and its headers as JSON; a step's result) that the server would refuse for its
    size (:meth:`.Vendor.statement_limit`)."""
    limit = of(alias).statement_limit(connections[alias], body, text)
    if limit is not None:
        size = len(body) + len(text.encode())
        raise OutcomeTooLarge(
            f"the outcome ({size} bytes before escaping) would make a statement larger "
            f"than the idempotency database takes ({limit} bytes: max_allowed_packet); it "
            "was not stored, and the work was rolled back",
            size=size,
            limit=limit,
        )


def record_step(
    alias: str, record_id: int, token: uuid.UUID, name: str, result: str, now: datetime
) -> bool:
    """Record a step's result for the record this attempt owns; ``False``: the lease was lost."""
    created = IdempotencyStep._meta.get_field("created_at")
    assert isinstance(created, Field)
    if of(alias).packet_limit_sql is not None:  # a server that caps a statement's size
        refuse_too_large(alias, b"", result)
    params = [name, result, created.get_db_prep_save(now, connections[alias])]
    return _owned(alias, _record_step_sql(alias), params, record_id, token)


@functools.lru_cache(maxsize=8)
def _recorded_steps_sql(alias: str) -> str:
    q = connections[alias].ops.quote_name
    return f"SELECT {q('name')}, {q('result')} FROM {step_table(alias)} WHERE {q('record_id')} = %s"


def recorded_steps(alias: str, record_id: int) -> dict[str, str]:
    """The steps recorded for a record so far: ``{name: result as JSON text}``."""
    with cursor(alias) as statement:
        statement.execute(_recorded_steps_sql(alias), [record_id])
        return {str(name): str(result) for name, result in statement.fetchall()}


def forget_steps(alias: str, record_id: int) -> None:
    """Delete the steps of a record that an expired record's replacement starts afresh."""
    q = connections[alias].ops.quote_name
    with cursor(alias) as statement:
        statement.execute(
            f"DELETE FROM {step_table(alias)} WHERE {q('record_id')} = %s", [record_id]
        )
