"""Outcomes: what a record stores and answers to every retry, what of a response is stored,
the replay that gives it back, and the refusal of one that cannot be read back.

A response is storable when it is a complete ``HttpResponse`` within ``MAX_RESPONSE_BYTES``;
its status, the headers of ``stored_headers()`` in their spelling and its body bytes are the
outcome (:class:`Outcome`), and a replay is built from exactly those, marked
``Idempotent-Replayed: true``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.http import HttpResponse
from django.http.response import HttpResponseBase

from django_idempotency import _problems, signals
from django_idempotency._context import IdempotencyContext
from django_idempotency.conf import app_settings
from django_idempotency.crypto import Unreadable
from django_idempotency.exceptions import RecordUnreadable
from django_idempotency.models import IdempotencyRecord
from django_idempotency.states import COMPLETED, FAILED

if TYPE_CHECKING:
    from django_idempotency._store import RecordState

__all__ = [
    "REPLAYED_HEADER",
    "Outcome",
    "failure_outcome",
    "outcome_of",
    "refuse_unreadable",
    "rendered",
    "replay_response",
    "response_of",
]

logger = logging.getLogger("django_idempotency")


@dataclass(frozen=True)
class Outcome:
    """What is stored and answered to every retry: a status, headers and body bytes."""

    response_status: int
    headers: list[list[str]]
    body: bytes
    status: str = COMPLETED


def failure_outcome(key: str, operation: str) -> Outcome:
    """What the ``"fail"`` recovery policy stores: the "outcome unknown" problem."""
    detail = (
        f"The request with key {key!r} for {operation} stopped before it finished; whether it "
        "took effect is unknown and needs reconciliation. It will not be run again."
    )
    return Outcome(
        _problems.OUTCOME_UNKNOWN.status,
        [["Content-Type", _problems.PROBLEM_CONTENT_TYPE]],
        _problems.OUTCOME_UNKNOWN.body(detail),
        FAILED,
    )


def refuse_unreadable(
    context: IdempotencyContext, problem: Unreadable, request: Any = None
) -> RecordUnreadable:
    """Log and signal (``record_unreadable``) a retry refused because its record's stored
    outcome cannot be read back; the exception that refuses it (the HTTP side answers it as
    ``503`` ``idempotency_record_unreadable``). Nothing runs: within its TTL an outcome that
    cannot be read is never produced a second time."""
    # The record is named by its id and the sealing key by its public id: never the client's
    # key, and never a key of ENCRYPTION_KEYS.
    logger.warning(
        "the stored outcome of record %s (%s) cannot be read back (%s); the retry was "
        "refused and nothing ran%s",
        context.record_id,
        context.operation,
        problem,
        f": configure the key {problem.key_id} again" if problem.key_id else "",
        extra={"key_id": problem.key_id},
    )
    if signals.record_unreadable.has_listeners(IdempotencyRecord):
        signals.record_unreadable.send(
            sender=IdempotencyRecord,
            request=request,
            account=context.account,
            operation=context.operation,
            key=context.key,
            key_id=problem.key_id,
            reason=str(problem),
        )
    remedy = (
        f"; it is answered again once a key that opens it (id {problem.key_id}) is in "
        "ENCRYPTION_KEYS"
        if problem.key_id
        else ""
    )
    return RecordUnreadable(
        f"the outcome of key {context.key!r} for {context.operation} is stored but cannot be "
        f"read back ({problem}). It was not run again{remedy}.",
        key_id=problem.key_id,
    )


# -- responses as outcomes ------------------------------------------------------------------

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
    """The headers kept with a response: ``Content-Type``, ``Location``,
    ``Content-Encoding`` and the allow-list."""
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
    outcome = _outcome(response, COMPLETED)
    for _name, value in outcome.headers:
        if "\x00" in value:  # a NUL no JSON column of PostgreSQL's holds: never replayable
            return None
    return outcome


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


def replay_response(state: RecordState) -> HttpResponse:
    """The stored outcome as a response: same status, same body bytes, same stored headers."""
    assert state.response_status is not None
    response = _stored(state.response_body or b"", state.response_status, state.response_headers)
    response[REPLAYED_HEADER] = "true"
    return response
