"""Stored responses sealed at rest: ENCRYPTION_KEYS, what the rows hold, replays, lost keys,
and who sees a body in the admin."""

from __future__ import annotations

import base64
import json
import string
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency import _check_ids, _store, crypto, maintenance, run_once
from django_idempotency.checks import check_settings
from django_idempotency.conf import app_settings
from django_idempotency.models import IdempotencyAuditRecord, IdempotencyRecord
from tests.factories import RecordFactory, UserFactory
from tests.helpers import (
    LOCATION,
    LOST,
    NEW,
    OLD,
    PAYLOAD,
    SECRET_BODY,
    SECRET_HEADER,
    answered,
    fingerprint_of,
    in_thread,
    keys,
    postgres_only,
)
from tests.testapp.models import Charge

fernet = pytest.importorskip("cryptography.fernet")

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

# What a response carries that must never be readable in a stored row.
WAIT = 30


def post(api: Any, key: str, payload: dict[str, Any] = PAYLOAD) -> Any:
    return api.post("/outcome/", payload, key=key)


def raw_rows(model: type[Any]) -> list[tuple[str, bytes]]:
    """Every stored response of a table as the database holds it, read with raw SQL."""
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {quote('response_headers')}, {quote('response_body')}"
            f" FROM {quote(model._meta.db_table)} ORDER BY {quote('id')}"
        )
        rows = cursor.fetchall()
    return [(str(headers), bytes(body) if body is not None else b"") for headers, body in rows]


def assert_no_plaintext(rows: list[tuple[str, bytes]]) -> None:
    assert rows
    for headers, body in rows:
        for secret in (SECRET_BODY, SECRET_HEADER, LOCATION, "X-Customer", "text/plain"):
            assert secret not in headers
            assert secret.encode() not in body
        assert json.loads(headers).startswith("fernet:")


def charges() -> int:
    return Charge.objects.filter(account="outcome").count()


# -- the setting --------------------------------------------------------------------------------


def test_keys_are_read_as_a_tuple_of_text_and_bytes_keys_are_taken():
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [NEW, OLD.encode()]}):
        assert check_settings() == []
        inside = app_settings.ENCRYPTION_KEYS
    assert inside == (NEW, OLD)
    assert app_settings.ENCRYPTION_KEYS == ()


def test_the_settings_shown_read_the_keys_from_the_environment(monkeypatch):
    """The page's block, run as settings.py runs it: IDEMPOTENCY with the keys of the
    environment, which the package reads; none set, none used."""
    # tox runs a copy of tests/ without the example project beside it.
    pytest.importorskip("example_project.docs_examples.settings_encryption")
    from tests import docs_code

    shown = docs_code.section("example_project/docs_examples/settings_encryption.py", "encryption")

    def keys_read() -> tuple[str, ...]:
        namespace: dict[str, Any] = {}
        exec(shown, namespace)  # what pasting the block into settings.py does
        with override_settings(IDEMPOTENCY=namespace["IDEMPOTENCY"]):
            assert check_settings() == []
            return app_settings.ENCRYPTION_KEYS

    monkeypatch.setenv("IDEMPOTENCY_ENCRYPTION_KEYS", f"{NEW},{OLD}")
    assert keys_read() == (NEW, OLD)
    monkeypatch.delenv("IDEMPOTENCY_ENCRYPTION_KEYS")
    assert keys_read() == ()


@pytest.mark.parametrize(
    ("value", "why"),
    [
        pytest.param(NEW, "got a str", id="a-key-not-in-a-list"),
        ([NEW[:-2]], "key 1 of 1 is not URL-safe base64"),
        ([NEW, "A" * 40 + "AA=="], "key 2 of 2 decodes to 31 bytes, not 32"),
        ([NEW, NEW], "key 2 is the same as key 1"),
        ([None], "key 1 of 1 is a NoneType"),
    ],
)
def test_a_malformed_key_is_e024_and_never_shows_a_key(value, why):
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": value}):
        found = check_settings()
    assert [m.id for m in found] == ["django_idempotency.E024"]
    assert why in found[0].msg
    assert NEW not in found[0].msg
    assert NEW[:-2] not in found[0].msg


def _spelled(key: str, how: str) -> str:
    """``key`` (a Fernet key, as Fernet.generate_key() makes it) spelled another way."""
    raw = base64.urlsafe_b64decode(key)
    if how == "standard alphabet":  # as `openssl rand -base64 32` or b64encode spell one
        return base64.b64encode(raw).decode("ascii")
    if how == "no padding":
        return key.rstrip("=")
    if how == "unused low bits":  # the last digit's 2 spare bits set: the same 32 bytes
        alphabet = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
        return key[:42] + alphabet[alphabet.index(key[42]) ^ 3] + "="
    return {"a newline after it": key + "\n", "a space before it": " " + key}[how]


