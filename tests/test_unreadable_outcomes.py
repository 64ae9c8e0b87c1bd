"""An outcome that cannot be read back is refused, never run again, within its TTL.

A stored response, result, header set or step result that no configured key opens (a key
removed, ``ENCRYPTION_KEYS`` emptied by a deploy, a rotation step skipped) or that is damaged
(one byte of a token, JSON that is not the package's) is not "expired": the HTTP side answers
``503`` ``idempotency_record_unreadable`` with ``Retry-After``, ``run_once`` and the task
decorator raise ``RecordUnreadable``, and nothing runs. Once a key that opens it is configured
again, the original is replayed byte for byte. Every test counts the operation's effects.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.core import checks
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client, override_settings
from django.utils import timezone

from django_idempotency import IdempotencyError, RecordUnreadable, crypto, run_once, step
from django_idempotency.models import IdempotencyRecord, IdempotencyStep, RecordStatus
from tests.factories import UserFactory, store_raw_json
from tests.helpers import in_thread, new_key, says_nothing_of_the_server
from tests.testapp.models import Charge

fernet = pytest.importorskip("cryptography.fernet")

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

K1 = fernet.Fernet.generate_key().decode()
K2 = fernet.Fernet.generate_key().decode()
K3 = fernet.Fernet.generate_key().decode()
CHARGE = {"amount": 5, "currency": "EUR"}
IDENTITY = {"account": "worker", "operation": "pay"}


def keys(*keys: str, **more: Any) -> Any:
    return override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": list(keys), **more})


def refused(response: Any) -> dict[str, Any]:
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/problem+json"
    assert int(response["Retry-After"]) >= 1
    body = json.loads(response.content)
    assert body["code"] == "idempotency_record_unreadable"
    assert body["status"] == 503
    return dict(body)


def replayed(first: Any, again: Any) -> None:
    assert again.status_code == first.status_code
    assert again.content == first.content
    assert again["Content-Type"] == first["Content-Type"]
    assert again.get("Location") == first.get("Location")
    assert again["Idempotent-Replayed"] == "true"


def damage_one_byte(record: IdempotencyRecord) -> str:
    """Change one character of the record's sealed token; the original text is returned."""
    stored = str(record.response_headers)
    position = len(stored) - 10
    changed = "A" if stored[position] != "A" else "B"
    broken = stored[:position] + changed + stored[position + 1 :]
    IdempotencyRecord.objects.filter(pk=record.pk).update(response_headers=broken)
    return stored


# Each way a sealed outcome becomes unreadable: (keys it is sealed with, keys it is read
# with, keys that open it again).
LOST = {
    "key-removed": ((K1,), (K2,), (K2, K1)),
    "keys-emptied": ((K1,), (), (K1,)),
    "rotation-skipped": ((K2, K1), (K3, K2), (K3, K2, K1)),
}


@pytest.mark.parametrize("how", list(LOST))
def test_http_an_outcome_no_key_opens_is_refused_and_runs_nothing(api, how, caplog):
    sealed, reading, reopening = LOST[how]
    key = new_key()
    if how == "rotation-skipped":
        # Sealed with K1 while it was first; K2 was added first later, and the rotation that
        # would have resealed with K2 never ran before K1 was removed.
        with keys(K1):
            first = api.post("/charges/", CHARGE, key=key)
    else:
        with keys(*sealed):
            first = api.post("/charges/", CHARGE, key=key)
    assert first.status_code == 201
    caplog.set_level(logging.WARNING, logger="django_idempotency")
    with keys(*reading):
        body = refused(api.post("/charges/", CHARGE, key=key))
        refused(api.post("/charges/", CHARGE, key=key))
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    # The log names the key that sealed it, never a key itself; the client is told neither.
    assert crypto.key_id(K1) in caplog.text
    says_nothing_of_the_server(body)
    for secret in (K1, K2, K3):
        assert secret not in caplog.text
        assert secret not in body["detail"]
    with keys(*reopening):
        replayed(first, api.post("/charges/", CHARGE, key=key))
    assert Charge.objects.count() == 1


