"""An outcome larger than the database takes in one statement (MariaDB's and MySQL's
``max_allowed_packet``, 16 MiB on the tests' server): refused before its completion is
sent (``OutcomeTooLarge``; a view answers ``500 idempotency_response_not_storable``), its
work rolled back and its claim released, never answered ``503`` as a lost connection that a
retry would run again. An outcome that fits only once its escaping is counted is kept.

PostgreSQL and SQLite take any outcome this size (the last tests store one there). The
engine's refusal runs on them too, under a vendor that declares a limit (``capped``: the
limit a ``SELECT`` answers, the values counted as they are); the escaping's count is
MariaDB's own, and its tests run there only.
"""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import OutcomeTooLarge, crypto, outbox, run_once, step
from django_idempotency._vendors import of
from django_idempotency.models import (
    IdempotencyRecord,
    IdempotencyStep,
    OutboxMessage,
    OutboxStatus,
    OutboxUniqueKey,
)
from django_idempotency.testing import crash_after, expire_lease
from tests.factories import RecordFactory
from tests.helpers import NEW, new_key, packet
from tests.testapp.models import Charge, ProviderCall, ProviderCharge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

mysql_only = pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB's max_allowed_packet")

MIB = 1024 * 1024
UNLIMITED = override_settings(IDEMPOTENCY={"MAX_RESPONSE_BYTES": None})


def not_storable(response: object) -> None:
    assert response.status_code == 500  # type: ignore[attr-defined]
    assert response["Content-Type"] == "application/problem+json"  # type: ignore[index]
    assert response.json()["code"] == "idempotency_response_not_storable"  # type: ignore[attr-defined]


@pytest.mark.usefixtures("capped")
@UNLIMITED
def test_a_response_larger_than_the_server_takes_is_refused_not_sent_and_not_run_again(api):
    size = packet() + MIB
    key = new_key()
    for _ in range(2):  # the retry ends the same way: refused, never a 503 to retry
        response = api.post("/outcome/", {"size": size}, key=key)
        not_storable(response)
        assert "max_allowed_packet" not in response.content.decode()
        assert Charge.objects.count() == 0  # rolled back, both times
        assert not IdempotencyRecord.objects.filter(key=key).exists()  # released
    # Nothing too large was sent: the server kept the connection, and the next request on
    # it is stored as usual.
    raw = connection.connection
    ok = api.post("/outcome/", {"size": 10}, key=new_key())
    assert ok.status_code == 200
    assert connection.connection is raw
    assert Charge.objects.count() == 1


@mysql_only
@UNLIMITED
def test_a_response_that_fits_only_counted_byte_by_byte_is_kept(api):
    # Over half the packet: twice its size would not fit, its escaped size does.
    size = packet() * 3 // 4
    key = new_key()
    first = api.post("/outcome/", {"size": size}, key=key)
    assert first.status_code == 200
    assert len(IdempotencyRecord.objects.get(key=key).response_body) == size
    again = api.post("/outcome/", {"size": size}, key=key)
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


@mysql_only
@UNLIMITED
@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=None)
def test_a_response_that_fits_but_not_once_escaped_is_refused(api):
    # Each quote is sent escaped, two bytes: three quarters of the packet become one and a half.
    quotes = "'" * (packet() * 3 // 4)
    key = new_key()
    response = api.post("/outcome/", {"body": quotes}, key=key)
    not_storable(response)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()


@pytest.mark.usefixtures("capped")
def test_run_once_raises_outcome_too_large_and_commits_nothing():
    limit = packet()
    calls = []

    def charge() -> str:
        calls.append(1)
        Charge.objects.create(account="large", amount=1, currency="EUR")
        return "x" * (limit + MIB)

    key = new_key()
    for attempt in (1, 2):
        with pytest.raises(OutcomeTooLarge) as raised:
            run_once(charge, account="a", operation="large", key=key)
        assert raised.value.limit == limit
        assert raised.value.size > limit
        assert len(calls) == attempt
        assert Charge.objects.count() == 0
        assert not IdempotencyRecord.objects.filter(key=key).exists()


@pytest.mark.usefixtures("capped")
def test_a_step_result_too_large_rolls_the_step_back_and_keeps_the_steps_before_it():
    limit = packet()
    ran: list[str] = []

    def ship() -> str:
        ran.append("ship")
        Charge.objects.create(account="shipped", amount=1, currency="EUR")
        return "label"

    def manifest() -> str:
        ran.append("manifest")
        Charge.objects.create(account="manifest", amount=1, currency="EUR")
        return "x" * (limit + MIB)

    def order() -> str:
        step("ship", ship)
        return step("manifest", manifest)

    key = new_key()
    for attempt in (1, 2):
        with pytest.raises(OutcomeTooLarge):
            run_once(order, account="a", operation="steps", key=key, recovery="resume")
        # The first step ran once and stays recorded; the second ran each time, rolled back.
        assert ran.count("ship") == 1
        assert ran.count("manifest") == attempt
        assert list(Charge.objects.values_list("account", flat=True)) == ["shipped"]
        assert IdempotencyStep.objects.filter(name="ship").count() == 1
        assert not IdempotencyStep.objects.filter(name="manifest").exists()


@pytest.mark.usefixtures("capped")
def test_a_resumable_result_too_large_gives_its_lease_back_and_keeps_its_steps():
    limit = packet()
    ran: list[str] = []

    def ship() -> str:
        ran.append("ship")
        return "label"

    def order() -> str:
        step("ship", ship)
        ran.append("body")
        return "x" * (limit + MIB)

    key = new_key()
    for attempt in (1, 2):
        # The retry resumes at once (never InProgress for a whole lease) and ends the same.
        with pytest.raises(OutcomeTooLarge):
            run_once(order, account="a", operation="resume-large", key=key, recovery="resume")
        assert (ran.count("ship"), ran.count("body")) == (1, attempt)
        record = IdempotencyRecord.objects.get(key=key)
        assert record.status == "in_progress"
        assert record.lease_expires_at <= timezone.now()  # given back
        assert IdempotencyStep.objects.filter(record=record, name="ship").count() == 1


@pytest.mark.usefixtures("capped")
def test_an_outbox_message_too_large_for_the_database_is_refused_and_the_transaction_goes_on():
    # Sent, it would make the server drop the connection: inside a protected body, a 503
    # whose retry runs the body again (the server's answer is a lost connection when the
    # write loses the race).
    connection.ensure_connection()
    raw = connection.connection
    with transaction.atomic():
        with pytest.raises(TypeError, match="too large"):
            outbox.enqueue("tests.record_effect", "x" * (packet() + MIB))
        Charge.objects.create(account="after", amount=1, currency="EUR")
    assert connection.connection is raw
    assert not OutboxMessage.objects.exists()
    assert Charge.objects.filter(account="after").count() == 1


@mysql_only
def test_a_clear_response_too_large_once_sealed_is_left_clear_and_the_rotation_goes_on():
    pytest.importorskip("cryptography.fernet")
    # Kept in the clear (its escaped size fits); sealed, its bytes are random, 7 in 256 of
    # them escaped: no longer.
    size = packet() - 32 * 1024
    big = RecordFactory(response_headers=[], response_body=b"x" * size, completed_at=timezone.now())
    small = RecordFactory(response_headers=[], response_body=b"y", completed_at=timezone.now())
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [NEW]}):
        for _ in range(2):  # stopped at nothing, and run again: the same
            result = crypto.rotate(using="default")
            assert (result.records, result.too_large) == (0 if _ else 1, 1)
            stored = dict(IdempotencyRecord.objects.values_list("pk", "response_headers"))
            assert crypto.sealed_with(stored[small.pk]) is not None
            assert stored[big.pk] == []  # in the clear, as it was
        assert bytes(IdempotencyRecord.objects.get(pk=big.pk).response_body) == b"x" * size