# 32 bytes whose base64 has a "+" and a "/" in the standard alphabet ("-" and "_" in Fernet's).
SPELLED_WITH_PLUS = base64.urlsafe_b64encode(bytes([0xFB, 0xFF] * 16)).decode("ascii")


@pytest.mark.parametrize(
    "how",
    [
        "standard alphabet",
        "no padding",
        "unused low bits",
        "a newline after it",
        "a space before it",
    ],
)
def test_every_key_the_check_passes_is_one_fernet_takes(how):
    """A key the check lets through is one every completion can seal with: a key spelled in
    the standard base64 alphabet passed the check, then failed every completion (the view
    ran, its transaction rolled back, its record released, and every retry ran it again)."""
    for key in (SPELLED_WITH_PLUS, NEW, OLD):
        spelled = _spelled(key, how)
        with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [NEW, spelled]}):
            found = check_settings()
        try:
            fernet.Fernet(spelled)
        except ValueError:
            assert [m.id for m in found] == ["django_idempotency.E024"], (how, key)
            assert spelled not in found[0].msg
        else:
            assert found == [] or [m.id for m in found] == ["django_idempotency.E024"]


def test_a_key_in_the_standard_base64_alphabet_is_e024_and_nothing_runs():
    """Before, the check passed it, and every call ran its body and then failed to seal the
    outcome: its record released, the next call ran the body again."""
    spelled = _spelled(SPELLED_WITH_PLUS, "standard alphabet")
    assert "+" in spelled
    calls: list[int] = []

    def pay(amount: int) -> int:
        calls.append(amount)
        return amount

    identity = {"account": "worker", "operation": "pay", "key": "std-1"}
    with keys(spelled):
        found = check_settings()
        for _ in range(2):
            with pytest.raises(Exception, match="E024"):
                run_once(pay, 5, **identity)
    assert [m.id for m in found] == ["django_idempotency.E024"]
    assert "URL-safe base64" in found[0].msg
    assert calls == []
    assert not IdempotencyRecord.objects.exists()


def test_one_key_spelled_twice_is_e024():
    """The same 32 bytes with the digit's spare bits set: one key, whatever it is spelled."""
    twice = [NEW, _spelled(NEW, "unused low bits")]
    assert twice[0] != twice[1]
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": twice}):
        found = check_settings()
    assert [m.id for m in found] == ["django_idempotency.E024"]
    assert "key 2 is the same as key 1" in found[0].msg


def test_keys_without_cryptography_are_e025_and_nothing_runs(api, monkeypatch):
    monkeypatch.setitem(sys.modules, "cryptography.fernet", None)
    with keys(NEW):
        found = check_settings()
        assert [m.id for m in found] == [_check_ids.error("CRYPTOGRAPHY_MISSING")]
        assert "django-idempotency[crypto]" in (found[0].hint or "")
        response = None
        with pytest.raises(Exception, match="E025"):
            response = post(api, "no-crypto")
    assert response is None
    assert charges() == 0
    assert not IdempotencyRecord.objects.exists()


# -- what is stored -----------------------------------------------------------------------------


def test_no_keys_stores_in_the_clear_at_no_cost():
    headers, body = [["Content-Type", "text/plain"]], b"x"
    assert crypto.seal_response(headers, body) == (headers, body)
    assert crypto.seal_response(headers, body)[0] is headers


def test_a_sealed_row_holds_no_plaintext_of_the_body_or_the_stored_headers(api):
    with keys(NEW):
        first = post(api, "sealed")
        again = post(api, "sealed")
    assert first.status_code == 201
    assert answered(again) == answered(first)
    assert again["Idempotent-Replayed"] == "true"
    assert charges() == 1
    assert_no_plaintext(raw_rows(IdempotencyRecord))
    stored = IdempotencyRecord.objects.get()
    assert crypto.sealed_with(stored.response_headers) == crypto.key_id(NEW)
    # The rest of the record stays in the clear: the engine and the operators need it.
    assert (stored.status, stored.response_status) == ("completed", 201)
    assert stored.operation == "POST outcome/"


