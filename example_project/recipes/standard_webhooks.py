"""Standard Webhooks (Svix and others): verified with the ``standardwebhooks`` package, run
once per ``webhook-id``.

The signature covers ``webhook-id``, ``webhook-timestamp`` and the body, and a sender keeps
``webhook-id`` across its retries: a retry carries a new timestamp and signature.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from django_idempotency import sources
from django_idempotency.decorators import idempotent
from example_project.recipes.models import WebhookEvent
from example_project.recipes.webhooks import verify_before_claim


def standard_signature_error(request: HttpRequest) -> str | None:
    """Why the ``webhook-signature`` does not verify, or ``None``; the verified payload is
    handed to the view as ``request.webhook_payload``."""
    try:
        request.webhook_payload = Webhook(  # type: ignore[attr-defined]
            settings.STANDARD_WEBHOOK_SECRET
        ).verify(request.body, dict(request.headers))
    except (WebhookVerificationError, ValueError) as exc:
        return f"webhook-signature: {exc}"
    return None


# --8<-- [start:view]
@csrf_exempt
@require_POST
@verify_before_claim(standard_signature_error)
@idempotent(
    operation="webhooks.standard",
    key=sources.header("webhook-id"),
    account=sources.fixed("webhook:standard"),
    fingerprint=sources.same_delivery,
    ttl=timedelta(days=7),
)
def standard_webhook(request: HttpRequest) -> HttpResponse:
    """Handle one Standard Webhooks message; a retry gets this answer again, replayed."""
    payload = request.webhook_payload  # type: ignore[attr-defined]
    kind = payload.get("type", "") if isinstance(payload, dict) else ""
    message_id = request.headers["webhook-id"]
    WebhookEvent.objects.create(sender="standard", event_id=message_id, type=str(kind))
    return JsonResponse({"received": message_id})
    # --8<-- [end:view]
