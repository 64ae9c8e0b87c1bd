"""The ★ sections of the design, statement by statement, through the public surface only:
Django's test client, ``call_command`` and the documented imports. Every test counts the
side effects (charges written, records stored), never only the status."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord
from tests.helpers import ApiClient, make_in_progress, new_key
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
