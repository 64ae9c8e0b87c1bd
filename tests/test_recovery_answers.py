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

from django_idempotency import current, run_once, step
from django_idempotency._once import loaded_result
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.maintenance import recover_stale_leases
from django_idempotency.models import IdempotencyRecord, IdempotencyStep, RecordStatus
from django_idempotency.testing import crash, expire_lease
from tests.helpers import new_key
from tests.testapp.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

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


# -- what a recovery callable sees -------------------------------------------------------------

ASKED: list[str | None] = []


def ship_and_crash(order: int) -> str:
    """Calls the provider with the operation's key for it, then dies before completing."""
    context = current()
    assert context is not None
    ProviderCall.objects.using("provider").create(key=context.downstream_key("charge"))
    crash()
    return "unreachable"


def ship_after_asking(order: int) -> str:
    ProviderCall.objects.using("provider").create(key="the body ran again")
    return "shipped again"


def ask_the_provider(record: IdempotencyRecord) -> Any:
    """Asks the provider about the crashed attempt's charge, by the key it was sent with;
    ``None`` (run again) where the provider never saw it."""
    context = current()
    ASKED.append(None if context is None else context.operation)
    with pytest.raises(RuntimeError, match="step"):
        step("inside the recovery", lambda: "recorded nowhere")
    if context is None:
        return None
    key = context.downstream_key("charge")
    charged = ProviderCall.objects.using("provider").filter(key=key).exists()
    return {"charged": key} if charged else None


def test_a_recovery_callable_sees_the_operation_it_recovers_even_inside_another():
    """``current()`` inside a recovery callable is the crashed operation's context, whatever
    operation calls it (here ``run_once`` inside a resumable one): its ``downstream_key``
    is the one the crashed attempt sent the provider, and ``step()`` there belongs to no
    operation (it raises, and records nothing into the operation around it). The recovery
    job's callable sees the same. Counted: the body's provider calls, the steps recorded."""
    ASKED.clear()
    key = new_key()
    inner = {"account": "consumer", "operation": "orders.ship", "key": key}
    with pytest.raises(SimulatedCrash):
        run_once(ship_and_crash, 7, **inner, recovery=ask_the_provider)
    expire_lease(key)
    sent = ProviderCall.objects.using("provider").get().key

    def outer() -> Any:
        step("before", lambda: "before")
        shipped = run_once(ship_after_asking, 7, **inner, recovery=ask_the_provider)
        step("after", lambda: "after")
        return shipped

    answer = run_once(outer, account="consumer", operation="orders.batch", key=new_key(),
                      recovery="resume")  # fmt: skip
    assert answer == {"charged": sent}
    assert ASKED == ["orders.ship"]
    assert list(ProviderCall.objects.using("provider").values_list("key", flat=True)) == [sent]
    outer_record = IdempotencyRecord.objects.get(operation="orders.batch")
    assert sorted(IdempotencyStep.objects.filter(record=outer_record).values_list(
        "name", flat=True)) == ["after", "before"]  # fmt: skip

    # The recovery job asks the same callable, which sees the same operation and key.
    ASKED.clear()
    other = new_key()
    with pytest.raises(SimulatedCrash):
        run_once(ship_and_crash, 8, **{**inner, "key": other}, recovery=ask_the_provider)
    expire_lease(other)
    assert recover_stale_leases().completed == 1
    assert ASKED == ["orders.ship"]
    assert loaded_result(IdempotencyRecord.objects.get(key=other).response_body) == {
        "charged": ProviderCall.objects.using("provider").latest("pk").key
    }
    assert ProviderCall.objects.using("provider").count() == 2
