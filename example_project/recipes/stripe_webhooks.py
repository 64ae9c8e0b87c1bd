"""Stripe webhooks: verified with the ``stripe`` package, run once per event id.

Stripe retries a delivery for up to three days, and the event's ``id`` in the JSON body is
the same on every retry. The signature is checked **before** the claim, by a decorator
outside ``@idempotent``: a forged delivery carrying a genuine event id is refused and never
claims that id, so it cannot block the real delivery.
"""

from __future__ import annotations

from datetime import timedelta

import stripe
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from django_idempotency import sources
from django_idempotency.decorators import idempotent
from example_project.recipes.models import WebhookEvent
from example_project.recipes.webhooks import verify_before_claim


def stripe_signature_error(request: HttpRequest) -> str | None:
    """Why the ``Stripe-Signature`` does not verify, or ``None``; the verified event is
    handed to the view as ``request.stripe_event``."""
    try:
        request.stripe_event = stripe.Webhook.construct_event(  # type: ignore[attr-defined]
            request.body,
            request.headers.get("Stripe-Signature", ""),
            settings.STRIPE_WEBHOOK_SECRET,
        )
    except (ValueError, stripe.SignatureVerificationError) as exc:
        return f"Stripe-Signature: {exc}"
    return None


# --8<-- [start:view]
@csrf_exempt
@require_POST
@verify_before_claim(stripe_signature_error)
@idempotent(
    operation="webhooks.stripe",
    key=sources.json("id"),
    account=sources.fixed("webhook:stripe"),
    fingerprint=sources.same_delivery,
    ttl=timedelta(days=4),  # longer than Stripe's three days of retries
)
def stripe_webhook(request: HttpRequest) -> HttpResponse:
    """Handle one Stripe event; a redelivery gets this answer again, marked replayed."""
    event = request.stripe_event  # type: ignore[attr-defined]
    WebhookEvent.objects.create(sender="stripe", event_id=event.id, type=event.type)
    return JsonResponse({"received": event.id})
    # --8<-- [end:view]
