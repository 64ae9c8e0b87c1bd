"""Recovery points: operations in steps (``recovery="resume"``), in-process.

Counting effects: local writes (``Charge``), external calls (a list outside every
transaction) and recorded steps. A crash is ``SimulatedCrash`` here;
``tests/test_steps_crash.py`` kills real processes
at every boundary.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.utils import timezone

from django_idempotency import InProgress, current, run_once, run_once_result, step
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.models import IdempotencyRecord, IdempotencyStep, RecordStatus
from tests.helpers import nested_past_json, postgres_only
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

WAIT = 20


def identity(**extra: Any) -> dict[str, Any]:
    return {"account": "consumer:steps", "operation": "steps.op", "key": "k-1", **extra}


def write(label: str) -> int:
    return Charge.objects.create(account=label, amount=1, currency="EUR").pk


#: External calls (outside every transaction, so they survive any rollback and any crash).
EXTERNAL: list[str] = []


@pytest.fixture(autouse=True)
def _external() -> Any:
    EXTERNAL.clear()
    yield
    EXTERNAL.clear()


def call(label: str) -> str:
    EXTERNAL.append(label)
    return label


def end_lease() -> None:
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def charges(label: str) -> int:
    return Charge.objects.filter(account=label).count()


def calls(label: str) -> int:
    return EXTERNAL.count(label)


def test_steps_run_once_and_the_result_is_replayed():
    def body() -> dict[str, Any]:
        ride = step("ride", write, "ride")
        sent = step("mail", call, "mail")
        return {"ride": ride, "mail": sent}

    first = run_once(body, **identity(recovery="resume"))
    assert run_once(body, **identity(recovery="resume")) == first
    assert (charges("ride"), calls("mail")) == (1, 1)
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    assert sorted(IdempotencyStep.objects.values_list("name", flat=True)) == ["mail", "ride"]


def test_a_crash_between_steps_resumes_after_the_last_recorded_one():
    crash = [True]

    def body() -> str:
        step("ride", write, "ride")
        step("mail", call, "mail")
        if crash.pop():
            raise SimulatedCrash
        step("receipt", call, "receipt")
        return "done"

    with pytest.raises(SimulatedCrash):
        run_once(body, **identity(recovery="resume"))
    crash.append(False)
    # The dead attempt's lease still runs: nobody else runs the operation meanwhile.
    with pytest.raises(InProgress):
        run_once(body, **identity(recovery="resume"))
    end_lease()
    assert run_once(body, **identity(recovery="resume")) == "done"
    assert (charges("ride"), calls("mail"), calls("receipt")) == (1, 1, 1)
    record = IdempotencyRecord.objects.get()
    assert record.recovery_attempts == 1
    assert record.status == RecordStatus.COMPLETED


def test_a_crash_inside_a_step_rolls_its_writes_back_and_runs_it_again():
    crash = [True]

    def ride_then_die() -> int:
        pk = write("ride")
        call("ride-call")
        if crash.pop():
            raise SimulatedCrash
        return pk

    def body() -> int:
        first = step("first", write, "first")
        step("ride", ride_then_die)
        return first

    with pytest.raises(SimulatedCrash):
        run_once(body, **identity(recovery="resume"))
    assert (charges("first"), charges("ride"), calls("ride-call")) == (1, 0, 1)
    crash.append(False)
    end_lease()
    run_once(body, **identity(recovery="resume"))
    # The step that was running ran again: its external call twice, its write once.
    assert (charges("first"), charges("ride"), calls("ride-call")) == (1, 1, 2)


def test_a_raising_step_keeps_the_earlier_ones_and_the_next_attempt_resumes_at_once():
    fail = [True]

    def flaky() -> str:
        write("flaky")
        if fail.pop():
            raise ConnectionError("the provider is down")
        return "ok"

    def body() -> str:
        step("ride", write, "ride")
        return step("flaky", flaky)

    with pytest.raises(ConnectionError):
        run_once(body, **identity(recovery="resume"))
    assert (charges("ride"), charges("flaky")) == (1, 0)
    assert IdempotencyRecord.objects.get().status == RecordStatus.IN_PROGRESS
    fail.append(False)
    # No wait for a lease: the failed attempt gave it back.
    assert run_once(body, **identity(recovery="resume")) == "ok"
    assert (charges("ride"), charges("flaky")) == (1, 1)


def test_step_outside_a_resumable_operation_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="resume"):
        step("ride", write, "ride")
    with pytest.raises(RuntimeError, match="resume"):
        run_once(lambda: step("ride", write, "ride"), **identity(recovery="retry"))
    assert charges("ride") == 0
    assert not IdempotencyRecord.objects.exists()  # the claim was released


def test_a_step_name_used_twice_is_a_value_error():
    def body() -> None:
        step("mail", call, "mail")
        step("mail", call, "mail")

    with pytest.raises(ValueError, match="twice"):
        run_once(body, **identity(recovery="resume"))
    assert calls("mail") == 1
    assert IdempotencyStep.objects.count() == 1


@pytest.mark.parametrize(
    "name", ["", None, "x" * 256, "a\x00b", 42, "line:\ud800", "ride ", " ride", "\tride"]
)
def test_a_step_name_must_be_a_short_string(name):
    with pytest.raises(ValueError, match="step name"):
        run_once(lambda: step(name, write, "ride"), **identity(recovery="resume"))
    assert charges("ride") == 0


def test_a_result_that_is_not_json_is_a_type_error_and_records_nothing():
    def body() -> None:
        step("ride", lambda: (write("ride"), object())[1])

    with pytest.raises(TypeError, match="JSON"):
        run_once(body, **identity(recovery="resume"))
    assert charges("ride") == 0  # the step's work rolled back with it
    assert not IdempotencyStep.objects.exists()


def test_steps_do_not_nest():
    with pytest.raises(RuntimeError, match="nest"):
        run_once(
            lambda: step("outer", lambda: step("inner", write, "x")), **identity(recovery="resume")
        )
    assert charges("x") == 0


def test_the_recorded_result_is_what_json_gives_back():
    from decimal import Decimal

    def body() -> Any:
        return step("values", lambda: {"amount": Decimal("12.50"), "ids": (1, 2)})

    first = run_once(body, **identity(recovery="resume"))
    assert first == {"amount": "12.50", "ids": [1, 2]}


def test_a_sub_operation_inside_a_step_cannot_record_into_the_outer_operation():
    def inner() -> None:
        step("inner", write, "inner")

    def body() -> None:
        step("outer", lambda: run_once(inner, **identity(key="k-2")))

    with pytest.raises(RuntimeError, match="resume"):
        run_once(body, **identity(recovery="resume"))
    assert charges("inner") == 0


def test_resume_inside_a_callers_transaction_is_refused(db):
    def attempt() -> None:
        with transaction.atomic():
            run_once(lambda: step("ride", write, "ride"), **identity(recovery="resume"))

    with pytest.raises(ImproperlyConfigured, match="resume"):
        attempt()
    assert charges("ride") == 0
    assert not IdempotencyRecord.objects.exists()


def test_an_expired_record_replaced_by_a_new_operation_starts_without_its_steps():
    run_once(lambda: step("ride", write, "ride"), **identity(recovery="resume", ttl=61))
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    run_once(lambda: step("ride", write, "ride"), **identity(recovery="resume", ttl=61))
    assert charges("ride") == 2
    assert IdempotencyStep.objects.count() == 1


def test_the_purge_removes_steps_with_their_record():
    from django_idempotency.maintenance import purge_expired

    run_once(lambda: step("ride", write, "ride"), **identity(recovery="resume", ttl=61))
    run_once(lambda: step("ride", write, "ride"), **identity(recovery="resume", key="k-2"))
    IdempotencyRecord.objects.filter(key="k-1").update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert purge_expired().deleted == 1
    assert list(IdempotencyStep.objects.values_list("record__key", flat=True)) == ["k-2"]


@postgres_only
def test_a_step_of_an_attempt_that_lost_its_lease_rolls_back():
    entered, leave = threading.Event(), threading.Event()
    outcome: list[Any] = []

    def slow() -> int:
        pk = write("slow")
        entered.set()
        assert leave.wait(WAIT)
        return pk

    def late() -> None:
        try:
            run_once(lambda: step("slow", slow), **identity(recovery="resume", lease=1))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    worker = threading.Thread(target=late)
    worker.start()
    assert entered.wait(WAIT)
    end_lease()
    # A takeover by the next attempt: it runs the step itself.
    run_once(lambda: step("slow", write, "prompt"), **identity(recovery="resume"))
    leave.set()
    worker.join(WAIT)
    assert not worker.is_alive()
    assert isinstance(outcome[0], InProgress)
    assert (charges("slow"), charges("prompt")) == (0, 1)
    assert IdempotencyStep.objects.count() == 1


def test_current_names_the_operation_inside_a_step():
    seen: list[str] = []

    def body() -> None:
        step("look", lambda: seen.append(current().downstream_key("x")))  # type: ignore[union-attr]

    run_once(body, **identity(recovery="resume"))
    assert len(seen) == 1


@postgres_only
def test_a_view_whose_step_outlived_its_lease_answers_409_and_rolls_the_step_back(user):
    from django.test import Client

    from tests.testapp import steps as slow

    slow.reset_slow()
    late, prompt = Client(), Client()
    late.force_login(user)
    prompt.cookies = late.cookies
    headers = {"Idempotency-Key": "ride-1"}
    answers: list[Any] = []

    def first() -> None:
        try:
            answers.append(late.post("/steps/slow/", {}, headers=headers))
        finally:
            connections.close_all()

    worker = threading.Thread(target=first)
    worker.start()
    try:
        assert slow.ENTERED.wait(WAIT)
        end_lease()
        taken_over = prompt.post("/steps/slow/", {}, headers=headers)
    finally:
        slow.RELEASE.set()
        worker.join(WAIT)
    assert not worker.is_alive()
    assert taken_over.status_code == 201
    (lost,) = answers
    assert lost.status_code == 409
    assert lost.json()["code"] == "idempotency_lease_lost"
    # The late attempt's step rolled back: one ride, the one the takeover recorded.
    assert list(Charge.objects.filter(account="slow").values_list("pk", flat=True)) == [
        taken_over.json()["ride"]
    ]
    assert prompt.post("/steps/slow/", {}, headers=headers).content == taken_over.content


def test_a_step_inside_a_transaction_the_body_opened_is_refused_before_it_runs():
    # A step inside the body's own transaction.atomic() would commit only with that
    # transaction: the process dying after the step returned (its mail sent) and before the
    # body's transaction committed loses the step's record, and the next attempt mails again.
    crash = [True, True]

    def body() -> str:
        with transaction.atomic():
            step("mail", call, "mail")
            if crash.pop():
                raise SimulatedCrash  # the process dies before the body's COMMIT
        return "sent"

    refused: list[BaseException] = []
    for _ in range(2):
        try:
            run_once(body, **identity(recovery="resume"))
        except (SimulatedCrash, RuntimeError) as exc:
            refused.append(exc)
        end_lease()
    assert calls("mail") == 0  # refused before the step ran, on every attempt
    assert [type(exc) for exc in refused] == [RuntimeError, RuntimeError]
    assert "transaction" in str(refused[0])
    assert not IdempotencyStep.objects.exists()
    assert IdempotencyRecord.objects.get().status == RecordStatus.IN_PROGRESS


def test_a_step_inside_a_transaction_of_a_decorator_beneath_idempotent_is_refused(user):
    from django.test import Client

    client = Client()
    client.force_login(user)
    with pytest.raises(RuntimeError, match="transaction"):
        client.post("/steps/atomic/", {}, headers={"Idempotency-Key": "atomic-1"})
    assert charges("ride") == 0
    assert not IdempotencyStep.objects.exists()


def test_a_step_that_rolls_its_own_work_back_is_recorded_and_not_run_again():
    # A step may undo its own writes (transaction.set_rollback(True)) and still answer, as
    # a body under "retry" may: that answer is the step's result. Recording it inside the
    # transaction marked for rollback failed ("store unavailable"), the lease was given
    # back, and every retry ran the step again: one more mail per retry, never an answer.
    def decline() -> str:
        write("declined")
        call("mail")
        transaction.set_rollback(True)
        return "declined"

    answers: list[Any] = []
    for _ in range(3):
        try:
            answers.append(run_once(lambda: step("decide", decline), **identity(recovery="resume")))
        except Exception as exc:
            answers.append(type(exc).__name__)
    assert calls("mail") == 1
    assert charges("declined") == 0  # the step's writes were rolled back, as it asked
    assert answers == ["declined", "declined", "declined"]
    assert list(IdempotencyStep.objects.values_list("name", "result")) == [("decide", '"declined"')]
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


def test_a_result_nested_past_the_recursion_limit_is_a_type_error_and_records_nothing():
    # json.dumps gives up with RecursionError, which no caller of step() (nor the contract:
    # "a result that cannot be stored as JSON is a TypeError") expects.
    def body() -> None:
        step("deep", lambda: (write("deep"), nested_past_json())[1])

    with pytest.raises(TypeError, match="JSON"):
        run_once(body, **identity(recovery="resume"))
    assert charges("deep") == 0
    assert not IdempotencyStep.objects.exists()


def race_resumers(key: str, racers: int) -> list[Any]:
    """Let the attempt of ``key`` die after its first step, then ``racers`` threads (each on
    a connection of its own) retry it at once; what each got."""
    crash = [True]

    def body() -> str:
        step("ride", call, "ride")
        if crash[0]:
            raise SimulatedCrash
        step("charge", call, "charge")
        step("receipt", call, "receipt")
        return "done"

    with pytest.raises(SimulatedCrash):
        run_once(body, **identity(key=key, recovery="resume"))
    crash[0] = False
    end_lease()
    start = threading.Barrier(racers, timeout=WAIT)
    outcomes: list[Any] = []

    def resume() -> None:
        try:
            start.wait()
            result = run_once_result(body, **identity(key=key, recovery="resume"))
            outcomes.append("replayed" if result.replayed else result.value)
        except InProgress:
            outcomes.append("in progress")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=resume) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert not any(thread.is_alive() for thread in threads)
    return outcomes


@postgres_only
def test_two_resumers_at_once_run_the_remaining_steps_once():
    # Attempts racing to resume one stale record: one takes the lease over and runs the
    # steps not recorded yet; the others are told the operation is in progress, or (once it
    # completed) get its result. Several rounds, each a new key.
    racers = 6
    for round_ in range(5):
        EXTERNAL.clear()
        key = f"race-{round_}"
        outcomes = race_resumers(key, racers)
        assert outcomes.count("done") == 1
        assert set(outcomes) <= {"done", "in progress", "replayed"}
        assert len(outcomes) == racers
        assert (calls("ride"), calls("charge"), calls("receipt")) == (1, 1, 1)
        record = IdempotencyRecord.objects.get(key=key)
        assert (record.status, record.recovery_attempts) == (RecordStatus.COMPLETED, 1)


def test_an_attempt_that_found_its_lease_lost_runs_no_further_step():
    # A body that goes on when a step fails (a receipt is not worth failing a booking for)
    # also swallows the LeaseLost of a step that found the record taken over. Its next step
    # ran its function all the same, beside the attempt that took the record over and runs
    # that step too: the SMS sent twice.
    def body() -> str:
        step("ride", write, "ride")
        # Another attempt takes the record over (its lease token is no longer this one's).
        IdempotencyRecord.objects.update(lease_token=uuid.uuid4())
        receipt = None
        try:
            receipt = step("receipt", call, "receipt")
        except Exception:
            receipt = "not sent"  # the receipt is best effort
        assert receipt == "not sent"
        step("sms", call, "sms")
        return "booked"

    with pytest.raises(InProgress):
        run_once(body, **identity(recovery="resume"))
    assert calls("receipt") == 1  # its function ran before the fence refused its record
    assert calls("sms") == 0  # the attempt had lost its lease: no further step runs
    assert list(IdempotencyStep.objects.values_list("name", flat=True)) == ["ride"]


def test_an_async_views_steps_run_once_through_sync_to_async(user):
    from django.test import Client

    from tests.testapp.models import ProviderCall

    client = Client()
    client.force_login(user)
    headers = {"Idempotency-Key": "async-1"}
    first = client.post("/steps/async/", {}, headers=headers)
    again = client.post("/steps/async/", {}, headers=headers)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert charges("ride") == 1
    assert ProviderCall.objects.filter(key__startswith="receipt:").count() == 1
    assert sorted(IdempotencyStep.objects.values_list("name", flat=True)) == ["receipt", "ride"]


def test_step_called_on_an_async_views_event_loop_is_refused_before_it_runs(user):
    from django.core.exceptions import SynchronousOnlyOperation
    from django.test import Client

    client = Client()
    client.force_login(user)
    with pytest.raises(SynchronousOnlyOperation):
        client.post("/steps/async-direct/", {}, headers={"Idempotency-Key": "async-2"})
    assert charges("ride") == 0
    assert not IdempotencyStep.objects.exists()
