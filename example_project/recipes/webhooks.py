"""What the webhook recipes share: the signature check before the claim and the answer to a
delivery whose signature does not verify. Their fingerprint is the package's
``sources.same_delivery``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

SIGNATURE_INVALID = "webhook_signature_invalid"


def signature_refused(detail: str) -> JsonResponse:
    """``400`` problem+json for a delivery the sender did not sign: nothing was claimed."""
    return JsonResponse(
        {
            "type": f"urn:example:{SIGNATURE_INVALID}",
            "title": "The webhook's signature does not verify.",
            "status": 400,
            "detail": detail,
            "code": SIGNATURE_INVALID,
        },
        status=400,
        content_type="application/problem+json",
    )


def verify_before_claim(
    signature_error: Callable[[HttpRequest], str | None],
) -> Callable[[Callable[..., HttpResponse]], Callable[..., HttpResponse]]:
    """A view decorator that refuses a delivery when ``signature_error(request)`` says why
    its signature does not verify, and else calls the view.

    Put it above ``@idempotent``: the check runs before the claim, so a forged delivery
    carrying a genuine event id never claims that id and cannot block the real delivery.
    """

    def decorate(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @functools.wraps(view)
        def verified(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            error = signature_error(request)
            if error is not None:
                return signature_refused(error)
            return view(request, *args, **kwargs)

        return verified

    return decorate
