"""The outbox against what breaks it: backoff settings at their limits, senders that fail in
every way, stored arguments that cannot be read back, text a JSON column cannot hold, and a
long-running relay that meets all of it.

Sends are counted by the senders of ``tests.testapp.outbox`` (one ``ProviderCall`` row per
send), never inferred from a status.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency import checks, outbox, signals
from django_idempotency._validation import MAX_DURATION, MAX_INT
from django_idempotency.models import OutboxMessage, OutboxStatus
from tests.factories import store_raw_json
from tests.helpers import postgres_only
from tests.live import ROOT, finished, server_env, starting_a_server
from tests.testapp.models import ProviderCall
from tests.testapp.outbox import BROKEN, FAILURES, SWALLOWS_QUERY_ERROR, sends

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

RECORD = {"OUTBOX_SENDER": "tests.testapp.outbox.record"}
# The settings of the report: a day's first backoff, a week's ceiling, a hundred attempts.
# 1 day * 2**30 is more than a timedelta can hold, so the 31st failure overflowed.
LONG_BACKOFF = {
    **RECORD,
    "OUTBOX_BACKOFF": timedelta(days=1),
    "OUTBOX_BACKOFF_MAX": timedelta(days=7),
    "OUTBOX_MAX_ATTEMPTS": 100,
}
TIMEOUT = 30  # seconds: a bound on every wait for a relay process


def enqueued(task: str = "tests.a", *args: Any, **kwargs: Any) -> uuid.UUID:
    with transaction.atomic():
        return outbox.enqueue(task, *args, **kwargs)


def message(message_id: uuid.UUID) -> OutboxMessage:
    return OutboxMessage.objects.get(pk=message_id)


def nested(depth: int) -> list[Any]:
    """A list nested ``depth`` levels deep: ``[[[...]]]``."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def check_ids(**entries: Any) -> list[str]:
    with override_settings(IDEMPOTENCY=entries):
        return [str(m.id) for m in checks.check_settings()]


