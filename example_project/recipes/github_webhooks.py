"""GitHub webhooks: ``X-Hub-Signature-256`` verified, run once per ``X-GitHub-Delivery``.

GitHub's redelivery of a delivery keeps its ``X-GitHub-Delivery``. The HMAC covers the body
only, not the delivery header: it proves that GitHub sent this body, and the id makes a
redelivery of it run once.
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


@csrf_exempt
@require_POST
@verify_before_claim(github_signature_error)
@idempotent(
    operation="webhooks.github",
    key=sources.header("X-GitHub-Delivery"),
    account=sources.fixed("webhook:github"),
    fingerprint=sources.same_delivery,
    ttl=timedelta(days=7),
)
def github_webhook(request: HttpRequest) -> HttpResponse:
    """Handle one GitHub delivery; a redelivery gets this answer again, marked replayed."""
    delivery = request.headers["X-GitHub-Delivery"]
    event = request.headers.get("X-GitHub-Event", "")
    WebhookEvent.objects.create(sender="github", event_id=delivery, type=event)
    return JsonResponse({"received": delivery}, status=202)
