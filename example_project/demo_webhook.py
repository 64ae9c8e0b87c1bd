"""A Stripe webhook delivered twice to the example project, and what its handler did.

Start the example server, then::

    python -m example_project.demo_webhook --url http://127.0.0.1:8000

It sends one ``payment_intent.succeeded`` event to ``/webhooks/stripe/`` as Stripe would:
first a forged copy (a wrong signature) carrying the event's genuine id, which must be refused
before it claims anything; then the genuine delivery; then Stripe's retry of it, with a new
signature timestamp, which must be answered from the record (``Idempotent-Replayed: true``,
the same body). Finally it counts, through the ORM (run it with the server's settings), the
events the handler recorded: exit status 0 when there is exactly one; 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import http.client
import json
import os
import sys
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from example_project.demo_storm import report

STRIPE = "/webhooks/stripe/"


def stripe_signature(body: bytes, secret: str, timestamp: int | None = None) -> str:
    """The ``Stripe-Signature`` header Stripe sends with ``body``: ``t=<unix time>,v1=<HMAC
    SHA-256 of "<t>.<body>" keyed with the endpoint's secret>``."""
    ts = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={ts},v1={digest}"


def deliver(url: str, body: bytes, signature: str) -> tuple[int, bool, bytes]:
    """POST one delivery; its status, whether it was replayed, and its body."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=30)
    try:
        headers = {"Content-Type": "application/json", "Stripe-Signature": signature}
        connection.request("POST", STRIPE, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        return response.status, response.getheader("Idempotent-Replayed") == "true", data
    finally:
        connection.close()


def event_payload(event_id: str) -> dict[str, Any]:
    return {
        "id": event_id,
        "object": "event",
        "type": "payment_intent.succeeded",
        "data": {"object": {"id": f"pi_{uuid.uuid4().hex[:24]}", "amount": 1999}},
    }


def summary(body: bytes) -> str:
    """A problem answer by its ``code``, any other body as it is."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")
    if isinstance(parsed, dict) and "code" in parsed:
        return str(parsed["code"])
    return body.decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    import django

    django.setup()
    from django.conf import settings

    from django_idempotency.models import IdempotencyRecord
    from example_project.recipes.models import WebhookEvent

    secret = settings.STRIPE_WEBHOOK_SECRET
    event_id = f"evt_{uuid.uuid4().hex[:24]}"
    body = json.dumps(event_payload(event_id)).encode()
    now = int(time.time())
    forged = deliver(args.url, body, stripe_signature(body, "whsec_not_the_secret", now))
    claimed_by_forgery = IdempotencyRecord.objects.filter(key=event_id).count()
    first = deliver(args.url, body, stripe_signature(body, secret, now - 30))
    retry = deliver(args.url, body, stripe_signature(body, secret, now))
    handled = WebhookEvent.objects.filter(sender="stripe", event_id=event_id).count()

    print(f"Stripe webhook: event {event_id} to POST {STRIPE}")
    for name, (status, replayed, data) in (
        ("forged signature", forged),
        ("first delivery", first),
        ("Stripe's retry", retry),
    ):
        marker = " (replayed)" if replayed else ""
        print(f"  {name:<17} {status}{marker} {summary(data)}")
    print(f"  handler ran       {handled}")
    found = []
    if forged[0] != 400:
        found.append(f"the forged delivery got {forged[0]}, not 400")
    if claimed_by_forgery:
        found.append("the forged delivery claimed the event's id")
    if first[0] != 200 or first[1]:
        found.append(f"the first delivery got {first[0]} (replayed: {first[1]}), not a fresh 200")
    if retry[0] != 200 or not retry[1] or retry[2] != first[2]:
        found.append("the retry was not answered from the record")
    if handled != 1:
        found.append(f"the handler ran {handled} times, not once")
    return report(
        found, "the forged copy claimed nothing; the retry got the stored 200; one event."
    )


if __name__ == "__main__":
    sys.exit(main())