def storable(text: str) -> bool:
    """Whether every database's text column takes ``text`` (no NUL, no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


# -- the backoff and its settings ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "longest"),
    [
        (timedelta(days=1), timedelta(days=7)),
        (timedelta(seconds=1), timedelta(minutes=5)),
        (timedelta(microseconds=1), MAX_DURATION),
        (MAX_DURATION, MAX_DURATION),
    ],
    ids=["report", "defaults", "shortest-first-longest-ceiling", "longest-both"],
)
def test_backoff_is_capped_without_overflow_for_every_admitted_setting(first, longest):
    entries = {
        "OUTBOX_BACKOFF": first,
        "OUTBOX_BACKOFF_MAX": longest,
        "OUTBOX_MAX_ATTEMPTS": MAX_INT,
    }
    assert check_ids(**entries) == []
    attempts = [*range(0, 300), 1024, 10**6, MAX_INT - 1, MAX_INT]
    with override_settings(IDEMPOTENCY=entries):
        waits = [outbox.backoff(n) for n in attempts]
    now, unit = timezone.now(), timedelta(microseconds=1)
    for n, wait in zip(attempts, waits, strict=True):
        # The exact doubling in whole microseconds, while it can still be below the ceiling.
        exact = first // unit << max(n - 1, 0) if n < 64 else longest // unit
        assert wait // unit == min(exact, longest // unit), n
        assert now + wait > now  # a datetime every database stores
    assert waits == sorted(waits)


def test_the_check_admits_the_longest_backoff_and_refuses_one_microsecond_more():
    longest = {"OUTBOX_BACKOFF": MAX_DURATION, "OUTBOX_BACKOFF_MAX": MAX_DURATION}
    assert check_ids(**longest, OUTBOX_MAX_ATTEMPTS=MAX_INT) == []
    beyond = MAX_DURATION + timedelta(microseconds=1)
    assert check_ids(OUTBOX_BACKOFF_MAX=beyond) == ["django_idempotency.E035"]
    assert check_ids(OUTBOX_BACKOFF=beyond, OUTBOX_BACKOFF_MAX=beyond) == [
        "django_idempotency.E034",
        "django_idempotency.E035",
    ]
    assert check_ids(OUTBOX_BACKOFF_MAX=1e300) == ["django_idempotency.E035"]
    assert check_ids(OUTBOX_MAX_ATTEMPTS=MAX_INT + 1) == ["django_idempotency.E031"]
    assert check_ids(OUTBOX_MAX_ATTEMPTS=10**100) == ["django_idempotency.E031"]


@override_settings(IDEMPOTENCY=LONG_BACKOFF)
def test_a_31st_failure_is_recorded_and_the_rest_of_its_batch_is_sent():
    first, broken, last = enqueued("tests.a", 1), enqueued(BROKEN), enqueued("tests.b", 2)
    OutboxMessage.objects.filter(pk=broken).update(attempts=30)
    started = timezone.now()
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (2, 1, 0)
    assert (sends(first), sends(last), sends(broken)) == (1, 1, 0)
    row = message(broken)
    assert (row.status, row.attempts) == (OutboxStatus.PENDING, 31)
    assert row.last_error == "ConnectionError: the broker is down"
    assert started + timedelta(days=7) <= row.available_at <= timezone.now() + timedelta(days=7)
    # Its 100th failure makes it dead; nothing else is sent twice.
    OutboxMessage.objects.filter(pk=broken).update(attempts=99, available_at=timezone.now())
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (0, 0, 1)
    assert (message(broken).status, message(broken).attempts) == (OutboxStatus.DEAD, 100)
    assert (sends(first), sends(last), sends(broken)) == (1, 1, 0)


# -- senders that fail in every way ---------------------------------------------------------------


# The class each failure is recorded under (a failed query: the database's own error).
ERROR_CLASSES = {
    "tests.fails.nul_in_error": "ConnectionError: ",
    "tests.fails.unprintable_error": "UnprintableError ",
    "tests.fails.key_error": "KeyError: 'topic'",
    "tests.fails.recursion_error": "RecursionError: ",
    "tests.fails.overflow_error": "OverflowError: ",
    "tests.fails.failed_query": ("ProgrammingError: ", "OperationalError: "),
    "tests.fails.long_error": "ConnectionError: xxx",
    "tests.fails.timeout_not_an_exception": "SendTimeout: 5 seconds",
    "tests.fails.cancelled": "CancelledError: the send was cancelled",
}


@pytest.mark.parametrize("task", sorted(FAILURES))
@override_settings(IDEMPOTENCY=RECORD)
def test_any_exception_from_the_sender_is_recorded_and_the_rest_of_the_batch_is_sent(task):
    before, failing, after = enqueued("tests.a", 1), enqueued(task), enqueued("tests.b", 2)
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (2, 1, 0)
    assert (sends(before), sends(failing), sends(after)) == (1, 0, 1)
    for sent in (before, after):
        assert message(sent).status == OutboxStatus.SENT
    row = message(failing)
    assert (row.status, row.attempts) == (OutboxStatus.PENDING, 1)
    assert storable(row.last_error)
    assert row.last_error.startswith(ERROR_CLASSES[task])
    assert len(row.last_error) <= outbox.MAX_ERROR_CHARS
    assert row.available_at > timezone.now()
    # Nothing is sent again by the next run.
    assert outbox.relay(once=True).sent == 0
    assert (sends(before), sends(after)) == (1, 1)


@override_settings(IDEMPOTENCY=RECORD)
def test_a_sender_that_swallows_its_own_failed_query_fails_only_its_own_send():
    before, swallowing, after = (
        enqueued("tests.a", 1),
        enqueued(SWALLOWS_QUERY_ERROR),
        enqueued("tests.b", 2),
    )
    result = outbox.relay(once=True)
    assert (sends(before), sends(swallowing), sends(after)) == (1, 1, 1)
    assert (message(before).status, message(after).status) == (OutboxStatus.SENT,) * 2
    row = message(swallowing)
    if connection.vendor == "postgresql":
        # Its failed query aborted the transaction: the send cannot be recorded as done, so
        # it counts as failed and is sent again after the backoff (at least once).
        assert (result.sent, result.failed) == (2, 1)
        assert (row.status, row.attempts) == (OutboxStatus.PENDING, 1)
        assert row.last_error.startswith("InternalError: ")
    else:
        # Elsewhere a failed statement leaves the transaction usable.
        assert (result.sent, result.failed) == (3, 0)
        assert row.status == OutboxStatus.SENT


@override_settings(IDEMPOTENCY=RECORD)
def test_an_error_text_a_column_cannot_hold_is_stored_escaped():
    failing = enqueued("tests.fails.nul_in_error")
    assert outbox.relay(once=True).failed == 1
    assert message(failing).last_error == (
        "ConnectionError: the broker said \\x00 then \\ud800 then \U0001f600"
    )


@override_settings(IDEMPOTENCY=RECORD)
def test_an_error_whose_text_cannot_be_read_is_recorded_by_its_class():
    failing = enqueued("tests.fails.unprintable_error")
    assert outbox.relay(once=True).failed == 1
    assert message(failing).last_error == "UnprintableError (its text could not be read)"


# -- stored arguments that cannot be read back ----------------------------------------------------


# JSON every database takes that Python cannot decode, or not as arguments.
UNREADABLE = {
    # Deeper than Python's recursion limit; MariaDB refuses more than 31 levels itself.
    "nested-1500-deep": ("args", "[" * 1500 + "]" * 1500),
    # Decodable, but deeper than a sender's own serializer could go again.
    "nested-600-deep": ("kwargs", '{"a": ' + "[" * 599 + "]" * 599 + "}"),
    "a-5000-digit-number": ("args", "[" + "9" * 5000 + "]"),
    "args-not-a-list": ("args", '{"a": 1}'),
    "kwargs-not-an-object": ("kwargs", "[1, 2]"),
}


@pytest.mark.parametrize(("column", "text"), list(UNREADABLE.values()), ids=list(UNREADABLE))
@override_settings(IDEMPOTENCY=RECORD)
def test_a_message_whose_stored_arguments_cannot_be_read_is_dead_and_the_rest_are_sent(
    column, text
):
    if connection.vendor == "mysql" and "[" * 32 in text:
        pytest.skip("MariaDB's JSON columns refuse more than 31 levels of nesting")
    before, unreadable, after = enqueued("tests.a", 1), enqueued("tests.c"), enqueued("tests.b")
    store_raw_json(OutboxMessage, unreadable, column, text)
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (2, 0, 1)
    assert (sends(before), sends(unreadable), sends(after)) == (1, 0, 1)
    row = OutboxMessage.objects.defer("args", "kwargs").get(pk=unreadable)
    assert (row.status, row.attempts) == (OutboxStatus.DEAD, 1)
    assert row.last_error.startswith(f"Unreadable: the stored {column} ")


# -- enqueue refuses what a JSON column cannot hold --------------------------------------------


UNSTORABLE: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "nul-in-a-string": (("a\x00b",), {}),
    "nul-in-a-key": (({"k\x00": 1},), {}),
    "nul-in-a-keyword-name": ((), {"a\x00": 1}),
    "nul-deep-inside": (([{"a": ["fine", "x\x00"]}],), {}),
    "lone-high-surrogate": (("\ud800",), {}),
    "lone-low-surrogate-in-a-key": (({"\udfff": 1},), {}),
    "int-beyond-64-bits": ((2**64,), {}),
    "int-below-minus-2-63": ((-(2**63) - 1,), {}),
    "a-5000-digit-int": ((10**5000,), {}),
    "32-levels": ((nested(31),), {}),
    "30000-levels": ((nested(30000),), {}),
    "kwargs-32-levels": ((), {"a": nested(31)}),
    "infinity": ((math.inf,), {}),
    "nan-inside": (({"a": [math.nan]},), {}),
}


@pytest.mark.parametrize(("args", "kwargs"), list(UNSTORABLE.values()), ids=list(UNSTORABLE))
def test_unstorable_arguments_raise_type_error_before_any_sql_and_the_transaction_goes_on(
    args, kwargs
):
    with transaction.atomic():
        ProviderCall.objects.create(key="before")
        with CaptureQueriesContext(connection) as queries, pytest.raises(TypeError):
            outbox.enqueue("tests.a", *args, **kwargs)
        assert len(queries) == 0
        ProviderCall.objects.create(key="after")
        enqueued_after = outbox.enqueue("tests.a", "fine")
    assert sorted(ProviderCall.objects.values_list("key", flat=True)) == ["after", "before"]
    assert list(OutboxMessage.objects.values_list("pk", flat=True)) == [enqueued_after]


# Made when the test runs (hundreds of megabytes): arguments PostgreSQL's jsonb refuses.
TOO_LARGE_FOR_JSONB: dict[str, Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "a string of 2**28 bytes": lambda: (("x" * 2**28,), {}),
    "a keyword argument of 2**28 bytes": lambda: ((), {"body": "é" * 2**27}),
    "a list whose strings take 2**28 bytes": lambda: ((["x" * 2**20] * 256,), {}),
    "a list of 2**24 + 1 items": lambda: (([0] * (2**24 + 1),), {}),
}


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="jsonb's limits; the check is the same code on every database, and these values "
    "take gigabytes to build and encode: one of the suite's parallel runs makes them",
)
@pytest.mark.timeout(600)  # hundreds of megabytes encoded on a loaded machine
@pytest.mark.parametrize("make", list(TOO_LARGE_FOR_JSONB.values()), ids=list(TOO_LARGE_FOR_JSONB))
def test_arguments_too_large_for_jsonb_raise_type_error_before_any_sql(make):
    # PostgreSQL refused them (OperationalError: "string too long to represent as jsonb
    # string", "invalid memory alloc request size") and aborted the caller's transaction;
    # the other databases stored them. Refused alike everywhere (the check runs before any
    # SQL, whatever the database), as the other limits are.
    args, kwargs = make()
    with transaction.atomic():
        ProviderCall.objects.create(key="before")
        with CaptureQueriesContext(connection) as queries, pytest.raises(TypeError):
            outbox.enqueue("tests.a", *args, **kwargs)
        assert len(queries) == 0
        del args, kwargs
        ProviderCall.objects.create(key="after")
        enqueued_after = outbox.enqueue("tests.a", "fine")
    assert sorted(ProviderCall.objects.values_list("key", flat=True)) == ["after", "before"]
    assert list(OutboxMessage.objects.values_list("pk", flat=True)) == [enqueued_after]


@pytest.mark.skipif(
    connection.vendor == "mysql", reason="past MariaDB's max_allowed_packet, refused there"
)
@pytest.mark.parametrize(
    "args",
    [
        # Past the text that is not walked (2**25 characters), well within jsonb's limits.
        pytest.param(("x" * 2**25,), id="a string of 2**25 bytes"),
        pytest.param((["é" * 2**19, 0.5, 1, [None]] * 32,), id="32 MB in a list"),
    ],
)
def test_large_arguments_within_jsonb_are_stored_unchanged(args):
    with transaction.atomic():
        message_id = outbox.enqueue("tests.a", *args)
    stored = message(message_id)
    assert stored.args == list(args)


@pytest.mark.parametrize("name", ["tests.a\x00", "tests.\ud800", "\x00"])
def test_a_task_name_a_column_cannot_hold_raises_type_error_before_any_sql(name):
    with transaction.atomic():
        ProviderCall.objects.create(key="before")
        with CaptureQueriesContext(connection) as queries, pytest.raises(TypeError):
            outbox.enqueue(name)
        assert len(queries) == 0
        ProviderCall.objects.create(key="after")
    assert ProviderCall.objects.count() == 2
    assert not OutboxMessage.objects.exists()


@pytest.mark.parametrize("spelled", ["tests.a ", " tests.a", "tests.a\t", "tests.a\u3000"])
def test_a_task_name_with_whitespace_at_an_end_is_refused_before_any_sql(spelled):
    """MariaDB's collations ignore trailing spaces: there ``tests.a `` and ``tests.a`` would
    hold one key of ``enqueue_once`` (the second enqueue answering the first task's message),
    elsewhere two. Such a name is refused everywhere, as a step's name is."""
    held = timedelta(hours=1)
    with transaction.atomic():
        first = outbox.enqueue_once("k-1", "tests.a", unique_until=held)
        with (
            CaptureQueriesContext(connection) as queries,
            pytest.raises(ValueError, match="whitespace"),
        ):
            outbox.enqueue_once("k-1", spelled, unique_until=held)
        with pytest.raises(ValueError, match="whitespace"):
            outbox.enqueue(spelled)
        assert len(queries) == 0
    assert list(OutboxMessage.objects.values_list("pk", "task")) == [(first, "tests.a")]


# At the limits, and stored exactly: what the consumer receives is what enqueue() was given.
STORABLE: dict[str, Any] = {
    "largest-unsigned-64-bit-int": 2**64 - 1,
    "smallest-signed-64-bit-int": -(2**63),
    "31-levels-with-the-args-list": nested(30),
    "four-byte-utf-8": "\U0001f600 caf\u00e9",
    "a-backslash-u-0000-as-text": "\\u0000",
    "a-surrogate-pair-escaped-by-json": json.loads('"\\ud83d\\ude00"'),
    "mixed": {"id": 7, "tags": ["a", "b"], "price": 1.5, "none": None, "ok": True},
}


@pytest.mark.parametrize("value", list(STORABLE.values()), ids=list(STORABLE))
@override_settings(IDEMPOTENCY=RECORD)
def test_storable_arguments_at_the_limits_are_stored_exactly_and_sent(value):
    message_id = enqueued("tests.a", value, named=value)
    row = message(message_id)
    assert (row.args, row.kwargs) == ([value], {"named": value})
    assert outbox.relay(once=True).sent == 1
    assert sends(message_id) == 1


# -- a relay that keeps going -------------------------------------------------------------------


class InjectedFault(Exception):
    """What a faulty receiver of ``outbox_relayed`` raises: nothing the relay foresaw."""


@override_settings(IDEMPOTENCY={**RECORD, "OUTBOX_BATCH_SIZE": 1})
def test_a_relay_that_hits_an_unexpected_error_logs_it_counts_it_and_goes_on(caplog):
    first, second = enqueued("tests.a", 1), enqueued("tests.b", 2)
    faults: list[int] = []
    failures: list[BaseException] = []

    def faulty_receiver(**kwargs: Any) -> None:
        if not faults:
            faults.append(1)
            raise InjectedFault("a receiver of outbox_relayed failed")

    def counted(**kwargs: Any) -> None:
        failures.append(kwargs["error"])

    signals.outbox_relayed.connect(faulty_receiver, dispatch_uid="test-faulty-receiver")
    signals.outbox_relay_failed.connect(counted, dispatch_uid="test-relay-failed")
    deadline = time.monotonic() + TIMEOUT
    try:
        with caplog.at_level(logging.ERROR, logger="django_idempotency"):
            result = outbox.relay(
                listen=False,
                poll_interval=0.05,
                stop=lambda: sends(second) == 1 or time.monotonic() > deadline,
            )
    finally:
        signals.outbox_relayed.disconnect(dispatch_uid="test-faulty-receiver")
        signals.outbox_relay_failed.disconnect(dispatch_uid="test-relay-failed")
    assert (sends(first), sends(second)) == (1, 1)
    assert (result.sent, result.errors) == (2, 1)
    assert [type(error) for error in failures] == [InjectedFault]
    assert "the outbox relay hit an unexpected error" in caplog.text


@override_settings(IDEMPOTENCY=RECORD)
def test_relay_once_raises_an_unexpected_error_and_counts_it_in_the_metrics():
    prometheus_client = pytest.importorskip("prometheus_client")
    first = enqueued("tests.a", 1)

    def faulty_receiver(**kwargs: Any) -> None:
        raise InjectedFault("a receiver of outbox_relayed failed")

    def errors_counted() -> float:
        value = prometheus_client.REGISTRY.get_sample_value(
            "django_idempotency_outbox_relay_errors_total"
        )
        return value or 0.0

    before = errors_counted()
    signals.outbox_relayed.connect(faulty_receiver, dispatch_uid="test-faulty-receiver")
    try:
        with pytest.raises(InjectedFault):
            outbox.relay(once=True)
    finally:
        signals.outbox_relayed.disconnect(dispatch_uid="test-faulty-receiver")
    assert errors_counted() - before == 1.0
    # The batch had committed before its receiver raised: sent once, never again.
    assert (sends(first), message(first).status) == (1, OutboxStatus.SENT)
    assert outbox.relay(once=True).sent == 0
    assert sends(first) == 1


def wait_for(condition: Callable[[], object], what: str, process: subprocess.Popen[str]) -> None:
    """Poll ``condition`` until it holds; fail at once if the relay ended, or after a while."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if condition():
            return
        if process.poll() is not None:
            _out, err = process.communicate(timeout=10)
            raise AssertionError(f"the relay exited ({process.returncode}) before {what}:\n{err}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {TIMEOUT} s waiting for {what}")


@contextmanager
def relay_process(
    settings: dict[str, Any], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``relay_outbox`` (no ``--once``) in a process of its own, on the test database; killed
    if the block fails."""
    pytest.importorskip("celery", reason="the relay process loads the tests' Celery app")
    starting_a_server("a relay process")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.outbox_proc", "relay", json.dumps(settings)],
        cwd=ROOT,
        env=server_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield process
    except BaseException:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=10)
        raise


