"""RFC 9457 ``application/problem+json`` answers, each with a stable ``code``."""

from __future__ import annotations

import json
from dataclasses import dataclass

from django.http import HttpResponse

PROBLEM_CONTENT_TYPE = "application/problem+json"


@dataclass(frozen=True)
class Problem:
    """One kind of error this package answers with; ``code`` never changes between versions."""

    code: str
    status: int
    title: str

    @property
    def type(self) -> str:
        return f"urn:django-idempotency:{self.code}"

    def body(self, detail: str) -> bytes:
        """The problem+json document, compact."""
        document = {
            "type": self.type,
            "title": self.title,
            "status": self.status,
            "detail": detail,
            "code": self.code,
        }
        return json.dumps(document, separators=(",", ":")).encode()

    def response(self, detail: str, retry_after: int | None = None) -> HttpResponse:
        """The problem+json response, with ``Retry-After`` when the client should come back."""
        response = HttpResponse(
            self.body(detail), status=self.status, content_type=PROBLEM_CONTENT_TYPE
        )
        if retry_after is not None:
            response["Retry-After"] = str(retry_after)
        return response


# The titles name no header: the key may come from another header, the JSON body or a form
# field (django_idempotency.sources); the detail says which.
KEY_MISSING = Problem("idempotency_key_missing", 400, "Idempotency key required")
KEY_INVALID = Problem("idempotency_key_invalid", 400, "Invalid idempotency key")
ACCOUNT_MISSING = Problem(
    "idempotency_account_missing", 403, "Idempotency keys need an identified caller"
)
ACCOUNT_INVALID = Problem(
    "idempotency_account_invalid", 500, "The caller's account could not be named"
)
FINGERPRINT_INVALID = Problem(
    "idempotency_fingerprint_invalid", 500, "The request's fingerprint could not be made"
)
KEY_REUSED = Problem(
    "idempotency_key_reused", 422, "Idempotency-Key reused with a different request"
)
KEY_IN_USE = Problem("idempotency_key_in_use", 409, "A request with this key is in progress")
LEASE_LOST = Problem(
    "idempotency_lease_lost", 409, "This attempt lost its lease to a newer attempt"
)
OUTCOME_UNKNOWN = Problem(
    "idempotency_outcome_unknown", 500, "The outcome of the original request is unknown"
)
RESPONSE_NOT_STORABLE = Problem(
    "idempotency_response_not_storable", 500, "The response could not be stored for replay"
)
RECORD_UNREADABLE = Problem(
    "idempotency_record_unreadable", 503, "The stored outcome of this key cannot be read"
)
STORE_UNAVAILABLE = Problem(
    "idempotency_store_unavailable", 503, "The idempotency store is unavailable"
)

# What a client is told, in the detail of the refusals whose cause is the server's: what it
# can do, never the server's settings, key ids, hosts or SQL (the log and `check` carry
# those).
NOT_RUN = (
    "The request was not run because its idempotency key could not be recorded. "
    "Retry with the same key."
)
RAN_NOT_RECORDED = (
    "The request ran, but its outcome could not be recorded, so its database work was "
    "rolled back. Retry with the same key."
)
UNREADABLE = (
    "The outcome of this key is stored but cannot be read back at the moment; it was not "
    "run again. Retry with the same key later."
)


def store_unavailable_detail(ran: bool) -> str:
    """The detail of an ``idempotency_store_unavailable`` answer: whether the request ran."""
    return RAN_NOT_RECORDED if ran else NOT_RUN


ALL_PROBLEMS = (
    KEY_MISSING,
    KEY_INVALID,
    ACCOUNT_MISSING,
    ACCOUNT_INVALID,
    FINGERPRINT_INVALID,
    KEY_REUSED,
    KEY_IN_USE,
    LEASE_LOST,
    OUTCOME_UNKNOWN,
    RESPONSE_NOT_STORABLE,
    RECORD_UNREADABLE,
    STORE_UNAVAILABLE,
)
