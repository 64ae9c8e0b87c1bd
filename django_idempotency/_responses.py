"""Responses as outcomes: what of a response is stored, and the replay that gives it back.

A response is storable when it is a complete ``HttpResponse`` within ``MAX_RESPONSE_BYTES``;
its status, the headers of ``stored_headers()`` in their spelling and its body bytes are the
outcome (:class:`._outcomes.Outcome`), and a replay is built from exactly those, marked
``Idempotent-Replayed: true``.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from django.http.response import HttpResponseBase

from django_idempotency import _store
from django_idempotency._outcomes import Outcome
from django_idempotency.conf import app_settings
from django_idempotency.states import COMPLETED

REPLAYED_HEADER = "Idempotent-Replayed"


def rendered(response: HttpResponseBase) -> HttpResponseBase:
    """The response, rendered if it is a template or DRF response not rendered yet."""
    render = getattr(response, "render", None)
    if callable(render) and not getattr(response, "is_rendered", True):
        render()
    return response


def is_storable(response: HttpResponseBase) -> bool:
    """Whether a response is a deterministic outcome that can be kept and replayed."""
    status = response.status_code
    if status >= 500 or status in app_settings.TRANSIENT_STATUSES:
        return False
    if not isinstance(response, HttpResponse):  # streaming and file responses
        return False
    limit = app_settings.MAX_RESPONSE_BYTES
    return limit is None or len(response.content) <= limit


def stored_headers(response: HttpResponseBase) -> list[list[str]]:
    """The headers kept with a response: ``Content-Type``, ``Location`` and the allow-list."""
    return [[name, response[name]] for name in app_settings.stored_headers if name in response]


def _outcome(response: HttpResponse, status: str) -> Outcome:
    return Outcome(response.status_code, stored_headers(response), response.content, status)


def outcome_of(response: Any) -> Outcome | None:
    """What is stored for a response, or ``None`` when it cannot be kept and replayed."""
    if not isinstance(response, HttpResponseBase):
        return None
    response = rendered(response)
    if not isinstance(response, HttpResponse) or not is_storable(response):
        return None
    return _outcome(response, COMPLETED)


def response_of(outcome: Outcome) -> HttpResponse:
    return _stored(outcome.body, outcome.response_status, outcome.headers)


def _stored(body: bytes, status: int, headers: list[list[str]]) -> HttpResponse:
    """A response with exactly the stored headers, in their order and spelling.

    A stored ``Content-Type`` (the usual first one) is given to the constructor: no default
    of the response's own to remove (nor the charset setting it reads). Otherwise the
    default is removed and every stored header set.
    """
    if headers and headers[0][0] == "Content-Type":
        response = HttpResponse(body, status=status, content_type=headers[0][1])
        rest = headers[1:]
    else:
        response = HttpResponse(body, status=status)
        del response["Content-Type"]
        rest = headers
    for name, value in rest:
        response[name] = value
    return response


def replay_response(state: _store.RecordState) -> HttpResponse:
    """The stored outcome as a response: same status, same body bytes, same stored headers."""
    assert state.response_status is not None
    response = _stored(state.response_body or b"", state.response_status, state.response_headers)
    response[REPLAYED_HEADER] = "true"
    return response