def stopped(process: subprocess.Popen[str]) -> str:
    """SIGTERM, then its output once it exited 0 (killed, and the test failed, after a while)."""
    process.send_signal(signal.SIGTERM)
    return finished(process, TIMEOUT)


@pytest.mark.servers
@postgres_only  # a relay process shares the test database
def test_a_long_running_relay_meets_a_31st_failure_and_keeps_sending():
    first, broken, last = enqueued("tests.a", 1), enqueued(BROKEN), enqueued("tests.b", 2)
    OutboxMessage.objects.filter(pk=broken).update(attempts=30)
    settings = {
        **RECORD,
        "OUTBOX_BACKOFF": 86400,
        "OUTBOX_BACKOFF_MAX": 7 * 86400,
        "OUTBOX_MAX_ATTEMPTS": 100,
        "OUTBOX_POLL_INTERVAL": 0.2,
    }
    with relay_process(settings) as process:
        wait_for(lambda: sends(first) + sends(last) == 2, "the healthy messages were sent", process)
        wait_for(lambda: message(broken).attempts == 31, "the failure was recorded", process)
        later = enqueued("tests.c", 3)
        wait_for(lambda: sends(later) == 1, "a message enqueued later was sent", process)
        out = stopped(process)
    assert out.strip() == "Sent 3 outbox messages; 1 failed (to be retried), 0 dead."
    assert (sends(first), sends(last), sends(later), sends(broken)) == (1, 1, 1, 0)
    assert message(broken).status == OutboxStatus.PENDING


