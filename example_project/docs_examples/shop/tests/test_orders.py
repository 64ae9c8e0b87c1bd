"""The shop's orders under six of the eight scenarios that break idempotency (the other two
are in ``test_orders_testcase.py``, in Django's ``TestCase`` style). Each counts the shop's
own side effects: payments at the gateway, orders, confirmation messages."""

from __future__ import annotations

from typing import Any

# --8<-- [start:module]
import pytest
from django.db import connection

from django_idempotency.models import OutboxMessage
from django_idempotency.testing import (
    assert_accounts_isolated,
    assert_idempotent,
    assert_problem,
    assert_replay,
    assert_single_execution,
    crash_after,
    expire_lease,
    login_headers,
    new_key,
    pause_after,
    send,
    settle,
    storm,
)
from example_project.docs_examples.shop.models import Order

ORDERS = "/shop/orders/"
ORDER = {"item": "teapot", "amount": 2500, "currency": "EUR"}
# Where the view looks the gateway up: what the crash and pause helpers patch.
GATEWAY = "example_project.docs_examples.shop.payments.charge"

# Through a live server each request runs in a thread with a connection of its own: the
# test's data must be committed (transaction=True) and the database must run transactions
# side by side, which SQLite cannot.
concurrent = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="needs concurrent transactions (PostgreSQL)"
)


def order(client: Any, key: str, payload: dict[str, Any] = ORDER) -> Any:
    return client.post(
        ORDERS, payload, content_type="application/json", headers={"Idempotency-Key": key}
    )


def confirmations() -> int:
    return OutboxMessage.objects.filter(task="shop.send_confirmation").count()


# --8<-- [end:module]


# --8<-- [start:storm]
@concurrent
@pytest.mark.django_db(transaction=True)
def test_two_simultaneous_requests_pay_once(live_server, alice, gateway):
    headers = {**login_headers(alice), "Idempotency-Key": new_key()}
    answers = storm(live_server.url, ORDERS, ORDER, headers=headers, requests=8)
    ran = assert_single_execution(answers)  # the others: 409 in progress, or its replay
    assert ran.status == 201
    assert len(gateway.effects) == 1
    assert Order.objects.count() == 1
    assert confirmations() == 1
    # --8<-- [end:storm]


# --8<-- [start:changed-payload]
@pytest.mark.django_db
def test_a_changed_payload_is_refused(as_alice, gateway):
    check = assert_idempotent(as_alice, ORDERS, ORDER, changed={**ORDER, "amount": 1})
    assert check.first.status_code == 201
    assert len(gateway.calls) == 1  # the replay and the refusal never reached the gateway
    assert Order.objects.count() == 1
    assert confirmations() == 1
    # --8<-- [end:changed-payload]


# --8<-- [start:timeout]
@concurrent
@pytest.mark.django_db(transaction=True)
def test_a_timeout_after_the_payment(live_server, alice, gateway):
    headers = {**login_headers(alice), "Idempotency-Key": new_key()}
    with pause_after(GATEWAY) as paid:
        gave_up = send(live_server.url, ORDERS, ORDER, headers=headers, timeout=0.5)
        paid.wait()  # the gateway took the payment; the answer is still on its way
        assert gave_up.error == "timed out"
        retry = send(live_server.url, ORDERS, ORDER, headers=headers, timeout=5)
        assert_problem(retry, "idempotency_key_in_use", 409)  # the original still runs
    outcome = settle(live_server.url, ORDERS, ORDER, headers=headers)  # retry past the 409s
    assert (outcome.status, outcome.replayed) == (201, True)
    assert len(gateway.calls) == 1
    assert Order.objects.count() == 1
    # --8<-- [end:timeout]


# --8<-- [start:crash]
@pytest.mark.django_db
def test_a_crash_in_progress_holds_the_key(as_alice, gateway):
    key = new_key()
    with crash_after(GATEWAY):  # the process dies right after the payment
        order(as_alice, key)
    assert len(gateway.effects) == 1  # the customer paid...
    assert Order.objects.count() == 0  # ...and the order rolled back with the attempt
    assert confirmations() == 0
    retry = order(as_alice, key)  # while the dead attempt's lease runs
    assert_problem(retry, "idempotency_key_in_use", 409)
    assert len(gateway.calls) == 1
    # --8<-- [end:crash]


# --8<-- [start:lease]
@pytest.mark.django_db
def test_after_the_lease_the_retry_policy_pays_once(as_alice, gateway):
    key = new_key()
    with crash_after(GATEWAY):
        order(as_alice, key)
    expire_lease(key)  # no sleeping: the dead attempt's lease ran out
    retry = order(as_alice, key)
    assert retry.status_code == 201  # "retry", the default policy: the view ran again...
    assert len(gateway.calls) == 2  # ...and called the gateway again, with the same key,
    assert len(gateway.effects) == 1  # so the customer paid once
    assert Order.objects.count() == 1
    assert confirmations() == 1
    assert_replay(retry, order(as_alice, key))
    # --8<-- [end:lease]


# --8<-- [start:tenants]
@pytest.mark.django_db
def test_one_key_from_two_customers_is_two_orders(as_alice, as_bob, gateway):
    alices, bobs = assert_accounts_isolated([as_alice, as_bob], ORDERS, ORDER)
    assert alices.key == bobs.key
    assert alices.first.json()["id"] != bobs.first.json()["id"]  # nobody sees another's
    assert len(gateway.effects) == 2  # each paid for their own order
    assert Order.objects.count() == 2
    # --8<-- [end:tenants]
