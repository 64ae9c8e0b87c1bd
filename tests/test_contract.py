"""The ★ sections of the design, statement by statement, through the public surface only:
Django's test client, ``call_command`` and the documented imports. Every test counts the
side effects (charges written, records stored), never only the status."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord
from tests.helpers import ApiClient, make_in_progress, needs_drf, new_key
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CHARGE = {"amount": 100, "currency": "EUR"}


def problem(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert body["status"] == status
    assert body["code"] == code
    assert {"type", "title", "detail"} <= set(body)
    return body


# -- ★ HTTP semantics: key syntax ----------------------------------------------------------


PRINTABLE = "".join(chr(c) for c in range(0x21, 0x7F))


@pytest.mark.parametrize(
    "key",
    [
        "k",
        "x" * 255,
    ],
)
def test_every_key_of_1_to_255_printable_ascii_characters_is_a_key(api, key):
    first = api.post("/charges/", CHARGE, key=key)
    assert first.status_code == 201, first.content
    again = api.post("/charges/", CHARGE, key=key)
    assert again.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().key == key


@pytest.mark.parametrize("key", ["", "x" * 256, "a b", "caf\u00e9", "tab\there", "del\x7f", '""'])
def test_a_malformed_key_is_400_invalid_and_nothing_runs(api, key):
    answer = api.post("/charges/", CHARGE, key=key)
    problem(answer, 400, "idempotency_key_invalid")
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


def test_a_structured_field_string_is_the_same_key_as_the_bare_one(api):
    key = new_key()
    first = api.post("/charges/", CHARGE, key=key)
    again = api.post("/charges/", CHARGE, key=f'"{key}"')
    assert again.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_a_structured_field_string_of_255_characters_is_a_key(api):
    key = "y" * 255
    first = api.post("/charges/", CHARGE, key=f'"{key}"')
    assert first.status_code == 201, first.content
    again = api.post("/charges/", CHARGE, key=key)
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_a_missing_key_is_400_missing_and_nothing_runs(api):
    problem(api.post("/charges/", CHARGE), 400, "idempotency_key_missing")
    problem(api.patch("/charges/", CHARGE), 400, "idempotency_key_missing")
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


# -- ★ HTTP semantics: the table ---------------------------------------------------------


def test_replay_and_mismatch_and_in_progress(api):
    key = new_key()
    first = api.post("/charges/", CHARGE, key=key)
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first
    again = api.post("/charges/", {"currency": "EUR", "amount": 100}, key=key)
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert again["Content-Type"] == first["Content-Type"]
    assert again["Location"] == first["Location"]
    assert again["Idempotent-Replayed"] == "true"
    other = api.post("/charges/", {"amount": 101, "currency": "EUR"}, key=key)
    body = problem(other, 422, "idempotency_key_reused")
    assert all(body[member] for member in ("type", "title", "detail"))
    assert Charge.objects.count() == 1


def test_untouched_methods_need_no_key_and_store_nothing(api):
    key = new_key()
    for method in ("get", "head", "options", "put", "delete"):
        for headers in ({"Idempotency-Key": key}, {}, {"Idempotency-Key": ""}):
            answer = getattr(api.client, method)("/charges/", headers=headers)
            # the view's own answer (its own 400 for a body it cannot read), never ours
            assert answer.get("Content-Type") != "application/problem+json", method
            assert "Idempotent-Replayed" not in answer
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.parametrize("status", [500, 502, 503, 409, 429])
def test_transient_and_5xx_outcomes_are_not_stored(api, status):
    key = new_key()
    payload = {"status": status, "body": "no"}
    first = api.post("/outcome/", payload, key=key)
    assert first.status_code == status
    assert IdempotencyRecord.objects.count() == 0
    assert Charge.objects.count() == 0  # rolled back with the claim
    again = api.post("/outcome/", payload, key=key)
    assert again.status_code == status
    assert "Idempotent-Replayed" not in again


@pytest.mark.parametrize("status", [200, 201, 204, 302, 400, 402, 404, 410, 422])
def test_outcomes_below_500_are_stored_and_replayed(api, status):
    key = new_key()
    payload = {"status": status, "body": "" if status == 204 else "kept"}
    first = api.post("/outcome/", payload, key=key)
    again = api.post("/outcome/", payload, key=key)
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_set_cookie_and_date_are_never_replayed(api):
    key = new_key()
    payload = {"cookie": True, "headers": {"Date": "Mon, 01 Jan 2024 00:00:00 GMT"}}
    first = api.post("/outcome/", payload, key=key)
    assert first.cookies
    again = api.post("/outcome/", payload, key=key)
    assert again["Idempotent-Replayed"] == "true"
    assert "session-ish" not in again.cookies
    assert again.get("Date") != "Mon, 01 Jan 2024 00:00:00 GMT"
    assert Charge.objects.count() == 1


def test_a_retry_after_the_ttl_runs_again(api):
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    again = api.post("/charges/", CHARGE, key=key)
    assert again.status_code == 201
    assert "Idempotent-Replayed" not in again
    assert Charge.objects.count() == 2


def test_in_progress_is_409_with_retry_after(api):
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    make_in_progress(key, timedelta(seconds=30))
    answer = api.post("/charges/", CHARGE, key=key)
    problem(answer, 409, "idempotency_key_in_use")
    assert 1 <= int(answer["Retry-After"]) <= 30
    assert Charge.objects.count() == 1


# -- ★ Public API: settings -------------------------------------------------------------


def test_the_header_setting_names_the_header(user):
    api = ApiClient(user)
    with override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"}):
        problem(api.post("/charges/", CHARGE, key=new_key()), 400, "idempotency_key_missing")
        key = new_key()
        first = api.post("/charges/", CHARGE, headers={"X-Request-Key": key})
        again = api.post("/charges/", CHARGE, headers={"X-Request-Key": key})
    assert first.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_required_false_lets_a_request_without_key_run(user):
    api = ApiClient(user)
    with override_settings(IDEMPOTENCY={"REQUIRED": False}):
        assert api.post("/charges/", CHARGE).status_code == 201
        assert api.post("/charges/", CHARGE).status_code == 201
    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 0


def test_ttl_and_lease_defaults(api):
    before = timezone.now()
    api.post("/charges/", CHARGE, key=new_key())
    record = IdempotencyRecord.objects.get()
    assert (
        timedelta(hours=23, minutes=59)
        < record.expires_at - before
        <= timedelta(hours=24, seconds=5)
    )
    assert {f.name for f in IdempotencyRecord._meta.get_fields()} >= {
        "account",
        "operation",
        "key",
        "request_hash",
        "status",
        "response_status",
        "response_headers",
        "response_body",
        "lease_expires_at",
        "expires_at",
        "created_at",
    }


# -- ★ Management commands -----------------------------------------------------------


def test_purge_options(api):
    for _ in range(3):
        api.post("/charges/", CHARGE, key=new_key())
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    out = StringIO()
    call_command("purge_idempotency", "--dry-run", stdout=out)
    assert IdempotencyRecord.objects.count() == 3
    out = StringIO()
    call_command("purge_idempotency", "--batch-size", "1", "--max-batches", "2", stdout=out)
    assert IdempotencyRecord.objects.count() == 1
    call_command("purge_idempotency", stdout=StringIO())
    assert IdempotencyRecord.objects.count() == 0


@needs_drf
def test_public_names_import():
    from django_idempotency import (  # noqa: F401
        IdempotencyError,
        InProgress,
        KeyReused,
        OutcomeUnknown,
        RecordUnreadable,
        StoreUnavailable,
        TaskAlreadyQueued,
        current,
        run_once,
        step,
    )
    from django_idempotency.decorators import idempotent  # noqa: F401
    from django_idempotency.drf import IdempotencyMixin  # noqa: F401
    from django_idempotency.outbox import enqueue, enqueue_once  # noqa: F401
    from django_idempotency.sources import fixed, form, header  # noqa: F401
    from django_idempotency.sources import json as json_source  # noqa: F401
    from django_idempotency.tasks import (  # noqa: F401
        purge_expired,
        recover_stale_leases,
        relay_outbox,
    )
    from django_idempotency.tasks_backend import OutboxBackend  # noqa: F401

    for name in (
        "InProgress",
        "KeyReused",
        "OutcomeUnknown",
        "RecordUnreadable",
        "StoreUnavailable",
        "TaskAlreadyQueued",
    ):
        import django_idempotency

        assert issubclass(getattr(django_idempotency, name), IdempotencyError)
    assert purge_expired.name.startswith("django_idempotency.")


# Every character of 0x21-0x7E is a key's, ',' included: the ★ table names the malformed
# keys (empty, over 255 characters, outside printable ASCII) and no other.
@pytest.mark.parametrize("key", [PRINTABLE, "a,b", "order:42,line:7", ",", "a,"])
def test_a_key_holding_a_comma_is_a_key(api, key):
    first = api.post("/charges/", CHARGE, key=key)
    assert first.status_code == 201, first.content
    again = api.post("/charges/", CHARGE, key=key)
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().key == key


def test_one_key_repeated_and_comma_joined_is_refused(api):
    """What a server makes of a header sent twice (``k`` and ``k`` arrive as ``k,k``): not a
    new key, which would run a retry again."""
    key = new_key()
    assert api.post("/charges/", CHARGE, key=key).status_code == 201
    problem(api.post("/charges/", CHARGE, key=f"{key},{key}"), 400, "idempotency_key_invalid")
    problem(api.post("/charges/", CHARGE, key=f"{key},{key},{key}"), 400, "idempotency_key_invalid")
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.count() == 1


# -- ★ Public API: settings fail loudly ---------------------------------------------------

WRONG_SETTINGS = [
    ("HEADER", None),
    ("HEADER", ""),
    ("HEADER", 42),
    ("HEADER", ["Idempotency-Key"]),
    ("REQUIRED", None),
    ("REQUIRED", "yes"),
    ("REQUIRED", 1),
    ("TTL", None),
    ("TTL", 0),
    ("TTL", -5),
    ("TTL", True),
    ("TTL", timedelta(0)),
    ("TTL", timedelta(seconds=-1)),
    ("TTL", "24h"),
    ("LEASE", None),
    ("LEASE", False),
    ("LEASE", timedelta(0)),
    ("LEASE", "60"),
    ("METHODS", "POST"),
    ("METHODS", "POST,PATCH"),
    ("METHODS", None),
    ("METHODS", ["GET"]),
    ("METHODS", [1]),
    ("METHODS", []),
    ("TRANSIENT_STATUSES", 409),
    ("TRANSIENT_STATUSES", "409"),
    ("TRANSIENT_STATUSES", None),
    ("TRANSIENT_STATUSES", [True]),
    ("TRANSIENT_STATUSES", [200]),
    ("RECOVERY", "Fail"),
    ("RECOVERY", None),
    ("RECOVERY", 1),
    ("DATABASE", "nope"),
    ("DATABASE", None),
    ("REPLAY_HEADERS", "X-Trace"),
    ("REPLAY_HEADERS", ["Set-Cookie"]),
    ("REPLAY_HEADERS", None),
    ("MAX_RESPONSE_BYTES", 0),
    ("MAX_RESPONSE_BYTES", True),
    ("MAX_RESPONSE_BYTES", "1MB"),
    ("IN_PROGRESS_WAIT", None),
    ("IN_PROGRESS_WAIT", -1),
    ("IN_PROGRESS_WAIT", True),
    ("RETRY_AFTER", 0),
    ("RETRY_AFTER", True),
    ("RETRY_AFTER_MAX", 0),
    ("PURGE_BATCH_SIZE", 0),
    ("PURGE_BATCH_SIZE", None),
    ("PURGE_BATCH_SIZE", True),
    ("PURGE_MAX_BATCHES", 0),
    ("ACCOUNT_RESOLVER", None),
    ("ACCOUNT_RESOLVER", "no.such.module.resolver"),
    ("ACCOUNT_RESOLVER", 42),
    ("FINGERPRINT", None),
    ("FINGERPRINT", "no.such.fingerprint"),
    ("AUDIT", "yes"),
    ("AUDIT_RETENTION", 0),
    ("ENCRYPTION_KEYS", "not-a-key"),
    ("ENCRYPTION_KEYS", ["not-a-key"]),
    ("CLAIM_DATABASE", "nope"),
    ("CLAIM_TIMEOUT", 0),
    ("OUTBOX_MAX_ATTEMPTS", 0),
    ("OUTBOX_MAX_ATTEMPTS", True),
    ("OUTBOX_RETENTION", None),
    ("OUTBOX_BATCH_SIZE", "100"),
    ("OUTBOX_BACKOFF", -1),
    ("OUTBOX_BACKOFF_MAX", 0),
    ("OUTBOX_POLL_INTERVAL", False),
    ("OUTBOX_SENDER", "no.such.sender"),
    ("OUTBOX_SENDER", None),
]


@pytest.mark.parametrize(("name", "value"), WRONG_SETTINGS)
def test_a_wrong_setting_is_a_check_error_of_its_own_id(name, value):
    from django.core import checks

    from django_idempotency import _check_ids

    with override_settings(IDEMPOTENCY={name: value}):
        errors = [m for m in checks.run_checks() if m.id.startswith("django_idempotency.")]
        assert _check_ids.error(name) in {m.id for m in errors}, errors
        assert all(m.level >= checks.ERROR for m in errors if m.id == _check_ids.error(name))
        with pytest.raises(SystemCheckError):
            call_command("check", stdout=StringIO(), stderr=StringIO())


def test_two_settings_never_share_an_id():
    from django_idempotency import _check_ids, conf

    ids = [setting.id for setting in conf.SETTINGS]
    assert len(ids) == len(set(ids))
    assert set(conf.DEFAULTS) == {s.name for s in conf.SETTINGS}
    assert len(_check_ids.ERRORS.values()) == len(set(_check_ids.ERRORS.values()))


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("ttl", 0),
        ("ttl", -1),
        ("ttl", True),
        ("ttl", timedelta(0)),
        ("ttl", "1h"),
        ("lease", False),
        ("lease", timedelta(seconds=-1)),
        ("recovery", "Fail"),
        ("recovery", 3),
        ("required", "yes"),
        ("methods", "POST"),
        ("methods", ["GET"]),
        ("operation", 42),
        ("operation", ""),
        ("account", 42),
        ("fingerprint", 42),
        ("key", 42),
    ],
)
def test_a_wrong_decorator_argument_is_refused_where_it_is_written(argument, value):
    from django.core.exceptions import ImproperlyConfigured

    from django_idempotency.decorators import idempotent

    with pytest.raises(ImproperlyConfigured):

        @idempotent(**{argument: value})
        def view(request):  # pragma: no cover - never decorated
            raise AssertionError


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("ttl", 0),
        ("ttl", -1),
        ("ttl", True),
        ("lease", timedelta(0)),
        ("recovery", "Fail"),
        ("recovery", 3),
    ],
)
def test_run_once_refuses_a_wrong_argument_before_it_runs(argument, value):
    from django.core.exceptions import ImproperlyConfigured

    from django_idempotency import run_once

    calls: list[int] = []
    with pytest.raises(ImproperlyConfigured):
        run_once(calls.append, 1, account="a", operation="o", key="k", **{argument: value})
    assert calls == []
    assert IdempotencyRecord.objects.count() == 0


# -- ★ Any code path: run_once ----------------------------------------------------------


def _once(func, *args, key="k", **options):
    from django_idempotency import run_once

    return run_once(func, *args, account="consumer:t", operation="t.op", key=key, **options)


def test_run_once_runs_once_and_returns_the_stored_result():
    from django_idempotency import current

    calls = []

    def ship(order_id, *, note):
        ctx = current()
        calls.append((ctx.key, ctx.operation, ctx.account, ctx.replayed))
        Charge.objects.create(account="t", amount=order_id, currency="EUR")
        return {"order": order_id, "note": note, "tuple": (1, 2)}

    first = _once(ship, 7, note="n", ttl=timedelta(days=7))
    again = _once(ship, 7, note="n")
    assert first == {"order": 7, "note": "n", "tuple": (1, 2)}
    assert again == {"order": 7, "note": "n", "tuple": [1, 2]}  # what json.loads gives back
    assert calls == [("k", "t.op", "consumer:t", False)]
    assert Charge.objects.count() == 1
    assert current() is None
    record = IdempotencyRecord.objects.get()
    assert timedelta(days=6, hours=23) < record.expires_at - timezone.now() <= timedelta(days=7)


def test_run_once_a_result_json_cannot_hold_is_type_error_and_nothing_commits():
    calls = []

    def work():
        calls.append(1)
        Charge.objects.create(account="t", amount=1, currency="EUR")
        return object()

    with pytest.raises(TypeError):
        _once(work)
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0
    assert _once(lambda: 5) == 5  # released: the key runs afresh


def test_run_once_an_exception_rolls_back_releases_and_propagates():
    def work():
        Charge.objects.create(account="t", amount=1, currency="EUR")
        raise LookupError("boom")

    with pytest.raises(LookupError):
        _once(work)
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


def test_run_once_in_progress_carries_the_lease_left_rounded_up():
    from django_idempotency import IdempotencyError, InProgress

    _once(lambda: 1)
    IdempotencyRecord.objects.update(
        status="in_progress",
        lease_expires_at=timezone.now() + timedelta(seconds=12, milliseconds=300),
    )
    calls: list[object] = []
    with pytest.raises(InProgress) as caught:
        _once(calls.append, 1)
    assert isinstance(caught.value, IdempotencyError)
    assert type(caught.value.retry_after) is int
    assert caught.value.retry_after in (13, 12)  # the seconds left, rounded up
    assert caught.value.retry_after >= 1
    assert calls == []


def test_run_once_fingerprint_mismatch_is_key_reused():
    from django_idempotency import IdempotencyError, KeyReused

    calls: list[object] = []
    _once(calls.append, 1, fingerprint={"b": 2, "a": 1})
    assert _once(calls.append, 1, fingerprint={"a": 1, "b": 2}) is None
    with pytest.raises(KeyReused) as caught:
        _once(calls.append, 1, fingerprint={"a": 2})
    assert isinstance(caught.value, IdempotencyError)
    assert calls == [1]


def test_run_once_under_fail_after_a_crash_is_outcome_unknown():
    from django_idempotency import IdempotencyError, OutcomeUnknown
    from django_idempotency.testing import crash, expect_crash

    def dies():
        crash()

    with expect_crash():
        _once(dies, recovery="fail", lease=timedelta(seconds=30))
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    calls: list[object] = []
    with pytest.raises(OutcomeUnknown) as caught:
        _once(calls.append, 1, recovery="fail")
    assert isinstance(caught.value, IdempotencyError)
    with pytest.raises(OutcomeUnknown):
        _once(calls.append, 1, recovery="fail")
    assert calls == []


def test_step_outside_resume_and_a_name_used_twice():
    from django_idempotency import step

    with pytest.raises(RuntimeError):
        step("a", lambda: 1)

    def body():
        step("a", lambda: 1)
        step("a", lambda: 2)

    with pytest.raises(ValueError, match=r".*"):
        _once(body, recovery="resume")


@pytest.mark.parametrize(
    ("account", "operation"),
    [("a\x00b", "op"), ("a", "o\x00p"), ("a" * 256, "op"), ("a", "o" * 300)],
)
def test_names_that_do_not_fit_never_share_a_record(account, operation):
    from django_idempotency import run_once

    calls: list[object] = []
    try:
        run_once(calls.append, 1, account=account, operation=operation, key="k")
    except ValueError:
        assert calls == []
        assert IdempotencyRecord.objects.count() == 0
        return
    # stored in a form no other name produces: the spelled transformed form is another record
    stored = IdempotencyRecord.objects.get()
    run_once(calls.append, 2, account=stored.account, operation=stored.operation, key="k")
    run_once(calls.append, 3, account=account, operation=operation, key="k")
    assert calls == [1, 2]


# -- ★ Where the key comes from -----------------------------------------------------------


def _event(body):
    from django.test import Client

    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return Client().post("/sources/json/", raw, content_type="application/json")


@pytest.mark.urls("tests.testapp.source_urls")
@pytest.mark.parametrize(
    ("object_id", "key"),
    [("evt_1", "evt_1"), (123456789012345678901234567890, "123456789012345678901234567890")],
)
def test_a_json_source_takes_a_string_as_it_is_and_an_integer_as_its_decimal_string(object_id, key):
    body = {"data": {"object": {"id": object_id}}}
    first = _event(body)
    assert first.status_code < 300, first.content
    again = _event(body)
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert list(IdempotencyRecord.objects.values_list("account", "key")) == [("sender:json", key)]
    assert Charge.objects.count() == 1


@pytest.mark.urls("tests.testapp.source_urls")
@pytest.mark.parametrize(
    "body",
    [
        {"data": {"object": {"id": True}}},
        {"data": {"object": {"id": 1.5}}},
        {"data": {"object": {"id": None}}},
        {"data": {"object": {"id": {"x": 1}}}},
        {"data": {"object": {"id": ["a"]}}},
        {"data": {"object": {"id": ""}}},
        {"data": {"object": {"id": "a b"}}},
        {"data": {"object": {"id": "x" * 256}}},
        b"not json",
    ],
)
def test_a_json_source_with_another_value_or_no_json_is_400_invalid(body):
    answer = _event(body)
    problem(answer, 400, "idempotency_key_invalid")
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.urls("tests.testapp.source_urls")
def test_a_json_source_without_the_member_is_a_missing_key():
    problem(_event({"data": {}}), 400, "idempotency_key_missing")
    problem(_event({"data": {"object": "x"}}), 400, "idempotency_key_missing")
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.urls("tests.testapp.source_urls")
def test_a_double_submitted_form_runs_once(user):
    client = ApiClient(user).client
    first = client.post("/sources/form/", {"idempotency_key": "form-1", "item": "a"})
    again = client.post("/sources/form/", {"item": "a", "idempotency_key": "form-1"})
    assert first.status_code < 400, first.content
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert IdempotencyRecord.objects.count() == 1


# -- ★ Failing closed, ★ Stored responses protected at rest ---------------------------------


def _fernet() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


def test_an_outcome_no_configured_key_opens_is_503_unreadable_and_never_runs_again(user):
    pytest.importorskip("cryptography")
    api = ApiClient(user)
    first_key, other_key, key = _fernet(), _fernet(), new_key()
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [first_key]}):
        first = api.post("/charges/", CHARGE, key=key)
    assert first.status_code == 201
    assert IdempotencyRecord.objects.get().response_body != first.content
    for keys in ([other_key], []):
        with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": keys}):
            answer = api.post("/charges/", CHARGE, key=key)
        body = problem(answer, 503, "idempotency_record_unreadable")
        assert int(answer["Retry-After"]) >= 1
        assert first_key not in answer.content.decode()
        assert "ENCRYPTION_KEYS" not in body["detail"]
    assert Charge.objects.count() == 1
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [other_key, first_key]}):
        again = api.post("/charges/", CHARGE, key=key)
        assert again.content == first.content
        assert again["Idempotent-Replayed"] == "true"
        call_command("rotate_idempotency_encryption", "--batch-size", "1", stdout=StringIO())
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [other_key]}):
        assert api.post("/charges/", CHARGE, key=key).content == first.content
    assert Charge.objects.count() == 1


def test_an_unreachable_store_is_503_and_nothing_runs(anon_api, unreachable_store):
    from tests.testapp.models import ProviderCall

    answer = anon_api.post("/charges/tenant/", CHARGE, key=new_key(), headers={"X-Tenant": "t"})
    body = problem(answer, 503, "idempotency_store_unavailable")
    assert int(answer["Retry-After"]) >= 1
    assert "not run" in body["detail"]
    assert ProviderCall.objects.using("provider").count() == 0  # the view never ran


def test_the_stored_body_is_shown_only_with_its_permission(user, admin_client):
    from django.contrib.auth.models import Permission

    from tests.helpers import logged_in

    api = ApiClient(user)
    api.post("/charges/", {"amount": 4242, "currency": "XBT"}, key=new_key())
    record = IdempotencyRecord.objects.get()
    url = f"/admin/django_idempotency/idempotencyrecord/{record.pk}/change/"
    user.is_staff = True
    user.save()
    user.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    without = logged_in(user).get(url)
    assert without.status_code == 200
    # The page's CSRF tokens are random letters and digits, which may spell XBT.
    page, tokens = re.subn(rb'name="csrfmiddlewaretoken" value="[^"]*"', b"", without.content)
    assert tokens  # what is taken out is the tokens, and only them
    assert b"XBT" not in page
    assert b"application/json" in without.content  # its content type
    assert str(len(record.response_body)).encode() in without.content  # and its size
    user.user_permissions.add(Permission.objects.get(codename="view_response_body"))
    with_it = logged_in(user).get(url)
    assert b"XBT" in with_it.content
    listing = admin_client.get(
        "/admin/django_idempotency/idempotencyrecord/", {"q": record.key, "status": "completed"}
    )
    assert listing.status_code == 200
    assert record.key.encode() in listing.content
    assert admin_client.post(
        "/admin/django_idempotency/idempotencyrecord/add/", {}
    ).status_code in (403, 404)


# -- ★ Fingerprint ----------------------------------------------------------------------


def test_the_fingerprint_ignores_json_spelling_query_order_and_transport_headers(api):
    key = new_key()
    first = api.post("/charges/?a=1&b=2", b'{"amount":100,"currency":"EUR"}', key=key)
    assert first.status_code == 201
    same = api.post(
        "/charges/?b=2&a=1",
        b'{ "currency" : "EUR",\n  "amount": 100 }',
        key=key,
        headers={"User-Agent": "other/1.0", "traceparent": "00-abc-def-01", "Date": "now"},
    )
    assert same["Idempotent-Replayed"] == "true"
    assert same.content == first.content
    problem(api.post("/charges/?a=1&b=3", CHARGE, key=key), 422, "idempotency_key_reused")
    problem(
        api.post("/charges/?a=1&b=2", {**CHARGE, "extra": None}, key=key),
        422,
        "idempotency_key_reused",
    )
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().request_hash  # with the algorithm's version


def test_the_fingerprint_covers_url_kwargs(api):
    key = new_key()
    assert api.post("/charges/1/items/", CHARGE, key=key).status_code == 201
    problem(api.post("/charges/2/items/", CHARGE, key=key), 422, "idempotency_key_reused")
    assert Charge.objects.count() == 1


def test_a_form_is_its_sorted_pairs_and_a_file_its_content(user):
    from django.core.files.uploadedfile import SimpleUploadedFile

    client = ApiClient(user).client
    key = new_key()

    def upload(content: bytes, order: int, name: str = "a.txt"):
        fields = [("note", "x"), ("tag", "y")]
        data: dict[str, object] = dict(fields if order else reversed(fields))
        data["file"] = SimpleUploadedFile(name, content)
        return client.post("/uploads/", data, headers={"Idempotency-Key": key})

    first = upload(b"one", 0)
    assert first.status_code < 300, first.content
    again = upload(b"one", 1)
    assert again["Idempotent-Replayed"] == "true"
    problem(upload(b"two", 0), 422, "idempotency_key_reused")


# -- ★ One live task per key, ★ Transactional outbox -------------------------------------------


def test_enqueue_once_returns_the_live_message_or_raises_and_writes_nothing():
    pytest.importorskip("celery")
    from django.db import transaction

    from django_idempotency import IdempotencyError, TaskAlreadyQueued
    from django_idempotency.models import OutboxMessage
    from django_idempotency.outbox import enqueue_once
    from tests.testapp.tasks import record_effect

    with transaction.atomic():
        first = enqueue_once("nightly", record_effect, "a")
        assert enqueue_once("nightly", record_effect, "b") == first
    with transaction.atomic(), pytest.raises(TaskAlreadyQueued) as caught:
        enqueue_once("nightly", record_effect, "c", on_conflict="raise")
    assert isinstance(caught.value, IdempotencyError)
    assert caught.value.message_id == first
    assert list(OutboxMessage.objects.values_list("id", "args")) == [(first, ["a"])]
    with transaction.atomic():  # another task's key space
        other = enqueue_once(
            "nightly", "tests.record_effect_by_tag", "d", unique_until=timedelta(1)
        )
    assert other != first
    # the key argument is the first positional one: a task's own "key" argument passes through
    with transaction.atomic():
        mid = enqueue_once("k2", "tests.record_effect_by_tag", unique_until=timedelta(1), key=1)
    assert OutboxMessage.objects.get(id=mid).kwargs == {"key": 1}


def test_an_enqueue_once_rolled_back_frees_the_key():
    from django.db import transaction

    from django_idempotency.models import OutboxMessage
    from django_idempotency.outbox import enqueue_once

    def rolled_back() -> None:
        with transaction.atomic():
            enqueue_once("once", "tests.record_effect_by_tag", "a", unique_until=timedelta(1))
            raise LookupError

    with pytest.raises(LookupError):
        rolled_back()
    with transaction.atomic():
        kept = enqueue_once("once", "tests.record_effect_by_tag", "b", unique_until=timedelta(1))
    assert list(OutboxMessage.objects.values_list("id", flat=True)) == [kept]


def test_enqueue_outside_a_transaction_and_unstorable_arguments():
    from django.db import transaction
    from django.db.transaction import TransactionManagementError

    from django_idempotency.models import OutboxMessage
    from django_idempotency.outbox import enqueue

    with pytest.raises(TransactionManagementError):
        enqueue("tests.record_effect", "a")
    with transaction.atomic():
        for bad in (object(), "nul\x00", "\ud800"):
            with pytest.raises(TypeError):
                enqueue("tests.record_effect", bad)
        message_id = enqueue("tests.record_effect", "ok")
    assert list(OutboxMessage.objects.values_list("id", "status")) == [(message_id, "pending")]
    out = StringIO()
    with override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.record"}):
        call_command("relay_outbox", "--once", "--batch-size", "5", stdout=out)
    assert OutboxMessage.objects.get().status == "sent"
    assert "1" in out.getvalue()


# -- ★ Identity of a record ----------------------------------------------------------------


def test_the_default_account_is_the_users_and_keys_never_cross_callers(user, other_user):
    key = new_key()
    mine = ApiClient(user).post("/charges/", CHARGE, key=key)
    theirs = ApiClient(other_user).post("/charges/", CHARGE, key=key)
    assert mine.status_code == theirs.status_code == 201
    assert "Idempotent-Replayed" not in theirs
    assert mine.content != theirs.content
    assert Charge.objects.count() == 2
    assert sorted(IdempotencyRecord.objects.values_list("account", flat=True)) == sorted(
        [f"user:{user.pk}", f"user:{other_user.pk}"]
    )


@pytest.mark.parametrize("path", ["/charges/", pytest.param("/api/open-charges/", marks=needs_drf)])
def test_an_anonymous_caller_is_refused_with_a_problem(anon_api, path):
    answer = anon_api.post(path, CHARGE, key=new_key())
    assert 400 <= answer.status_code < 500
    assert answer["Content-Type"] == "application/problem+json"
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


@needs_drf
def test_drf_authentication_runs_before_the_claim(anon_api):
    answer = anon_api.post("/api/charges/", CHARGE, key=new_key())
    assert answer.status_code in (401, 403)
    assert answer["Content-Type"] != "application/problem+json"  # DRF's own refusal
    assert IdempotencyRecord.objects.count() == 0
    assert Charge.objects.count() == 0


@needs_drf
def test_a_viewset_operation_is_basename_dot_action(api):
    api.post("/api/charges/", CHARGE, key=new_key())
    assert IdempotencyRecord.objects.get().operation == "charge.create"


def test_an_in_flight_wait_is_bounded_by_its_setting(user):
    import time

    api = ApiClient(user)
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    make_in_progress(key, timedelta(seconds=30))
    with override_settings(IDEMPOTENCY={"IN_PROGRESS_WAIT": timedelta(seconds=1)}):
        started = time.monotonic()
        answer = api.post("/charges/", CHARGE, key=key)
        waited = time.monotonic() - started
    problem(answer, 409, "idempotency_key_in_use")
    assert 0.9 <= waited < 3
    started = time.monotonic()
    problem(api.post("/charges/", CHARGE, key=key), 409, "idempotency_key_in_use")
    assert time.monotonic() - started < 0.5  # default 0: no wait
    assert Charge.objects.count() == 1


def test_only_the_allow_listed_headers_are_replayed(user):
    api = ApiClient(user)
    payload = {"status": 201, "headers": {"X-Ledger": "L-1", "X-Other": "o", "Location": "/l/1"}}
    key = new_key()
    with override_settings(IDEMPOTENCY={"REPLAY_HEADERS": ["x-ledger"]}):
        first = api.post("/outcome/", payload, key=key)
        again = api.post("/outcome/", payload, key=key)
    assert again["Idempotent-Replayed"] == "true"
    assert again["X-Ledger"] == first["X-Ledger"] == "L-1"
    assert again["Location"] == "/l/1"
    assert again["Content-Type"] == first["Content-Type"]
    assert "X-Other" not in again
    assert Charge.objects.count() == 1


def test_an_exception_in_the_view_rolls_back_and_releases(api):
    key = new_key()
    for _ in range(2):
        with pytest.raises(RuntimeError):
            api.post("/outcome/", {"raise": True}, key=key)
        assert IdempotencyRecord.objects.count() == 0
        assert Charge.objects.count() == 0
    assert api.post("/outcome/", {"status": 200}, key=key).status_code == 200
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_step_inside_an_operation_not_under_resume_raises_runtime_error(policy):
    from django_idempotency import step

    calls: list[object] = []

    def body():
        return step("a", calls.append, 1)

    with pytest.raises(RuntimeError):
        _once(body, recovery=policy)
    assert calls == []
    assert IdempotencyRecord.objects.count() == 0


def test_a_resumable_operation_skips_its_recorded_steps_after_a_crash():
    from django_idempotency import step
    from django_idempotency.testing import crash, expect_crash

    calls: list[str] = []

    def counted(name: str, result: object) -> object:
        calls.append(name)
        return result

    def body(die: bool):
        first = step("one", counted, "one", {"n": 1})
        if die:
            crash()
        second = step("two", counted, "two", 2)
        return [first, second]

    with expect_crash():
        _once(body, True, recovery="resume", lease=timedelta(seconds=30))
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert _once(body, False, recovery="resume") == [{"n": 1}, 2]
    assert _once(body, False, recovery="resume") == [{"n": 1}, 2]
    assert calls == ["one", "two"]


# -- ★ Django's Tasks framework -------------------------------------------------------------


def test_a_task_enqueued_through_the_outbox_commits_with_the_transaction():
    from django.conf import settings
    from django.db import transaction
    from django.db.transaction import TransactionManagementError

    from django_idempotency.models import OutboxMessage

    if not settings.HAS_DJANGO_TASKS:
        pytest.skip("needs django.tasks (or the django-tasks backport) and django-tasks-db")
    from tests.testapp.tasks_framework import record_effect

    with pytest.raises(TransactionManagementError):
        record_effect.enqueue("outside")
    assert OutboxMessage.objects.count() == 0

    def rolled_back() -> None:
        with transaction.atomic():
            record_effect.enqueue("rolled-back")
            raise LookupError

    with pytest.raises(LookupError):
        rolled_back()
    assert OutboxMessage.objects.count() == 0
    with transaction.atomic():
        result = record_effect.enqueue("kept")
    message = OutboxMessage.objects.get()
    assert str(result.id) == str(message.id)
    assert message.status == "pending"


def an_account_that_is_not_a_string(request):
    return 42


def test_a_resolver_answering_no_string_is_a_500_problem_and_nothing_runs(user):
    api = ApiClient(user)
    resolver = "tests.test_contract.an_account_that_is_not_a_string"
    with override_settings(IDEMPOTENCY={"ACCOUNT_RESOLVER": resolver}):
        answer = api.post("/charges/", CHARGE, key=new_key())
    problem(answer, 500, "idempotency_account_invalid")
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.parametrize("name", ["a\x00b", "s" * 300])
def test_a_step_name_that_does_not_fit_never_shares_a_record(name):
    from django_idempotency import step

    calls: list[str] = []

    def body():
        one = step(name, calls.append, "long")
        two = step(name[:255] if len(name) > 255 else "a", calls.append, "short")
        return [one, two]

    try:
        _once(body, recovery="resume")
    except ValueError:
        assert calls == []
        return
    assert calls == ["long", "short"]


def test_an_attempt_whose_lease_was_taken_over_rolls_back_and_raises_in_progress():
    import uuid

    from django_idempotency import InProgress

    def taken_over():
        Charge.objects.create(account="t", amount=1, currency="EUR")
        # another attempt takes the record over while this one runs
        IdempotencyRecord.objects.update(lease_token=uuid.uuid4())
        return "done"

    with pytest.raises(InProgress) as caught:
        _once(taken_over)
    assert caught.value.retry_after >= 1
    assert Charge.objects.count() == 0


def test_check_database_reports_outcomes_sealed_with_a_missing_key(user):
    pytest.importorskip("cryptography")
    from django.core import checks

    from django_idempotency import _check_ids

    api = ApiClient(user)
    sealing, other = _fernet(), _fernet()
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [sealing]}):
        api.post("/charges/", CHARGE, key=new_key())
        assert not [
            m for m in checks.run_checks(databases=["default"]) if m.id.startswith("django_i")
        ]
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [other]}):
        found = checks.run_checks(databases=["default"])
        assert _check_ids.error("SEALED_WITH_A_MISSING_KEY") in {m.id for m in found}
        without_database = checks.run_checks()
        assert _check_ids.error("SEALED_WITH_A_MISSING_KEY") not in {m.id for m in without_database}


def test_a_stale_lease_under_fail_is_an_unknown_outcome_replayed_to_every_retry(api):
    key = new_key()
    api.post("/charges/fail-policy/", CHARGE, key=key)
    make_in_progress(key, timedelta(seconds=-1))  # as a crashed attempt leaves it
    first = api.post("/charges/fail-policy/", CHARGE, key=key)
    problem(first, first.status_code, "idempotency_outcome_unknown")
    again = api.post("/charges/fail-policy/", CHARGE, key=key)
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert IdempotencyRecord.objects.get().status == "failed"
    assert Charge.objects.count() == 1


def test_a_stale_lease_under_retry_runs_again_with_the_same_downstream_key(api):
    from tests.testapp.models import ProviderCharge

    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    make_in_progress(key, timedelta(seconds=-1))
    again = api.post("/charges/", CHARGE, key=key)
    assert again.status_code == 201
    assert "Idempotent-Replayed" not in again
    assert ProviderCharge.objects.count() == 1  # the provider deduplicated the second call


# -- ★ Code already inside a transaction -------------------------------------------------


def test_under_atomic_requests_the_claim_commits_first_and_other_methods_keep_theirs(
    api, atomic_requests
):
    got = api.client.get("/peek/")
    assert json.loads(got.content) == {"atomic": True}  # Django's own ATOMIC_REQUESTS
    answer = api.post("/peek/", {}, key=new_key())
    assert answer.status_code == 200, answer.content
    seen = json.loads(answer.content)
    assert seen["atomic"] is True  # the view's work commits with its record
    if connection.vendor != "sqlite":
        assert seen["seen"] == "in_progress"  # another connection saw the claim at once
    assert IdempotencyRecord.objects.get().status == "completed"


def test_a_malformed_key_is_refused_where_a_key_is_optional_too(api):
    problem(api.post("/charges/optional/", CHARGE, key="a b"), 400, "idempotency_key_invalid")
    problem(api.post("/charges/optional/", CHARGE, key=""), 400, "idempotency_key_invalid")
    assert Charge.objects.count() == 0
    assert api.post("/charges/optional/", CHARGE).status_code == 201  # no key: runs, unstored
    assert IdempotencyRecord.objects.count() == 0
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("path", ["/async/charges/", "/async/where/class/"])
def test_an_async_view_replays_and_refuses_like_a_sync_one(user, path):
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    client = AsyncClient()
    client.force_login(user)
    key = new_key()

    def post(body):
        return async_to_sync(client.post)(
            path, body, content_type="application/json", headers={"Idempotency-Key": key}
        )

    first = post(CHARGE)
    assert first.status_code < 300, first.content
    again = post({"currency": "EUR", "amount": 100})
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert again["Idempotent-Replayed"] == "true"
    problem(post({"amount": 5, "currency": "EUR"}), 422, "idempotency_key_reused")
    assert IdempotencyRecord.objects.count() == 1


def test_recovery_leaves_a_resumable_record_and_purge_removes_its_steps():
    from django_idempotency import step
    from django_idempotency.models import IdempotencyStep
    from django_idempotency.testing import crash, expect_crash

    def body():
        step("one", lambda: 1)
        crash()

    with expect_crash():
        _once(body, recovery="resume", lease=timedelta(seconds=30))
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    out = StringIO()
    call_command("recover_idempotency", stdout=out)
    assert IdempotencyRecord.objects.get().status == "in_progress"  # left to the next attempt
    assert IdempotencyStep.objects.count() == 1
    assert "1" in out.getvalue()
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    call_command("purge_idempotency", stdout=StringIO())
    assert IdempotencyRecord.objects.count() == 0
    assert IdempotencyStep.objects.count() == 0


def test_refusals_name_no_setting_of_the_server(user):
    from django_idempotency import conf

    api = ApiClient(user)
    with override_settings(IDEMPOTENCY={"MAX_RESPONSE_BYTES": 10}):
        too_big = api.post("/outcome/", {"size": 100}, key=new_key())
    answers = [
        problem(too_big, 500, "idempotency_response_not_storable"),
        problem(api.post("/charges/", CHARGE), 400, "idempotency_key_missing"),
        problem(api.post("/charges/", CHARGE, key="a b"), 400, "idempotency_key_invalid"),
    ]
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    answers.append(
        problem(
            api.post("/charges/", {**CHARGE, "amount": 2}, key=key), 422, "idempotency_key_reused"
        )
    )
    make_in_progress(key, timedelta(seconds=30))
    answers.append(problem(api.post("/charges/", CHARGE, key=key), 409, "idempotency_key_in_use"))
    for body in answers:
        text = json.dumps(body)
        assert not [name for name in conf.DEFAULTS if name in text], text
        assert "IDEMPOTENCY" not in text
    assert Charge.objects.count() == 1
