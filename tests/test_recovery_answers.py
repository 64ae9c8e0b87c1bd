"""What a recovery callable answers for ``run_once``, after a crash, when it cannot be stored.

The attempt that crashed left its claim in progress; once its lease ran out, the next call
meets the recovery policy. A callable that answers a value the engine cannot store (not
JSON) is a defect of the project's: the call raises ``TypeError`` saying why, the
record is left for the next attempt (not completed, not run again), and a callable that
answers storable values later closes it. Effects counted: the body's runs, the policy's
calls, the record's state.
"""

from __future__ import annotations

from typing import Any

import pytest

from django_idempotency import run_once
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.models import IdempotencyRecord, RecordStatus
from django_idempotency.testing import crash, expire_lease
from tests.helpers import new_key

pytestmark = pytest.mark.django_db(transaction=True)

IDENTITY = {"account": "consumer", "operation": "orders.ship"}


CALLS: dict[str, int] = {}


def unstorable(record: IdempotencyRecord) -> Any:
    CALLS["unstorable"] = CALLS.get("unstorable", 0) + 1
    return object()


def storable(record: IdempotencyRecord) -> Any:
    CALLS["storable"] = CALLS.get("storable", 0) + 1
    return {"shipped": "by hand"}


def test_an_answer_that_cannot_be_stored_leaves_the_record_for_the_next_attempt():
    runs: list[str] = []
    key = new_key()

    def ship() -> str:
        runs.append("ran")
        if len(runs) == 1:
            crash()
        return "shipped"

    CALLS.clear()
    with pytest.raises(SimulatedCrash):
        run_once(ship, **IDENTITY, key=key, recovery=unstorable)
    expire_lease(key)
    for calls in (1, 2):
        with pytest.raises(TypeError, match="object is not JSON"):
            run_once(ship, **IDENTITY, key=key, recovery=unstorable)
        assert {"unstorable": calls} == CALLS
        assert IdempotencyRecord.objects.get().status == RecordStatus.IN_PROGRESS
    answers: list[Any] = [run_once(ship, **IDENTITY, key=key, recovery=storable) for _ in range(2)]
    assert answers == [{"shipped": "by hand"}] * 2
    assert (runs, CALLS) == (["ran"], {"unstorable": 2, "storable": 1})
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


class AskTheProvider:
    """A recovery policy written as an instance with ``__call__``."""

    def __init__(self) -> None:
        self.asked = 0

    def __call__(self, record: IdempotencyRecord) -> Any:
        self.asked += 1
        return {"shipped": "per the provider"}


def test_a_callable_instance_is_a_recovery_policy():
    """Accepted as any callable is (it had no ``__qualname__`` to be stored by): the crashed
    attempt's record is closed by it, and the body runs once."""
    runs: list[str] = []
    key = new_key()
    policy = AskTheProvider()

    def ship() -> Any:
        runs.append("ran")
        crash()
        return "shipped"

    with pytest.raises(SimulatedCrash):
        run_once(ship, **IDENTITY, key=key, recovery=policy)
    record = IdempotencyRecord.objects.get()
    # Stored under its class's name, which no path imports: the recovery job says so.
    assert record.recovery_policy == f"{__name__}.AskTheProvider()"
    expire_lease(record)
    assert run_once(ship, **IDENTITY, key=key, recovery=policy) == {"shipped": "per the provider"}
    assert policy.asked == 1
    assert runs == ["ran"]
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
