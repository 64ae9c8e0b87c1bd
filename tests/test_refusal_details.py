"""What a client is told: a refusal says what the client can do (retry, when, with what),
never the server's settings, key ids, hosts or SQL, which go to the log and to ``check``.
``idempotency_store_unavailable`` says that nothing ran only where nothing ran.

Each refusal whose cause is the server's is driven here over HTTP (and, for a tool call,
through the MCP wrapper), counting the operation's effects beside what the body says.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.test import Client, override_settings

from django_idempotency import _problems
from django_idempotency.models import IdempotencyRecord
from tests.helpers import is_completion, new_key, says_nothing_of_the_server
from tests.testapp.models import Charge, ProviderCall, ProviderCharge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")
CHARGE = {"amount": 5, "currency": "EUR"}


@pytest.fixture
def post(user: Any) -> Any:
    client = Client()
    client.force_login(user)

    def post(key: str, **headers: str) -> Any:
        return client.post(
            "/charges/",
            CHARGE,
            content_type="application/json",
            headers={"Idempotency-Key": key, **headers},
        )

    return post


def problem(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.content
    body: dict[str, Any] = json.loads(response.content)
    assert body["code"] == code
    says_nothing_of_the_server(body)
    return body


def test_a_response_too_large_to_keep_names_no_setting(post):
    with override_settings(IDEMPOTENCY={"MAX_RESPONSE_BYTES": 10}):
        body = problem(post(new_key()), 500, "idempotency_response_not_storable")
    assert "larger than" in body["detail"]
    assert Charge.objects.count() == 0  # rolled back
    assert IdempotencyRecord.objects.count() == 0


def failing_completion(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
    if is_completion(sql):
        raise OperationalError(
            f'UPDATE "django_idempotency_record" SET ... on host {connection.settings_dict["NAME"]}'
        )
    return execute(sql, params, many, context)


def test_after_the_view_ran_store_unavailable_says_it_ran_and_shows_no_sql(post, caplog):
    key = new_key()
    caplog.set_level(logging.ERROR, logger="django_idempotency")
    with connection.execute_wrapper(failing_completion):
        body = problem(post(key), 503, "idempotency_store_unavailable")
    assert body["detail"] == _problems.RAN_NOT_RECORDED
    assert "not run" not in body["detail"]
    assert "nothing ran" not in body["detail"]
    assert ProviderCall.objects.count() == 1  # the view ran: its provider call was made
    assert Charge.objects.count() == 0  # its database work was rolled back
    assert "django_idempotency_record" in caplog.text  # the log keeps the cause
    assert post(key).status_code == 201  # the retry runs it again, as the detail says
    assert Charge.objects.count() == 1


def failing_claim(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
    # The claim: PostgreSQL's server-side function, elsewhere the INSERT of the record.
    claiming = "django_idempotency_record_claim" in sql or (
        "INSERT" in sql.upper() and "django_idempotency_record" in sql
    )
    if claiming:
        raise OperationalError(f"could not connect to server {connection.settings_dict['NAME']}")
    return execute(sql, params, many, context)


def test_a_claim_that_fails_says_nothing_ran(post):
    with connection.execute_wrapper(failing_claim):
        body = problem(post(new_key()), 503, "idempotency_store_unavailable")
    assert body["detail"] == _problems.NOT_RUN
    assert ProviderCall.objects.count() == 0
    assert Charge.objects.count() == 0


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's session timeout")
def test_a_session_the_server_ends_while_the_view_runs_is_a_503_saying_the_view_ran(post):
    """``idle_in_transaction_session_timeout`` ends the request's session while its view
    waits inside its transaction: the completion fails after the view ran. The answer says
    so (never "nothing ran"), and the retry runs the view again, as the docs say; the
    provider, called with the derived key, charges once."""
    key = new_key()
    with connection.cursor() as cursor:
        cursor.execute("SET idle_in_transaction_session_timeout = 300")
    ended = post(key, **{"X-Test": "sleep-after-write:1.5"})
    body = problem(ended, 503, "idempotency_store_unavailable")
    assert body["detail"] == _problems.RAN_NOT_RECORDED
    assert ProviderCall.objects.count() == 1  # the view ran
    assert Charge.objects.count() == 0  # its database work did not survive
    assert IdempotencyRecord.objects.count() == 0  # released: the retry runs afresh
    assert post(key).status_code == 201
    assert ProviderCall.objects.count() == 2  # the view ran a second time, as documented
    assert ProviderCharge.objects.count() == 1  # the derived key: one charge at the provider
    assert Charge.objects.count() == 1


# -- an operation the body runs, whose own claim cannot be recorded -------------------------


@pytest.fixture
def unreachable_claims() -> Any:
    """``CLAIM_DATABASE`` on a closed port: an operation run inside a transaction (the
    nested ``run_once`` of a protected body) cannot claim; the body's own claim, made in
    autocommit on ``DATABASE``, can."""
    from django.db import connections

    claims = connections["claims"]
    saved = dict(claims.settings_dict)
    claims.close()
    claims.settings_dict["PORT"] = "1"
    try:
        with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
            yield
    finally:
        claims.close()
        claims.settings_dict.clear()
        claims.settings_dict.update(saved)


def charge_then_ship(calls: list[str]) -> str:
    """A body that calls the provider, then runs a sub-operation of its own."""
    from django_idempotency import run_once
    from tests.testapp import provider

    calls.append("body")
    provider.charge(new_key(), 5, "EUR")
    Charge.objects.create(account="shop", amount=5, currency="EUR")
    return run_once(lambda: "shipped", account="shop", operation="orders.ship", key="ship-1")


needs_a_claim_connection = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="SQLite claims on the caller's own connection"
)


@needs_a_claim_connection
def test_a_body_whose_own_operation_cannot_claim_is_a_503_saying_the_body_ran(
    unreachable_claims,
):
    """The view ran (its provider was called) before an operation it runs could not record
    its claim: ``503 idempotency_store_unavailable`` that says the request ran, never
    "not run"; its database work rolled back and its claim released for the retry."""
    from django.test import RequestFactory

    from django_idempotency.decorators import idempotent

    calls: list[str] = []

    @idempotent(account=lambda request: "tenant:1", operation="orders.place")
    def place(request: Any) -> Any:
        from django.http import JsonResponse

        return JsonResponse({"shipped": charge_then_ship(calls)}, status=201)

    request = RequestFactory().post(
        "/orders/", "{}", content_type="application/json", headers={"Idempotency-Key": "k-1"}
    )
    body = problem(place(request), 503, "idempotency_store_unavailable")
    assert calls == ["body"]
    assert ProviderCall.objects.count() == 1  # the view ran: its provider call was made
    assert body["detail"] == _problems.RAN_NOT_RECORDED
    assert Charge.objects.count() == 0  # its database work was rolled back
    assert IdempotencyRecord.objects.count() == 0  # released: the retry runs afresh


@needs_a_claim_connection
@pytest.mark.parametrize("recovery", ["retry", "fail", "resume"])
def test_run_once_whose_body_ran_an_operation_that_cannot_claim_says_it_ran(
    unreachable_claims, recovery
):
    """The store failed after the body started: ``StoreUnavailable`` with ``ran``, and the
    claim handled as for any store failure after the body ran: released under "retry";
    under "fail" (the provider may have been called) its lease is given back, and the
    retry gets the unknown outcome, never a second run."""
    from django.utils import timezone

    from django_idempotency import OutcomeUnknown, StoreUnavailable, run_once, step
    from django_idempotency.models import RecordStatus

    calls: list[str] = []

    def body() -> str:
        if recovery == "resume":
            return str(step("charge", charge_then_ship, calls))
        return charge_then_ship(calls)

    identity = {"account": "shop", "operation": "orders.place", "key": "k-1"}
    with pytest.raises(StoreUnavailable) as raised:
        run_once(body, **identity, recovery=recovery)
    assert calls == ["body"]
    assert ProviderCall.objects.count() == 1
    assert raised.value.ran is True
    assert Charge.objects.count() == 0
    if recovery == "retry":
        assert IdempotencyRecord.objects.count() == 0  # released: the retry runs afresh
        return
    record = IdempotencyRecord.objects.get()  # kept, its lease given back
    assert record.status == RecordStatus.IN_PROGRESS
    assert record.lease_expires_at <= timezone.now()
    if recovery == "fail":
        with pytest.raises(OutcomeUnknown):
            run_once(body, **identity, recovery=recovery)
        assert calls == ["body"]
        assert ProviderCall.objects.count() == 1


@pytest.mark.parametrize("recovery", ["retry", "fail"])
def test_a_body_whose_own_operation_cannot_be_read_back_keeps_the_claim_for_its_policy(
    recovery,
):
    """An operation the body runs finds its outcome sealed with a key no longer configured
    (``RecordUnreadable``), after the body's provider call: the store cannot answer, as
    when it fails. Under "fail" the claim's lease is given back (the retry gets the unknown
    outcome, never a second provider call); under "retry" it is released."""
    fernet = pytest.importorskip("cryptography.fernet")
    from django.utils import timezone

    from django_idempotency import OutcomeUnknown, RecordUnreadable, run_once
    from django_idempotency.models import RecordStatus

    sealing, other = (fernet.Fernet.generate_key().decode() for _ in range(2))
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [sealing]}):
        run_once(lambda: "shipped", account="shop", operation="orders.ship", key="ship-1")
    calls: list[str] = []
    identity = {"account": "shop", "operation": "orders.place", "key": "k-1"}
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [other]}):
        with pytest.raises(RecordUnreadable):
            run_once(charge_then_ship, calls, **identity, recovery=recovery)
        assert calls == ["body"]
        assert ProviderCall.objects.count() == 1
        assert Charge.objects.count() == 0
        placed = IdempotencyRecord.objects.filter(operation="orders.place")
        if recovery == "retry":
            assert not placed.exists()  # released: the retry runs afresh
            return
        record = placed.get()  # kept, its lease given back
        assert record.status == RecordStatus.IN_PROGRESS
        assert record.lease_expires_at <= timezone.now()
        with pytest.raises(OutcomeUnknown):
            run_once(charge_then_ship, calls, **identity, recovery=recovery)
    assert calls == ["body"]
    assert ProviderCall.objects.count() == 1
