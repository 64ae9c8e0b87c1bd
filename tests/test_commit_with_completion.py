"""The completion carries the transaction's COMMIT (PostgreSQL on Django's defaults).

Where the engine's fenced transaction is the connection's only atomic block, the completion
and the ``COMMIT`` go in one round trip; the fence holds as before: a completion that finds
no row of its lease fails before the ``COMMIT`` is reached, and the work rolls back. Inside a
caller's transaction, or with prepared statements, the completion is sent alone and the
COMMIT stays the caller's (or the block's).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, connections, transaction

from django_idempotency import InProgress, run_once
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import committed_charges, is_completion
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="the COMMIT with the completion: PostgreSQL's"
    ),
    pytest.mark.skipif(
        connection.settings_dict["OPTIONS"].get("prepare_threshold") is not None,
        reason="with prepared statements the completion is sent alone",
    ),
]
IDENTITY = {"account": "consumer:mail", "operation": "mail.send"}


@contextmanager
def completions() -> Iterator[list[str]]:
    """The text of each completion the default connection sends within the block."""
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if is_completion(sql):
            seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        yield seen


def charge(calls: list[str], tag: str) -> str:
    calls.append(tag)
    Charge.objects.create(account="consumer", amount=1, currency="EUR")
    return tag


def test_outside_any_transaction_the_completion_carries_the_commit() -> None:
    calls: list[str] = []
    with completions() as sent:
        assert run_once(charge, calls, "a", **IDENTITY, key="k-1") == "a"
    assert len(sent) == 1
    assert sent[0].endswith("; COMMIT")
    assert not connection.in_atomic_block
    assert connection.connection.info.transaction_status == 0  # idle: nothing left open
    assert committed_charges() == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    # The replay runs nothing.
    assert run_once(charge, calls, "b", **IDENTITY, key="k-1") == "a"
    assert calls == ["a"]


def test_inside_a_callers_transaction_the_commit_stays_the_callers() -> None:
    calls: list[str] = []
    with completions() as sent, transaction.atomic():
        assert run_once(charge, calls, "a", **IDENTITY, key="k-1") == "a"
        assert committed_charges() == 0  # nothing committed before the caller's block ends
        transaction.set_rollback(True)
    assert len(sent) == 1
    assert not sent[0].endswith("COMMIT")
    assert calls == ["a"]
    assert Charge.objects.count() == 0  # the caller's rollback took the work
    assert committed_charges() == 0


def test_a_lost_lease_rolls_the_work_back_before_the_commit() -> None:
    """Another attempt took the record over while the body ran: the completion finds no
    row of this lease, nothing of the body commits, and the other attempt's record stands."""
    calls: list[str] = []
    other = uuid.uuid4()

    def taken_over_meanwhile(calls: list[str], tag: str) -> str:
        charge(calls, tag)
        with connections["provider"].cursor() as cursor:
            cursor.execute(
                f"UPDATE {IdempotencyRecord._meta.db_table} SET lease_token = %s", [other]
            )
        return tag

    with completions() as sent, pytest.raises(InProgress, match="lost its lease"):
        run_once(taken_over_meanwhile, calls, "a", **IDENTITY, key="k-1")
    assert len(sent) == 1
    assert sent[0].endswith("; COMMIT")
    assert calls == ["a"]
    assert committed_charges() == 0
    record = IdempotencyRecord.objects.get()
    assert record.status == RecordStatus.IN_PROGRESS
    assert record.lease_token == other
    assert not connection.in_atomic_block
    # The connection is usable at once.
    assert Charge.objects.count() == 0