@pytest.mark.usefixtures("capped")
def test_a_task_whose_result_is_too_large_ends_with_an_error_and_frees_its_unique_key():
    pytest.importorskip("celery")
    from tests.testapp.tasks import large_result

    size = packet() + MIB
    with transaction.atomic():
        first = outbox.enqueue_once("k", large_result, size)
    OutboxMessage.objects.filter(pk=first).update(status=OutboxStatus.SENT, sent_at=timezone.now())
    with pytest.raises(OutcomeTooLarge):
        large_result.apply(args=(size,), task_id=str(first), throw=True)
    assert not ProviderCall.objects.exists()  # rolled back
    # Every run of it ends the same way: as any run that ended with an error, it no longer
    # holds its key (its record released, the key would be held for the task's TTL).
    assert OutboxUniqueKey.objects.get().finished_at is not None
    with transaction.atomic():
        assert outbox.enqueue_once("k", large_result, 1) != first


@pytest.mark.usefixtures("capped")
@UNLIMITED
def test_a_recovery_answer_too_large_is_refused_and_the_view_never_runs_again(api):
    key = "huge-" + new_key()
    with crash_after("tests.testapp.provider.charge"):
        api.post("/charges/callable-policy/", {"amount": 5, "currency": "EUR"}, key=key)
    for _ in range(2):  # the policy asked again, its answer refused again
        expire_lease(key)
        response = api.post("/charges/callable-policy/", {"amount": 5, "currency": "EUR"}, key=key)
        not_storable(response)
        assert ProviderCharge.objects.count() == 1  # the crashed attempt's call only
        assert Charge.objects.count() == 0
        record = IdempotencyRecord.objects.get(key=key)
        assert record.status == "in_progress"
        assert record.lease_expires_at <= timezone.now()  # given back


@pytest.mark.skipif(connection.vendor == "mysql", reason="the others' limit is a gigabyte")
@UNLIMITED
def test_elsewhere_a_response_this_large_is_stored(api):
    size = 17 * MIB
    key = new_key()
    first = api.post("/outcome/", {"size": size}, key=key)
    assert first.status_code == 200
    assert len(IdempotencyRecord.objects.get(key=key).response_body) == size
    assert Charge.objects.count() == 1


@pytest.mark.parametrize(("limit", "warned"), [(65536, True), (1024 * 1024, False)])
def test_check_database_warns_of_a_server_that_takes_less_than_a_mebibyte(
    capped, monkeypatch, limit, warned
):
    check = ("check", "--database", "default", "--tag", "database", "--fail-level", "WARNING")
    if connection.vendor == "mysql":
        call_command(*check)  # the tests' server, 16 MiB: quiet
    # The check reads the limit as a server set so answers it.
    monkeypatch.setattr(type(of("default")), "packet_limit_sql", f"SELECT {limit}")
    if not warned:
        call_command(*check)
        return
    with pytest.raises(SystemCheckError, match=r"django_idempotency\.W040") as raised:
        call_command(*check)
    assert f"{limit} bytes (max_allowed_packet)" in str(raised.value)
