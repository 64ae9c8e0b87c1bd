"""``run_once``: the guarantee for any code path, with its effects counted."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction

import django_idempotency
from django_idempotency import (
    IdempotencyError,
    InProgress,
    KeyReused,
    OutcomeUnknown,
    current,
    run_once,
)
from django_idempotency.keys import InvalidKey
from django_idempotency.models import IdempotencyRecord, RecordStatus
from django_idempotency.testing import expire_lease
from tests.helpers import in_thread, nested_past_json, postgres_only
from tests.live import ROOT, server_env
from tests.testapp.models import Charge, ProviderCall

pytestmark = pytest.mark.django_db
WAIT = 30
IDENTITY = {"account": "consumer:shipping", "operation": "orders.ship"}


def ship(order_id: int, *, calls: list[int], note: str = "") -> dict[str, Any]:
    calls.append(order_id)
    Charge.objects.create(account="consumer", amount=order_id, currency="EUR")
    return {"shipped": order_id, "note": note}


def test_the_first_call_runs_and_a_duplicate_returns_the_stored_result():
    calls: list[int] = []
    first = run_once(ship, 7, **IDENTITY, key="m-1", calls=calls, note="x")
    again = run_once(ship, 7, **IDENTITY, key="m-1", calls=calls, note="x")
    assert first == again == {"shipped": 7, "note": "x"}
    assert calls == [7]
    assert Charge.objects.count() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.account, record.operation, record.key) == (
        "consumer:shipping",
        "orders.ship",
        "m-1",
    )
    assert record.status == RecordStatus.COMPLETED


def test_the_stored_result_is_what_json_gives_back():
    def answer() -> tuple[int, int]:
        return (1, 2)

    first: Any = run_once(answer, **IDENTITY, key="t")
    again: Any = run_once(answer, **IDENTITY, key="t")
    assert (first, again) == ((1, 2), [1, 2])


def test_another_key_or_account_is_another_operation():
    calls: list[int] = []
    run_once(ship, 1, **IDENTITY, key="a", calls=calls)
    run_once(ship, 1, **IDENTITY, key="b", calls=calls)
    run_once(ship, 1, account="consumer:other", operation="orders.ship", key="a", calls=calls)
    assert calls == [1, 1, 1]
    assert Charge.objects.count() == 3


def test_a_result_that_is_not_json_is_a_type_error_and_nothing_commits():
    def unstorable() -> object:
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        return object()

    with pytest.raises(TypeError, match="JSON"):
        run_once(unstorable, **IDENTITY, key="k")
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()  # released: the next call runs afresh
    calls: list[int] = []
    assert run_once(ship, 3, **IDENTITY, key="k", calls=calls)["shipped"] == 3


def test_an_exception_rolls_back_releases_and_propagates():
    def boom() -> None:
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        raise LookupError("provider said no")

    with pytest.raises(LookupError):
        run_once(boom, **IDENTITY, key="k")
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()
    calls: list[int] = []
    run_once(ship, 1, **IDENTITY, key="k", calls=calls)
    assert calls == [1]


def test_a_fingerprint_tells_a_reused_key_from_a_retry():
    calls: list[int] = []
    run_once(ship, 1, **IDENTITY, key="k", fingerprint={"order": 1, "to": "home"}, calls=calls)
    # The same value in another order is the same fingerprint.
    again = run_once(
        ship, 1, **IDENTITY, key="k", fingerprint={"to": "home", "order": 1}, calls=calls
    )
    assert again["shipped"] == 1
    with pytest.raises(KeyReused):
        run_once(ship, 2, **IDENTITY, key="k", fingerprint={"order": 2}, calls=calls)
    with pytest.raises(KeyReused):
        run_once(ship, 2, **IDENTITY, key="k", fingerprint="order 2", calls=calls)
    assert calls == [1]


def test_the_exceptions_are_importable_and_share_a_base():
    for exc in (InProgress, KeyReused, OutcomeUnknown):
        assert issubclass(exc, IdempotencyError)
    assert django_idempotency.run_once is run_once
    with pytest.raises(AttributeError):
        django_idempotency.no_such_name  # noqa: B018


@pytest.mark.parametrize("key", ["", "x" * 256, "has space", "caf\u00e9", 42, None])
def test_a_bad_key_is_refused_before_any_claim(key):
    calls: list[int] = []
    with pytest.raises(InvalidKey):
        run_once(ship, 1, **IDENTITY, key=key, calls=calls)
    assert calls == []
    assert not IdempotencyRecord.objects.exists()


def test_current_names_the_running_operation():
    seen: list[Any] = []

    def look() -> str:
        context = current()
        assert context is not None
        seen.append((context.key, context.operation, context.account, context.replayed))
        return context.downstream_key("provider")

    assert current() is None
    key = run_once(look, **IDENTITY, key="k")
    assert seen == [("k", "orders.ship", "consumer:shipping", False)]
    assert current() is None
    assert len(key) == 64


def test_a_record_closed_by_the_fail_policy_raises_outcome_unknown(settings):
    calls: list[int] = []
    stale_record("k", policy="fail")
    with pytest.raises(OutcomeUnknown):
        run_once(ship, 1, **IDENTITY, key="k", recovery="fail", calls=calls)
    with pytest.raises(OutcomeUnknown):
        run_once(ship, 1, **IDENTITY, key="k", recovery="fail", calls=calls)
    assert calls == []
    assert IdempotencyRecord.objects.get().status == RecordStatus.FAILED


def stale_record(key: str, policy: str) -> IdempotencyRecord:
    """A record of ``run_once`` whose owner died: in progress, its lease run out."""
    started = timezone_now()
    return IdempotencyRecord.objects.create(
        **IDENTITY,
        key=key,
        request_hash=django_idempotency._once.fingerprint_of(None),
        fingerprint_version=django_idempotency._once.FINGERPRINT_VERSION,
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=started - timedelta(seconds=1),
        recovery_policy=policy,
        expires_at=started + timedelta(hours=1),
    )


def timezone_now() -> Any:
    from django.utils import timezone

    return timezone.now()


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_two_threads_one_runs_the_other_gets_in_progress():
    entered, leave = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow() -> str:
        calls.append("slow")
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        entered.set()
        assert leave.wait(WAIT)
        return "done"

    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(in_thread(lambda: run_once(slow, **IDENTITY, key="k", lease=30)))
        assert entered.wait(WAIT)
        with pytest.raises(InProgress) as raised:
            run_once(slow, **IDENTITY, key="k", lease=30)
        leave.set()
        assert first.result(WAIT) == "done"
    assert isinstance(raised.value.retry_after, int)
    assert 1 <= raised.value.retry_after <= 30
    assert calls == ["slow"]
    assert Charge.objects.count() == 1
    assert run_once(slow, **IDENTITY, key="k") == "done"


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_an_attempt_that_lost_its_lease_rolls_back_and_raises_in_progress():
    entered, leave = threading.Event(), threading.Event()

    def late() -> str:
        Charge.objects.create(account="late", amount=1, currency="EUR")
        entered.set()
        assert leave.wait(WAIT)
        return "late"

    def prompt() -> str:
        Charge.objects.create(account="prompt", amount=1, currency="EUR")
        return "prompt"

    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(in_thread(lambda: run_once(late, **IDENTITY, key="k", lease=1)))
        assert entered.wait(WAIT)
        time.sleep(1.2)  # the late attempt's lease runs out
        assert run_once(prompt, **IDENTITY, key="k", lease=30) == "prompt"
        leave.set()
        with pytest.raises(InProgress):
            first.result(WAIT)
    assert list(Charge.objects.values_list("account", flat=True)) == ["prompt"]
    assert run_once(late, **IDENTITY, key="k") == "prompt"


def _killed_inside(key: str, policy: str) -> None:
    env = server_env({})
    process = subprocess.run(
        [sys.executable, "-m", "tests.once_worker", key, policy],
        cwd=ROOT,
        env=env,
        timeout=WAIT,
        capture_output=True,
        text=True,
    )
    assert process.returncode == -9, process.stderr


@postgres_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_a_process_killed_inside_the_callable(policy):
    _killed_inside("m-1", policy)
    assert Charge.objects.count() == 0  # the killed attempt's own writes never committed
    (call,) = ProviderCall.objects.all()  # but its external effect happened
    record = IdempotencyRecord.objects.get()
    assert record.status == RecordStatus.IN_PROGRESS
    calls: list[int] = []
    keys: list[str] = []

    def ship_again() -> str:
        context = current()
        assert context is not None
        keys.append(context.downstream_key("provider"))
        calls.append(1)
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        return "shipped"

    with pytest.raises(InProgress):
        run_once(ship_again, **IDENTITY, key="m-1", recovery=policy)  # the lease still runs
    expire_lease(record)  # the dead process's lease runs out, without waiting for it
    if policy == "retry":
        assert run_once(ship_again, **IDENTITY, key="m-1", recovery=policy) == "shipped"
        assert keys == [call.key]  # the provider sees the same key and can deduplicate
        assert Charge.objects.count() == 1
        assert run_once(ship_again, **IDENTITY, key="m-1", recovery=policy) == "shipped"
        assert calls == [1]
    else:
        for _ in range(2):
            with pytest.raises(OutcomeUnknown):
                run_once(ship_again, **IDENTITY, key="m-1", recovery=policy)
        assert calls == []
        assert Charge.objects.count() == 0
        assert IdempotencyRecord.objects.get().status == RecordStatus.FAILED


def test_run_once_inside_an_outer_transaction_commits_with_it():
    calls: list[int] = []

    def caller() -> None:
        with transaction.atomic():
            run_once(ship, 1, **IDENTITY, key="k", calls=calls)
            raise RuntimeError("the caller's transaction rolls back")

    with pytest.raises(RuntimeError):
        caller()
    assert calls == [1]
    # The claim and the completion rolled back with the caller: nothing is left.
    assert not IdempotencyRecord.objects.exists()
    assert Charge.objects.count() == 0


def test_a_recovery_callable_decides_for_a_stale_record():
    stale_record("k", policy="retry")
    asked: list[str] = []

    def ask_provider(record: IdempotencyRecord) -> dict[str, str]:
        asked.append(record.key)
        return {"shipped": "per provider"}

    calls: list[int] = []
    assert run_once(ship, 1, **IDENTITY, key="k", recovery=ask_provider, calls=calls) == {
        "shipped": "per provider"
    }
    assert run_once(ship, 1, **IDENTITY, key="k", recovery=ask_provider, calls=calls) == {
        "shipped": "per provider"
    }
    assert asked == ["k"]
    assert calls == []


def test_run_once_result_tells_a_replay_from_a_first_run():
    calls: list[int] = []
    first = django_idempotency.run_once_result(ship, 3, **IDENTITY, key="r-1", calls=calls)
    again = django_idempotency.run_once_result(ship, 3, **IDENTITY, key="r-1", calls=calls)
    assert (first.value, first.replayed) == ({"shipped": 3, "note": ""}, False)
    assert (again.value, again.replayed) == ({"shipped": 3, "note": ""}, True)
    assert calls == [3]
    assert Charge.objects.count() == 1
    # The same rules and exceptions as run_once.
    with pytest.raises(KeyReused):
        django_idempotency.run_once_result(
            ship, 3, **IDENTITY, key="r-1", fingerprint="other", calls=calls
        )
    assert calls == [3]


def test_run_once_result_after_a_recovery_callable_is_not_a_replay():
    stale_record("r-2", "tests.test_run_once.decided")
    once = {**IDENTITY, "key": "r-2", "recovery": decided}
    result = django_idempotency.run_once_result(ship, 1, **once, calls=[])
    assert (result.value, result.replayed) == ({"decided": True}, False)
    assert Charge.objects.count() == 0
    again = django_idempotency.run_once_result(ship, 1, **once, calls=[])
    assert (again.value, again.replayed) == ({"decided": True}, True)


def decided(record: IdempotencyRecord) -> dict[str, bool]:
    return {"decided": True}


def test_a_result_nested_past_the_recursion_limit_is_a_type_error_and_nothing_commits():
    def deep(write: bool) -> list[Any]:
        if write:
            Charge.objects.create(account="consumer", amount=1, currency="EUR")
        return nested_past_json()

    with pytest.raises(TypeError, match="JSON"):
        run_once(deep, True, **IDENTITY, key="deep")
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()  # released: the next call runs afresh
    # Under "resume" the body's result is stored by its own transaction: the same TypeError.
    with pytest.raises(TypeError, match="JSON"):
        run_once(deep, False, **IDENTITY, key="deep-resumed", recovery="resume")
    assert IdempotencyRecord.objects.get().status == RecordStatus.IN_PROGRESS


@pytest.mark.parametrize(
    ("error", "attributes"),
    [
        (InProgress("in progress", 7), {"retry_after": 7}),
        (django_idempotency.OutcomeTooLarge("too large", 10, 5), {"size": 10, "limit": 5}),
        (django_idempotency.StoreUnavailable("down", ran=True), {"ran": True}),
        (django_idempotency.RecordUnreadable("sealed", "k1"), {"key_id": "k1"}),
        (django_idempotency.TaskAlreadyQueued("queued", uuid.UUID(int=1)), {}),
    ],
)
def test_every_error_crosses_a_process_boundary_with_its_attributes(
    error: IdempotencyError, attributes: dict[str, Any]
):
    """Pickled (a process pool, a task result backend that pickles), as raised."""
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.args) == (type(error), str(error), error.args)
    assert vars(copy) == vars(error)
    for name, value in attributes.items():
        assert getattr(copy, name) == value
