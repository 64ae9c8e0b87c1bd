"""GitHub webhooks: ``X-Hub-Signature-256`` verified, run once per ``X-GitHub-Delivery``
and body.

GitHub's redelivery of a delivery keeps its ``X-GitHub-Delivery`` and its body. The HMAC
covers the body only, not the delivery header: it proves that GitHub sent this body, not
that it sent it with this id. So the key is the id and a digest of the body: a body sent
under an id it was not delivered with claims a key of its own, never the genuine delivery's.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from django_idempotency import sources
from django_idempotency.decorators import idempotent
from example_project.recipes.models import WebhookEvent
from example_project.recipes.webhooks import verify_before_claim


def github_signature(secret: str, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` value GitHub sends with ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def github_signature_error(request: HttpRequest) -> str | None:
    """Why the ``X-Hub-Signature-256`` is not the body's HMAC, or ``None``."""
    expected = github_signature(settings.GITHUB_WEBHOOK_SECRET, request.body)
    given = request.headers.get("X-Hub-Signature-256", "")
    # Bytes on both sides: compare_digest refuses a str that is not ASCII.
    if hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogatepass")):
        return None
    return "X-Hub-Signature-256 is not the HMAC of the body."


DELIVERY = sources.header("X-GitHub-Delivery")


def github_delivery_key(request: HttpRequest) -> str | None:
    """The key of a delivery: its ``X-GitHub-Delivery`` and a digest of its body (``None``
    without the header: a missing key). A redelivery, the same id and body, has the same."""
    delivery = DELIVERY(request)
    if delivery is None:
        return None
    return f"{delivery}:{hashlib.sha256(request.body).hexdigest()[:32]}"


# What the answer to a delivery without the header names as missing.
github_delivery_key.description = DELIVERY.description  # type: ignore[attr-defined]


# --8<-- [start:view]
@csrf_exempt
@require_POST
@verify_before_claim(github_signature_error)
@idempotent(
    operation="webhooks.github",
    key=github_delivery_key,
    account=sources.fixed("webhook:github"),
    ttl=timedelta(days=7),
)
def github_webhook(request: HttpRequest) -> HttpResponse:
    """Handle one GitHub delivery; a redelivery gets this answer again, marked replayed."""
    delivery = request.headers["X-GitHub-Delivery"]
    event = request.headers.get("X-GitHub-Event", "")
    WebhookEvent.objects.create(sender="github", event_id=delivery, type=event)
    return JsonResponse({"received": delivery}, status=202)
    # --8<-- [end:view]