def test_audit_copies_are_sealed_the_same_way(api):
    with keys(NEW, AUDIT=True):
        post(api, "purged")
        post(api, "replaced")
        IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
        renewed = post(api, "replaced")  # a new request after the TTL: the copy, then the run
        assert maintenance.purge_expired().deleted == 1
    assert renewed.status_code == 201
    assert "Idempotent-Replayed" not in renewed
    assert charges() == 3
    reasons = sorted(IdempotencyAuditRecord.objects.values_list("key", "reason"))
    assert reasons == [("purged", "purged"), ("replaced", "replaced")]
    assert_no_plaintext(raw_rows(IdempotencyAuditRecord))
    assert_no_plaintext(raw_rows(IdempotencyRecord))


def test_run_once_results_are_sealed_and_returned_again():
    calls: list[int] = []

    def pay(amount: int) -> dict[str, Any]:
        calls.append(amount)
        return {"paid": amount, "to": SECRET_BODY}

    identity = {"account": "worker", "operation": "pay", "key": "m-1"}
    with keys(NEW):
        first = run_once(pay, 5, **identity)
        again = run_once(pay, 5, **identity)
    assert first == again == {"paid": 5, "to": SECRET_BODY}
    assert calls == [5]
    ((headers, body),) = raw_rows(IdempotencyRecord)
    assert SECRET_BODY.encode() not in body
    assert json.loads(headers).startswith("fernet:")


def test_sealing_adds_no_statement_to_a_first_request_or_a_replay(api):
    counted = {}
    for name, setting in (("clear", keys()), ("sealed", keys(NEW))):
        with setting:
            post(api, f"warm-{name}")
            with CaptureQueriesContext(connection) as first:
                post(api, f"count-{name}")
            with CaptureQueriesContext(connection) as replay:
                post(api, f"count-{name}")
        counted[name] = (len(first), len(replay))
    assert counted["sealed"] == counted["clear"]


# -- replays across keys ------------------------------------------------------------------------


def test_replays_are_byte_identical_with_one_key_with_new_and_old_and_after_rotation(api):
    with keys():
        clear = post(api, "before-keys")
    with keys(OLD):
        old = post(api, "old-key")
        assert answered(post(api, "old-key")) == answered(old)
        assert answered(post(api, "before-keys")) == answered(clear)
    with keys(NEW, OLD):
        new = post(api, "new-key")
        for key, first in (("before-keys", clear), ("old-key", old), ("new-key", new)):
            assert answered(post(api, key)) == answered(first)
        result = maintenance.rotate_encryption(batch_size=2)
    assert (result.records, result.current) == (2, 1)
    sealed = set(IdempotencyRecord.objects.values_list("response_headers", flat=True))
    assert {crypto.sealed_with(h) for h in sealed} == {crypto.key_id(NEW)}
    with keys(NEW):
        for key, first in (("before-keys", clear), ("old-key", old), ("new-key", new)):
            again = post(api, key)
            assert answered(again) == answered(first)
            assert again["Idempotent-Replayed"] == "true"
    assert charges() == 3
    assert_no_plaintext(raw_rows(IdempotencyRecord))


# -- a lost key ---------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["tampered token", "not ours", "no token"])
def test_a_damaged_sealed_response_is_refused_everywhere(api, damage):
    with keys(NEW):
        post(api, "damaged")
        record = IdempotencyRecord.objects.get()
        headers = str(record.response_headers)
        broken = {
            "tampered token": headers[:-8]
            + ("A" * 8 if not headers.endswith("A" * 8) else "B" * 8),
            "not ours": "hello: a JSON string the package never wrote",
            "no token": f"fernet:{crypto.key_id(NEW)}",
        }[damage]
        IdempotencyRecord.objects.filter(pk=record.pk).update(response_headers=broken)
        html = detail(_superuser(), record)
        rotation = maintenance.rotate_encryption()
        fresh = post(api, "damaged")
        again = post(api, "damaged")
    assert "Cannot be read" in html
    # The rotation passes over what names the first key without reading it.
    expected = (0, 1, 0) if damage == "tampered token" else (0, 0, 1)
    assert (rotation.records, rotation.current, rotation.unreadable) == expected
    for answer in (fresh, again):
        assert answer.status_code == 503
        assert json.loads(answer.content)["code"] == "idempotency_record_unreadable"
    assert charges() == 1


def test_turning_encryption_off_refuses_sealed_records_until_a_key_is_back(api):
    with keys(NEW):
        first = post(api, "sealed")
    with keys():
        refused = post(api, "sealed")
    assert refused.status_code == 503
    assert json.loads(refused.content)["code"] == "idempotency_record_unreadable"
    with keys(NEW):
        again = post(api, "sealed")
    assert answered(again) == answered(first)
    assert again["Idempotent-Replayed"] == "true"
    assert charges() == 1