def test_http_a_damaged_token_is_refused_and_replays_once_repaired(api):
    key = new_key()
    with keys(K1):
        first = api.post("/charges/", CHARGE, key=key)
        stored = damage_one_byte(IdempotencyRecord.objects.get())
        refused(api.post("/charges/", CHARGE, key=key))
        assert Charge.objects.count() == 1
        IdempotencyRecord.objects.update(response_headers=stored)
        replayed(first, api.post("/charges/", CHARGE, key=key))
    assert Charge.objects.count() == 1


DAMAGED_HEADERS = {
    "a-dict": {"Content-Type": "application/json"},
    "a-number": 42,
    "a-flat-list": ["Content-Type", "application/json"],
    "a-triple": [["Content-Type", "application/json", "x"]],
    "a-non-string-value": [["Content-Type", 7]],
    "a-string-not-ours": "hello",
}


@pytest.mark.parametrize("damage", list(DAMAGED_HEADERS.values()), ids=list(DAMAGED_HEADERS))
def test_http_damaged_stored_headers_are_refused_not_run_again(api, damage):
    key = new_key()
    first = api.post("/charges/", CHARGE, key=key)
    record = IdempotencyRecord.objects.get()
    store_raw_json(IdempotencyRecord, record.pk, "response_headers", json.dumps(damage))
    refused(api.post("/charges/", CHARGE, key=key))
    assert Charge.objects.count() == 1
    intact = [["Content-Type", first["Content-Type"]], ["Location", first["Location"]]]
    store_raw_json(IdempotencyRecord, record.pk, "response_headers", json.dumps(intact))
    replayed(first, api.post("/charges/", CHARGE, key=key))
    assert Charge.objects.count() == 1


def test_http_a_changed_payload_is_still_a_422_first(api):
    key = new_key()
    with keys(K1):
        api.post("/charges/", CHARGE, key=key)
    with keys(K2):
        other = api.post("/charges/", {**CHARGE, "amount": 6}, key=key)
    assert other.status_code == 422
    assert json.loads(other.content)["code"] == "idempotency_key_reused"
    assert Charge.objects.count() == 1


def test_http_past_its_ttl_an_unreadable_record_is_absent_like_any_expired_one(api):
    key = new_key()
    with keys(K1):
        api.post("/charges/", CHARGE, key=key)
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    with keys(K2):
        fresh = api.post("/charges/", CHARGE, key=key)
        again = api.post("/charges/", CHARGE, key=key)
    assert fresh.status_code == 201
    assert "Idempotent-Replayed" not in fresh
    replayed(fresh, again)
    assert Charge.objects.count() == 2


# -- run_once, tasks and steps -------------------------------------------------------------


def counted(calls: list[int]) -> Any:
    def pay(amount: int) -> dict[str, int]:
        calls.append(amount)
        Charge.objects.create(account="worker", amount=amount, currency="EUR")
        return {"paid": amount}

    return pay


@pytest.mark.parametrize("how", list(LOST))
def test_run_once_raises_record_unreadable_and_runs_nothing(how):
    sealed, reading, reopening = LOST[how]
    calls: list[int] = []
    with keys(K1 if how == "rotation-skipped" else sealed[0]) if sealed else keys():
        assert run_once(counted(calls), 3, **IDENTITY, key="m-1") == {"paid": 3}
    with keys(*reading), pytest.raises(RecordUnreadable) as raised:
        run_once(counted(calls), 3, **IDENTITY, key="m-1")
    assert isinstance(raised.value, IdempotencyError)
    assert raised.value.key_id == crypto.key_id(K1)
    assert calls == [3]
    with keys(*reopening):
        assert run_once(counted(calls), 3, **IDENTITY, key="m-1") == {"paid": 3}
    assert calls == [3]
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("damage", ["not-json", "truncated", "binary"])
def test_run_once_a_damaged_stored_result_raises_record_unreadable(damage):
    calls: list[int] = []
    run_once(counted(calls), 3, **IDENTITY, key="m-2")
    body = {"not-json": b"{nope", "truncated": b'{"paid": 3', "binary": b"\xff\xfe\x00"}[damage]
    IdempotencyRecord.objects.update(response_body=body)
    with pytest.raises(RecordUnreadable):
        run_once(counted(calls), 3, **IDENTITY, key="m-2")
    assert calls == [3]


