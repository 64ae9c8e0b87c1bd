"""Every signal fires where documented, with the documented arguments; logs keep secrets out.

The logging rule: at INFO and above, the ``django_idempotency`` logger never writes a
request or response body, nor an idempotency key (a key is what lets a retry replay a
stored response).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.dispatch import Signal
from django.utils import timezone

from django_idempotency import maintenance, signals
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.factories import RecordFactory
from tests.helpers import make_in_progress, new_key
from tests.testapp.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

# Recognisable strings: if any of them shows up in a log line, the test names it.
SECRET_AMOUNT = 987654321
CHARGE = {"amount": SECRET_AMOUNT, "currency": "EUR", "note": "body-secret-7c1e"}
OPERATION = "POST charges/"

ALL_SIGNALS = {
    "record_claimed": signals.record_claimed,
    "response_replayed": signals.response_replayed,
    "request_conflicted": signals.request_conflicted,
    "payload_mismatched": signals.payload_mismatched,
    "lease_lost": signals.lease_lost,
    "lease_recovered": signals.lease_recovered,
    "records_purged": signals.records_purged,
}


class Sent:
    """Records every signal sent while it is active, by signal name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def named(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for sent, kwargs in self.calls if sent == name]

    def receiver(self, name: str):
        def receive(sender: Any, signal: Signal, **kwargs: Any) -> None:
            assert sender is IdempotencyRecord
            self.calls.append((name, kwargs))

        return receive


@pytest.fixture
def sent() -> Iterator[Sent]:
    recorder = Sent()
    receivers = {name: recorder.receiver(name) for name in ALL_SIGNALS}
    for name, signal in ALL_SIGNALS.items():
        signal.connect(receivers[name], dispatch_uid=f"test-{name}")
    yield recorder
    for name, signal in ALL_SIGNALS.items():
        signal.disconnect(dispatch_uid=f"test-{name}")


@pytest.fixture
def logs(caplog) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="django_idempotency")
    return caplog


def record_of(key: str) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(key=key)


def assert_about(kwargs: dict[str, Any], user: Any, key: str) -> None:
    """A request signal's arguments: who, what, which key, and the request itself."""
    assert (kwargs["account"], kwargs["operation"], kwargs["key"]) == (
        f"user:{user.pk}",
        OPERATION,
        key,
    )
    assert kwargs["request"].method == "POST"


def assert_nothing_secret_at_info(logs: pytest.LogCaptureFixture, *keys: str) -> None:
    secrets = (*keys, str(SECRET_AMOUNT), CHARGE["note"])
    for record in logs.records:
        if record.levelno < logging.INFO or not record.name.startswith("django_idempotency"):
            continue
        text = record.getMessage()
        if record.exc_info:
            text += logging.Formatter().formatException(record.exc_info)
        for secret in secrets:
            assert secret not in text, f"{record.levelname} log line holds {secret!r}: {text}"


# -- one test per signal, through real requests ----------------------------------------


def test_record_claimed(api, user, sent, logs):
    key = new_key()
    assert api.post("/charges/", CHARGE, key=key).status_code == 201
    (claimed,) = sent.named("record_claimed")
    assert_about(claimed, user, key)
    assert claimed["takeover"] is False
    assert_nothing_secret_at_info(logs, key)


class ReceiverFailed(Exception):
    """A ``record_claimed`` receiver's own failure."""


@pytest.mark.parametrize("path", ["/charges/", "/charges/fail-policy/"])
def test_a_record_claimed_receiver_that_raises_leaves_no_claim_behind(api, path):
    """The receiver runs after the claim and before the view: when it raises, the view never
    ran, so the claim is released (under ``"fail"`` too, where a claim left to its lease
    would be replayed as an unknown outcome for good) and the retry runs the view."""

    def broken(sender: Any, **kwargs: Any) -> None:
        raise ReceiverFailed("the metrics backend is down")

    key = new_key()
    signals.record_claimed.connect(broken, weak=False)
    try:
        with pytest.raises(ReceiverFailed):
            api.post(path, CHARGE, key=key)
    finally:
        signals.record_claimed.disconnect(broken)
    assert ProviderCall.objects.using("provider").count() == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    retried = api.post(path, CHARGE, key=key)
    assert retried.status_code == 201, retried.content
    assert ProviderCall.objects.using("provider").count() == 1


def test_a_record_claimed_receiver_that_raises_on_a_takeover_keeps_the_stale_record(api):
    """On a takeover of a stale lease the crashed attempt may have run: the record stays for
    its recovery policy (``"fail"``: the outcome unknown), never released."""

    def broken(sender: Any, **kwargs: Any) -> None:
        raise ReceiverFailed("the metrics backend is down")

    key = new_key()
    assert api.post("/charges/fail-policy/", CHARGE, key=key).status_code == 201
    make_in_progress(key, timedelta(seconds=-5))  # as a crashed attempt leaves it
    signals.record_claimed.connect(broken, weak=False)
    try:
        with pytest.raises(ReceiverFailed):
            api.post("/charges/fail-policy/", CHARGE, key=key)
    finally:
        signals.record_claimed.disconnect(broken)
    assert IdempotencyRecord.objects.get(key=key).status == RecordStatus.IN_PROGRESS
    retried = api.post("/charges/fail-policy/", CHARGE, key=key)
    assert retried.json()["code"] == "idempotency_outcome_unknown", retried.content
    assert ProviderCall.objects.using("provider").count() == 1  # the first request's alone