@postgres_only
def test_a_waiting_duplicate_never_replays_a_response_it_cannot_open(api, user, monkeypatch):
    """The original is completed meanwhile by a server whose key this one lacks: the
    duplicate that waits for it is refused, never replays nothing, never runs again."""
    polling = threading.Event()
    real_fetch = _store.fetch

    def observed_fetch(*args: Any) -> Any:
        # On PostgreSQL the claim is one statement: a fetch is the waiting duplicate's poll.
        polling.set()
        return real_fetch(*args)

    monkeypatch.setattr(_store, "fetch", observed_fetch)
    original = RecordFactory(
        account=f"user:{user.pk}",
        operation="POST outcome/",
        key="foreign",
        status="in_progress",
        lease_token="6c3f4d1e-2b8a-4c9d-9e0f-1a2b3c4d5e6f",
        lease_expires_at=timezone.now() + timedelta(seconds=30),
        response_status=None,
        response_headers=[],
        response_body=None,
        request_hash=fingerprint_of(api, PAYLOAD),
    )
    with keys(NEW, IN_PROGRESS_WAIT=timedelta(seconds=5)), ThreadPoolExecutor(1) as pool:
        answer = pool.submit(in_thread(lambda: post(api, "foreign")))
        assert polling.wait(WAIT)
        headers, body = crypto._seal(crypto.keys_of((LOST,)), [["Content-Type", "x/y"]], b"?")
        IdempotencyRecord.objects.filter(pk=original.pk).update(
            status="completed",
            response_status=200,
            response_headers=headers,
            response_body=body,
            lease_token=None,
            lease_expires_at=None,
            completed_at=timezone.now(),
        )
        response = answer.result(timeout=WAIT)
    assert response.status_code == 503
    assert json.loads(response.content)["code"] == "idempotency_record_unreadable"
    assert charges() == 0


# -- the admin ----------------------------------------------------------------------------------


def staff(*codenames: str) -> Client:
    user = UserFactory(is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="django_idempotency", codename__in=codenames
        )
    )
    client = Client()
    client.force_login(user)
    return client


def detail(client: Client, record: IdempotencyRecord) -> str:
    response = client.get(f"/admin/django_idempotency/idempotencyrecord/{record.pk}/change/")
    assert response.status_code == 200
    return str(response.content.decode())


@pytest.fixture
def sealed_record(api: Any) -> IdempotencyRecord:
    with keys(NEW):
        post(api, "shown")
    return IdempotencyRecord.objects.get()


def test_staff_without_the_permission_sees_the_size_and_content_type_not_the_body(
    sealed_record,
):
    with keys(NEW):
        html = detail(staff("view_idempotencyrecord"), sealed_record)
    assert "Ada Lovelace" not in html
    assert SECRET_HEADER not in html
    assert LOCATION not in html
    size = len(PAYLOAD["body"].encode())
    assert f"{size} bytes · text/plain" in html
    assert f"sealed with key {crypto.key_id(NEW)}" in html


@pytest.mark.parametrize(
    ("held", "said"),
    [
        ((OLD, NEW), "in ENCRYPTION_KEYS, not the first: rotate_idempotency_encryption reseals it"),
        ((OLD,), "not in ENCRYPTION_KEYS: it cannot be read"),
    ],
)
def test_the_detail_says_where_the_sealing_key_stands_in_encryption_keys(sealed_record, held, said):
    with keys(*held):
        html = detail(staff("view_idempotencyrecord"), sealed_record)
    assert f"sealed with key {crypto.key_id(NEW)} ({said})" in html
    assert "Ada Lovelace" not in html


@pytest.mark.parametrize("who", ["permitted staff", "superuser"])
def test_a_user_with_the_permission_sees_the_body_and_headers_opened(sealed_record, who):
    client = (
        staff("view_idempotencyrecord", "view_response_body")
        if who == "permitted staff"
        else _superuser()
    )
    with keys(NEW, OLD):
        html = detail(client, sealed_record)
    assert "Ada Lovelace" in html
    assert f"X-Customer: {SECRET_HEADER}" in html
    assert f"Location: {LOCATION}" in html
    assert "the first of ENCRYPTION_KEYS" in html


def test_the_admin_says_a_record_it_cannot_open_is_refused(sealed_record):
    with keys(OLD):
        html = detail(_superuser(), sealed_record)
    assert "Ada Lovelace" not in html
    assert "Cannot be read" in html
    assert "retries are refused" in html
    assert "not in ENCRYPTION_KEYS" in html


def test_the_permission_comes_with_the_migrations():
    permission = Permission.objects.get(codename="view_response_body")
    assert permission.content_type.model == "idempotencyrecord"


def _superuser() -> Client:
    client = Client()
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client