def test_run_once_damaged_headers_raise_record_unreadable():
    calls: list[int] = []
    run_once(counted(calls), 3, **IDENTITY, key="m-3")
    record = IdempotencyRecord.objects.get()
    store_raw_json(IdempotencyRecord, record.pk, "response_headers", json.dumps({"x": 1}))
    with pytest.raises(RecordUnreadable):
        run_once(counted(calls), 3, **IDENTITY, key="m-3")
    assert calls == [3]


def test_a_damaged_step_result_is_refused_and_the_step_never_runs_again():
    calls: list[str] = []

    def run(name: str) -> str:
        calls.append(name)
        return "done"

    def body() -> str:
        step("one", run, "one")
        if len(calls) == 1 and not resumed:
            raise RuntimeError("dies after its first step")
        step("two", run, "two")
        return "ok"

    resumed = False
    with pytest.raises(RuntimeError):
        run_once(body, **IDENTITY, key="s-1", recovery="resume")
    IdempotencyStep.objects.update(result="{damaged")
    resumed = True
    with pytest.raises(RecordUnreadable):
        run_once(body, **IDENTITY, key="s-1", recovery="resume")
    assert calls == ["one"]
    # The record is left for the next attempt, which is refused the same way.
    with pytest.raises(RecordUnreadable):
        run_once(body, **IDENTITY, key="s-1", recovery="resume")
    assert calls == ["one"]


# -- what operators see -----------------------------------------------------------------------


def e026(messages: list[Any]) -> list[Any]:
    return [m for m in messages if m.id == "django_idempotency.E026"]


def test_check_database_reports_the_key_ids_sealed_outcomes_need(api):
    with keys(K1):
        api.post("/charges/", CHARGE, key=new_key())
        api.post("/charges/", CHARGE, key=new_key())
    with keys(K2):
        assert e026(checks.run_checks()) == []
        found = [
            m
            for m in checks.run_checks(databases=["default"])
            if m.id.startswith("django_idempotency")
        ]
    assert [m.id for m in found] == ["django_idempotency.E026"]
    assert found[0].level == checks.ERROR
    assert crypto.key_id(K1) in found[0].msg
    assert "2" in found[0].msg  # how many outcomes need it
    assert K1 not in found[0].msg + (found[0].hint or "")
    with keys(K2, K1):
        assert e026(checks.run_checks(databases=["default"])) == []
    with keys():
        (emptied,) = e026(checks.run_checks(databases=["default"]))
    assert crypto.key_id(K1) in emptied.msg


def test_the_stats_and_the_admin_filter_count_and_list_them(api):
    with keys(K1):
        api.post("/charges/", CHARGE, key=new_key())
    with keys(K2):
        api.post("/charges/", CHARGE, key=new_key())
        from io import StringIO

        out = StringIO()
        call_command("idempotency_stats", "--json", stdout=out)
        stats = json.loads(out.getvalue())
        assert stats["unreadable"] == 1
        admin = Client()
        admin.force_login(UserFactory(is_staff=True, is_superuser=True))
        page = admin.get("/admin/django_idempotency/idempotencyrecord/?readable=no")
        assert page.status_code == 200
        listed = page.context["cl"].result_list
        assert [r.pk for r in listed] == [IdempotencyRecord.objects.order_by("pk").first().pk]


def test_the_purge_removes_an_unreadable_record_at_its_expiry(api):
    with keys(K1):
        api.post("/charges/", CHARGE, key=new_key())
    with keys(K2):
        call_command("purge_idempotency", verbosity=0)
        assert IdempotencyRecord.objects.count() == 1
        IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
        call_command("purge_idempotency", verbosity=0)
    assert IdempotencyRecord.objects.count() == 0


def test_the_metrics_count_each_refusal_by_operation_and_key_id(api):
    pytest.importorskip("prometheus_client")
    from prometheus_client import REGISTRY

    from django_idempotency import metrics  # noqa: F401  (registers its receivers)

    labels = {"operation": "POST charges/", "key_id": crypto.key_id(K1)}

    def refusals() -> float:
        return REGISTRY.get_sample_value("django_idempotency_unreadable_total", labels) or 0.0

    before = refusals()
    key = new_key()
    with keys(K1):
        api.post("/charges/", CHARGE, key=key)
    with keys(K2):
        refused(api.post("/charges/", CHARGE, key=key))
        refused(api.post("/charges/", CHARGE, key=key))
    assert refusals() - before == 2


