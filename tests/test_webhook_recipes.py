"""The webhook recipes (``example_project/recipes/``): Stripe, GitHub and Standard Webhooks.

A redelivery runs its handler once and gets the stored answer; a forged delivery carrying a
genuine id is refused before any claim; concurrent deliveries of one event through a real
server run the handler once. Effects are counted as ``WebhookEvent`` rows."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

pytest.importorskip("stripe")
pytest.importorskip("standardwebhooks")
pytest.importorskip(
    "example_project.recipes", reason="the example project is not here (tox tests the wheel)"
)

from django.apps import apps

if not apps.is_installed("example_project.recipes"):
    pytest.skip("the recipes app is installed with DRF only", allow_module_level=True)

from django.conf import settings
from django.test import Client
from standardwebhooks.webhooks import Webhook

from django_idempotency.models import IdempotencyRecord
from example_project.demo_webhook import stripe_signature
from example_project.recipes.github_webhooks import github_signature
from example_project.recipes.models import WebhookEvent
from tests.helpers import postgres_only
from tests.live import Answer, gunicorn, request

STRIPE = "/webhooks/stripe/"
GITHUB = "/webhooks/github/"
STANDARD = "/webhooks/standard/"


def handled(sender: str, event_id: str) -> int:
    return WebhookEvent.objects.filter(sender=sender, event_id=event_id).count()


def records(key: str) -> int:
    return IdempotencyRecord.objects.filter(key=key).count()


def problem_code(response: Any) -> str:
    assert response["Content-Type"] == "application/problem+json", response.content
    code: str = json.loads(response.content)["code"]
    return code


# -- Stripe -----------------------------------------------------------------------------


def stripe_event(event_id: str | None = None, **extra: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "object": "event",
        "type": "payment_intent.succeeded",
        "api_version": "2024-06-20",
        "created": 1_700_000_000,
        "pending_webhooks": 1,
        "data": {"object": {"id": "pi_1", "object": "payment_intent", "amount": 1999}},
        **extra,
    }
    if event_id is not None:
        event["id"] = event_id
    return event


def signed(body: bytes, timestamp: int | None = None, secret: str = "") -> str:
    return stripe_signature(body, secret or settings.STRIPE_WEBHOOK_SECRET, timestamp)


def deliver_stripe(client: Client, event: dict[str, Any], **signature: Any) -> Any:
    body = json.dumps(event).encode()
    return client.post(
        STRIPE,
        body,
        content_type="application/json; charset=utf-8",
        headers={"Stripe-Signature": signed(body, **signature)},
    )


def new_event_id() -> str:
    return f"evt_{uuid.uuid4().hex[:24]}"


@pytest.mark.django_db
def test_stripe_redelivery_is_answered_from_the_record() -> None:
    client = Client()
    event_id = new_event_id()
    now = int(time.time())
    first = deliver_stripe(client, stripe_event(event_id), timestamp=now - 60)
    # Stripe's retry: the same event, a new signature timestamp, a changed bookkeeping field.
    again = deliver_stripe(client, stripe_event(event_id, pending_webhooks=2), timestamp=now)
    assert first.status_code == 200, first.content
    assert "Idempotent-Replayed" not in first
    assert again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content == json.dumps({"received": event_id}).encode()
    assert handled("stripe", event_id) == 1
    record = IdempotencyRecord.objects.get(key=event_id)
    assert (record.account, record.operation) == ("webhook:stripe", "webhooks.stripe")


@pytest.mark.django_db
def test_stripe_forged_delivery_claims_nothing_and_blocks_nothing() -> None:
    client = Client()
    event_id = new_event_id()
    for forged in (
        deliver_stripe(client, stripe_event(event_id), secret="whsec_not_the_secret"),
        client.post(STRIPE, json.dumps(stripe_event(event_id)), content_type="application/json"),
        deliver_stripe(client, stripe_event(event_id), timestamp=int(time.time()) - 3600),
    ):
        assert forged.status_code == 400
        assert problem_code(forged) == "webhook_signature_invalid"
    assert records(event_id) == 0
    assert handled("stripe", event_id) == 0
    genuine = deliver_stripe(client, stripe_event(event_id))
    assert genuine.status_code == 200
    assert "Idempotent-Replayed" not in genuine
    assert handled("stripe", event_id) == 1


@pytest.mark.django_db
def test_stripe_delivery_without_an_id_is_a_400() -> None:
    response = deliver_stripe(Client(), stripe_event(None))
    assert response.status_code == 400
    assert problem_code(response) == "idempotency_key_missing"
    assert not IdempotencyRecord.objects.exists()
    assert not WebhookEvent.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("bad_id", ["e" * 256, "evt_caf\u00e9", "evt 1", 1.5, True, None, {}])
def test_stripe_delivery_with_an_unusable_id_is_a_400(bad_id: Any) -> None:
    response = deliver_stripe(Client(), {**stripe_event(None), "id": bad_id})
    assert response.status_code == 400
    assert problem_code(response) == "idempotency_key_invalid"
    assert not IdempotencyRecord.objects.exists()
    assert not WebhookEvent.objects.exists()


@pytest.mark.django_db
def test_stripe_endpoint_refuses_other_methods() -> None:
    assert Client().get(STRIPE).status_code == 405
    assert not IdempotencyRecord.objects.exists()


# -- GitHub -----------------------------------------------------------------------------


def deliver_github(client: Client, delivery: str | None, body: bytes, **headers: str) -> Any:
    sent = {
        "X-GitHub-Event": "push",
        "X-Hub-Signature-256": github_signature(settings.GITHUB_WEBHOOK_SECRET, body),
    }
    if delivery is not None:
        sent["X-GitHub-Delivery"] = delivery
    sent.update(headers)
    return client.post(GITHUB, body, content_type="application/json", headers=sent)


@pytest.mark.django_db
def test_github_redelivery_is_answered_from_the_record() -> None:
    client = Client()
    delivery = str(uuid.uuid4())
    body = json.dumps({"ref": "refs/heads/main", "after": "abc"}).encode()
    first = deliver_github(client, delivery, body)
    again = deliver_github(client, delivery, body)
    assert first.status_code == again.status_code == 202
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert handled("github", delivery) == 1
    # Another delivery (a new push) is another event.
    assert deliver_github(client, str(uuid.uuid4()), body).status_code == 202
    assert WebhookEvent.objects.filter(sender="github").count() == 2


@pytest.mark.django_db
@pytest.mark.parametrize(
    "signature", ["", "sha256=0", "sha1=abc", "sha256=caf\u00e9", "sha256=" + "0" * 64]
)
def test_github_forged_delivery_claims_nothing(signature: str) -> None:
    client = Client()
    delivery = str(uuid.uuid4())
    body = b'{"ref": "refs/heads/main"}'
    forged = deliver_github(client, delivery, body, **{"X-Hub-Signature-256": signature})
    assert forged.status_code == 400
    assert problem_code(forged) == "webhook_signature_invalid"
    assert not IdempotencyRecord.objects.filter(key__startswith=delivery).exists()
    assert deliver_github(client, delivery, body).status_code == 202
    assert handled("github", delivery) == 1


@pytest.mark.django_db
def test_github_a_signed_body_sent_under_another_deliverys_id_does_not_block_it() -> None:
    # GitHub signs the body, not X-GitHub-Delivery (which is the event's id, the same for
    # every hook subscribed to the event). Someone holding any genuine delivery (a body and
    # its signature, captured or copied from wherever deliveries are logged) can send its
    # body under the id of a delivery still to come (a failed one awaiting redelivery,
    # another hook's delivery of the same event): the signature
    # verifies, and under a key of the id alone with the constant fingerprint
    # (same_delivery) it claimed that id, and the genuine delivery was answered the
    # other body's stored 202, its handler never run.
    client = Client()
    captured = json.dumps({"ref": "refs/heads/main", "after": "old"}).encode()
    assert deliver_github(client, str(uuid.uuid4()), captured).status_code == 202
    pending = str(uuid.uuid4())
    replayed_body = deliver_github(client, pending, captured)
    assert replayed_body.status_code == 202  # a genuine body runs (documented below)
    genuine = deliver_github(client, pending, b'{"ref": "refs/heads/main", "after": "new"}')
    assert genuine.status_code == 202
    assert "Idempotent-Replayed" not in genuine  # its handler ran
    assert handled("github", pending) == 2
    # Its redelivery (the same body, signature and id) is answered from its record.
    again = deliver_github(client, pending, b'{"ref": "refs/heads/main", "after": "new"}')
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == genuine.content
    assert handled("github", pending) == 2


@pytest.mark.django_db
def test_github_delivery_header_missing_or_unusable() -> None:
    client = Client()
    body = b"{}"
    missing = deliver_github(client, None, body)
    assert missing.status_code == 400
    assert problem_code(missing) == "idempotency_key_missing"
    assert "X-GitHub-Delivery header" in json.loads(missing.content)["detail"]
    for bad in ("d" * 256, "a b", "\u00e9t\u00e9"):
        response = deliver_github(client, bad, body)
        assert response.status_code == 400
        assert problem_code(response) == "idempotency_key_invalid"
    assert not IdempotencyRecord.objects.exists()
    assert not WebhookEvent.objects.exists()


# -- Standard Webhooks --------------------------------------------------------------------


def deliver_standard(
    client: Client, message_id: str, payload: dict[str, Any], at: datetime | None = None
) -> Any:
    body = json.dumps(payload)
    when = at or datetime.now(tz=timezone.utc)
    signature = Webhook(settings.STANDARD_WEBHOOK_SECRET).sign(message_id, when, body)
    headers = {
        "webhook-id": message_id,
        "webhook-timestamp": str(int(when.timestamp())),
        "webhook-signature": signature,
    }
    return client.post(STANDARD, body, content_type="application/json", headers=headers)


@pytest.mark.django_db
def test_standard_webhook_retry_is_answered_from_the_record() -> None:
    client = Client()
    message_id = f"msg_{uuid.uuid4().hex}"
    payload = {"type": "invoice.paid", "data": {"invoice": 7}}
    now = datetime.now(tz=timezone.utc)
    first = deliver_standard(client, message_id, payload, at=now - timedelta(seconds=90))
    again = deliver_standard(client, message_id, payload, at=now)  # a new signature
    assert first.status_code == again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert handled("standard", message_id) == 1
    assert WebhookEvent.objects.get().type == "invoice.paid"


@pytest.mark.django_db
def test_standard_webhook_forged_delivery_claims_nothing() -> None:
    client = Client()
    message_id = f"msg_{uuid.uuid4().hex}"
    payload = {"type": "invoice.paid"}
    # A genuine signature of another message id: the id is signed, so it does not verify.
    genuine = deliver_standard(client, f"msg_{uuid.uuid4().hex}", payload)
    assert genuine.status_code == 200
    body = json.dumps(payload)
    forged_headers = {
        "webhook-id": message_id,
        "webhook-timestamp": str(int(time.time())),
        "webhook-signature": "v1,bm90LWEtc2lnbmF0dXJl",
    }
    for headers in (forged_headers, {**forged_headers, "webhook-signature": "garbage"}):
        forged = client.post(STANDARD, body, content_type="application/json", headers=headers)
        assert forged.status_code == 400
        assert problem_code(forged) == "webhook_signature_invalid"
    assert records(message_id) == 0
    assert deliver_standard(client, message_id, payload).status_code == 200
    assert handled("standard", message_id) == 1


# -- concurrent deliveries through a real server -------------------------------------------


@pytest.fixture
def webhook_server(django_db_setup: Any, django_db_blocker: Any) -> Iterator[str]:
    with (
        django_db_blocker.unblock(),
        # The handler lingers long enough that, even on a loaded machine, deliveries arrive
        # while the first one runs (the test asserts that the race really happened).
        gunicorn(workers=4, extra_env={"TEST_WEBHOOK_DELAY": "2"}) as url,
    ):
        yield url


def send_stripe(url: str, event: dict[str, Any]) -> Answer:
    # tests.live.request sends json.dumps(payload): sign exactly those bytes.
    body = json.dumps(event).encode()
    return request(url, "POST", STRIPE, event, {"Stripe-Signature": signed(body)})


@postgres_only
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_sixteen_concurrent_deliveries_run_the_handler_once(webhook_server: str) -> None:
    event_id = new_event_id()
    event = stripe_event(event_id)
    barrier = threading.Barrier(16, timeout=10)

    def deliver(_: int) -> tuple[Answer, Answer]:
        barrier.wait()
        first = answer = send_stripe(webhook_server, event)
        deadline = time.monotonic() + 30
        while answer.status == 409 and time.monotonic() < deadline:
            # What Stripe does later, sooner: redeliver with a fresh signature.
            time.sleep(0.1)
            answer = send_stripe(webhook_server, event)
        return first, answer

    with ThreadPoolExecutor(max_workers=16) as pool:
        outcomes = list(pool.map(deliver, range(16)))

    firsts = [first.status for first, _ in outcomes]
    finals = [final for _, final in outcomes]
    assert set(firsts) <= {200, 409}, firsts
    assert firsts.count(200) >= 1
    assert firsts.count(409) >= 1, "no delivery arrived while the first one ran"
    assert [final.status for final in finals] == [200] * 16
    assert {final.body for final in finals} == {json.dumps({"received": event_id}).encode()}
    assert sum(not final.replayed for final in finals) == 1
    assert handled("stripe", event_id) == 1
    assert records(event_id) == 1