@pytest.mark.servers
@postgres_only  # a relay process shares the test database
def test_a_long_running_relay_survives_an_unexpected_error_and_keeps_sending(tmp_path: Path):
    fault = tmp_path / "fault"
    fault.touch()  # the first batch's receiver raises
    first = enqueued("tests.a", 1)
    settings = {**RECORD, "OUTBOX_POLL_INTERVAL": 0.2}
    with relay_process(settings, {"OUTBOX_FAULT_FILE": str(fault)}) as process:
        wait_for(lambda: not fault.exists(), "the fault", process)
        assert sends(first) == 1
        second = enqueued("tests.b", 2)
        wait_for(lambda: sends(second) == 1, "a message enqueued after the fault", process)
        # Once more: errors do not add up to a stop.
        fault.touch()
        third = enqueued("tests.c", 3)
        wait_for(lambda: not fault.exists(), "the second fault", process)
        fourth = enqueued("tests.d", 4)
        wait_for(lambda: sends(fourth) == 1, "a message enqueued after the second fault", process)
        out = stopped(process)
    assert out.strip() == "Sent 4 outbox messages; 0 failed (to be retried), 0 dead; 2 errors."
    assert [sends(m) for m in (first, second, third, fourth)] == [1, 1, 1, 1]
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {OutboxStatus.SENT}