def test_a_task_whose_stored_result_no_key_opens_raises_and_never_runs_again():
    pytest.importorskip("celery")
    from tests.testapp.models import ProviderCall
    from tests.testapp.tasks import record_effect

    with keys(K1):
        assert record_effect.apply(args=["t-11"], task_id="delivery-11").get()["tag"] == "t-11"
    with keys(K2):
        result = record_effect.apply(args=["t-11"], task_id="delivery-11")
        assert isinstance(result.result, RecordUnreadable)
    assert ProviderCall.objects.filter(key="effect:t-11").count() == 1


# -- damage a replay could not answer without a 500 --------------------------------------------

DAMAGED_DONE = {
    "newline-in-a-header-value": (
        "headers",
        [["Content-Type", "application/json"], ["Location", "/x\r\nSet-Cookie: a=b"]],
    ),
    "newline-in-a-header-name": ("headers", [["Content-Type\nX", "application/json"]]),
    "status-0": ("status", 0),
    "status-999": ("status", 999),
    "null-body": ("body", None),
}


@pytest.mark.parametrize("damage", list(DAMAGED_DONE))
@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_damage_that_no_response_can_carry_is_refused_not_a_500(api, damage, sealed):
    key = new_key()
    with keys(*([K1] if sealed else [])):
        first = api.post("/charges/", CHARGE, key=key)
        record = IdempotencyRecord.objects.get()
        what, value = DAMAGED_DONE[damage]
        if what == "headers":
            if sealed:
                body = crypto.open_response(record.response_headers, record.response_body)[1]
                headers, body = crypto._seal(crypto.keys_of((K1,)), value, body or b"")
                IdempotencyRecord.objects.update(response_headers=headers, response_body=body)
            else:
                store_raw_json(IdempotencyRecord, record.pk, "response_headers", json.dumps(value))
        elif what == "status":
            IdempotencyRecord.objects.update(response_status=value)
        else:
            IdempotencyRecord.objects.update(response_body=value)
        refused(api.post("/charges/", CHARGE, key=key))
    assert first.status_code == 201
    assert Charge.objects.count() == 1


def test_sealed_headers_that_are_not_pairs_are_refused(api):
    key = new_key()
    with keys(K1):
        api.post("/charges/", CHARGE, key=key)
        record = IdempotencyRecord.objects.get()
        body = crypto.open_response(record.response_headers, record.response_body)[1]
        headers, body = crypto._seal(crypto.keys_of((K1,)), {"Content-Type": "x"}, body or b"")  # type: ignore[arg-type]
        IdempotencyRecord.objects.update(response_headers=headers, response_body=body)
        refused(api.post("/charges/", CHARGE, key=key))
    assert Charge.objects.count() == 1


def test_the_rotation_leaves_damaged_clear_headers_as_they_are(api):
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    record = IdempotencyRecord.objects.get()
    store_raw_json(IdempotencyRecord, record.pk, "response_headers", json.dumps({"x": "y"}))
    with keys(K1):
        result = crypto.rotate(using="default")
        refused(api.post("/charges/", CHARGE, key=key))
    assert (result.records, result.unreadable) == (0, 1)
    record.refresh_from_db()
    assert record.response_headers == {"x": "y"}  # not sealed: the damage stays in sight
    assert Charge.objects.count() == 1


def test_run_once_a_result_whose_body_is_gone_raises_record_unreadable():
    calls: list[int] = []
    run_once(counted(calls), 3, **IDENTITY, key="m-null")
    IdempotencyRecord.objects.update(response_body=None)
    with pytest.raises(RecordUnreadable):
        run_once(counted(calls), 3, **IDENTITY, key="m-null")
    assert calls == [3]