def test_response_replayed(api, user, sent, logs):
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    assert api.post("/charges/", CHARGE, key=key).status_code == 201
    (replayed,) = sent.named("response_replayed")
    assert replayed["status"] == 201
    assert_about(replayed, user, key)
    assert_nothing_secret_at_info(logs, key)


def test_request_conflicted(api, user, sent, logs):
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    make_in_progress(key, lease_left=timedelta(seconds=30))
    assert api.post("/charges/", CHARGE, key=key).status_code == 409
    (conflicted,) = sent.named("request_conflicted")
    assert_about(conflicted, user, key)
    assert_nothing_secret_at_info(logs, key)


def test_payload_mismatched(api, user, sent, logs):
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    assert api.post("/charges/", {**CHARGE, "amount": 1}, key=key).status_code == 422
    (mismatched,) = sent.named("payload_mismatched")
    assert_about(mismatched, user, key)
    assert_nothing_secret_at_info(logs, key)


def test_lease_lost(api, user, sent, logs):
    key = new_key()

    def take_over(sender: Any, key: str, **kwargs: Any) -> None:
        # Another attempt takes the lease over while this one runs the view.
        IdempotencyRecord.objects.filter(key=key).update(lease_token=uuid.uuid4())

    signals.record_claimed.connect(take_over, dispatch_uid="test-take-over")
    try:
        assert api.post("/charges/", CHARGE, key=key).status_code == 409
    finally:
        signals.record_claimed.disconnect(dispatch_uid="test-take-over")
    (lost,) = sent.named("lease_lost")
    assert_about(lost, user, key)
    assert [r.levelname for r in logs.records if "lease lost" in r.getMessage()] == ["WARNING"]
    assert_nothing_secret_at_info(logs, key)


def test_lease_recovered_on_a_retry(api, user, sent, logs):
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    make_in_progress(key, lease_left=-timedelta(seconds=5))
    assert api.post("/charges/", CHARGE, key=key).status_code == 201
    claimed = sent.named("record_claimed")
    assert [c["takeover"] for c in claimed] == [False, True]
    (recovered,) = sent.named("lease_recovered")
    assert recovered == {
        "account": f"user:{user.pk}",
        "operation": OPERATION,
        "key": key,
        "policy": "retry",
        "outcome": "retried",
    }
    assert_nothing_secret_at_info(logs, key)


def test_lease_recovered_by_the_recovery_job(sent, logs):
    record = RecordFactory(
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=timezone.now() - timedelta(seconds=5),
        recovery_policy="fail",
    )
    maintenance.recover_stale_leases()
    (recovered,) = sent.named("lease_recovered")
    assert recovered["policy"] == "fail"
    assert recovered["outcome"] == "failed"
    assert recovered["key"] == record.key
    assert "request" not in recovered
    assert_nothing_secret_at_info(logs, record.key)


def test_a_failing_recovery_policy_is_logged_without_the_key(logs):
    record = RecordFactory(
        key="key-secret-51ab",
        status=RecordStatus.IN_PROGRESS,
        lease_token=uuid.uuid4(),
        lease_expires_at=timezone.now() - timedelta(seconds=5),
        recovery_policy="tests.testapp.views.no_such_policy",
    )
    assert maintenance.recover_stale_leases().errors == 1
    assert any(r.levelno >= logging.ERROR for r in logs.records)
    assert_nothing_secret_at_info(logs, record.key)


def test_records_purged(sent):
    now = timezone.now()
    RecordFactory.create_batch(3, expires_at=now - timedelta(hours=1))
    RecordFactory()
    maintenance.purge_expired()
    (purged,) = sent.named("records_purged")
    assert purged == {"count": 3, "audit": 0, "outbox": 0}


def test_a_dry_run_purge_sends_nothing(sent):
    RecordFactory(expires_at=timezone.now() - timedelta(hours=1))
    maintenance.purge_expired(dry_run=True)
    assert sent.named("records_purged") == []


def test_signals_are_documented_with_their_arguments():
    # signals.py says, in each signal's docstring (the API reference renders it), when it
    # fires and with which arguments.
    import inspect

    source = inspect.getsource(signals)
    definitions = {}
    for name in ALL_SIGNALS:
        found = re.search(rf"\n{name} = Signal\((use_caching=True)?\)\n", source)
        assert found, name
        definitions[name] = found.group(0)
    docstring_after = {
        name: source.split(definitions[name])[1].split('"""')[:3] for name in ALL_SIGNALS
    }
    for name, (before, docstring, _after) in docstring_after.items():
        assert before == "", name
        assert "Arguments:" in docstring, name