# JSON nested deeper than Python's decoder goes (its recursion limit), yet a valid document
# that SQLite, PostgreSQL and MariaDB store: another program's writing, or damage.
DEEP = "[" * 1500 + "]" * 1500
# Sealed, a document has no column's limit: nested past the C recursion limit of Python 3.12
# and later too (about 10,000), which lets 1,500 levels through.
DEEPER = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_headers_nested_past_the_decoder_are_refused_everywhere_and_never_run_again(api, sealed):
    """The retry is refused (503, not a 500), the admin's page says why, and the rotation
    counts the record and goes on sealing the records after it."""
    if not sealed and connection.vendor == "mysql":
        pytest.skip("MariaDB's JSON columns refuse a document nested 32 levels deep")
    damaged, after = new_key(), new_key()
    with keys(*([K2] if sealed else [])):
        first = api.post("/charges/", CHARGE, key=damaged)
        api.post("/charges/", CHARGE, key=after)
    record = IdempotencyRecord.objects.get(key=damaged)
    if sealed:
        token = crypto.keys_of((K2,)).fernet.encrypt(DEEPER.encode()).decode()
        IdempotencyRecord.objects.filter(pk=record.pk).update(
            response_headers=f"fernet:{crypto.key_id(K2)}:{token}"
        )
    else:
        store_raw_json(IdempotencyRecord, record.pk, "response_headers", DEEP)
    with keys(K1, K2):
        refused(api.post("/charges/", CHARGE, key=damaged))
        admin = Client()
        admin.force_login(UserFactory(is_staff=True, is_superuser=True))
        page = admin.get(f"/admin/django_idempotency/idempotencyrecord/{record.pk}/change/")
        assert page.status_code == 200
        result = crypto.rotate(using="default")
        refused(api.post("/charges/", CHARGE, key=damaged))
    assert (result.records, result.unreadable) == (1, 1)
    assert crypto.sealed_with(IdempotencyRecord.objects.get(key=after).response_headers) == (
        crypto.key_id(K1)
    )
    assert first.status_code == 201
    assert Charge.objects.count() == 2


def test_a_damaged_key_id_under_a_configured_key_is_resealed_by_the_rotation(api):
    """One character of the key id stored before the token changed: the token is intact and
    a configured key opens it, so its retries replay. The rotation opens and reseals it
    rather than counting it unreadable, and then no check names a key it does not need."""
    key = new_key()
    with keys(K1):
        first = api.post("/charges/", CHARGE, key=key)
    record = IdempotencyRecord.objects.get()
    kid = crypto.key_id(K1)
    damaged_kid = ("0" if kid[0] != "0" else "1") + kid[1:]
    stored = str(record.response_headers)
    IdempotencyRecord.objects.update(response_headers=stored.replace(kid, damaged_kid, 1))
    with keys(K2, K1):
        replayed(first, api.post("/charges/", CHARGE, key=key))
        result = crypto.rotate(using="default")
        assert (result.records, result.unreadable) == (1, 0)
        assert e026(checks.run_checks(databases=["default"])) == []
    with keys(K2):
        replayed(first, api.post("/charges/", CHARGE, key=key))
    assert crypto.sealed_with(IdempotencyRecord.objects.get().response_headers) == crypto.key_id(K2)
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("damage", ["one bit of the body flipped", "body cut short"])
def test_a_damaged_sealed_body_under_intact_headers_is_refused_and_nothing_runs(api, damage):
    """The headers' token opens, the body's does not: refused while it is damaged, never run
    again, its row neither changed nor left locked, replayed once repaired."""
    key = new_key()
    with keys(K1):
        first = api.post("/charges/", CHARGE, key=key)
        record = IdempotencyRecord.objects.get(key=key)
        stored = bytes(record.response_body)
        body = {
            "one bit of the body flipped": stored[:20] + bytes([stored[20] ^ 1]) + stored[21:],
            "body cut short": stored[:-1],
        }[damage]
        IdempotencyRecord.objects.filter(pk=record.pk).update(response_body=body)
        for _ in range(2):
            refused(api.post("/charges/", CHARGE, key=key))
        # Nothing is left locked: another connection locks the row at once, as it was damaged.
        nowait = connection.features.has_select_for_update_nowait

        def lock() -> tuple[str, bytes]:
            with transaction.atomic():
                held = IdempotencyRecord.objects.select_for_update(nowait=nowait).get(pk=record.pk)
            return held.status, bytes(held.response_body)

        with ThreadPoolExecutor(1) as pool:
            locked = pool.submit(in_thread(lock)).result(timeout=30)
        assert locked == (RecordStatus.COMPLETED, body)
        IdempotencyRecord.objects.filter(pk=record.pk).update(response_body=stored)
        replayed(first, api.post("/charges/", CHARGE, key=key))
    assert Charge.objects.count() == 1
