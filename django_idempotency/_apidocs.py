"""The OpenAPI description of a protected operation, whatever generates the schema.

The drf-spectacular extension (:mod:`django_idempotency.openapi`) and the django-ninja
integration (:mod:`django_idempotency.ninja`) both describe a protected operation with these
parts: the key header parameter, the ``400``, ``409``, ``422`` and ``503``
``application/problem+json`` answers, ``Retry-After`` and ``Idempotent-Replayed``. This module
imports neither framework.
"""

from __future__ import annotations

from typing import Any

from django_idempotency import _options, _outcomes, _policies, _problems, sources
from django_idempotency.conf import app_settings
from django_idempotency.keys import MAX_KEY_LENGTH

#: The names of the shared problem schema and of its ``code`` enum under ``components/schemas``
#: (the enum is a component of its own, so drf-spectacular's enum hoisting leaves it alone
#: instead of naming it after the property, ``CodeEnum``).
PROBLEM_COMPONENT = "IdempotencyProblem"
CODE_COMPONENT = "IdempotencyProblemCode"

#: The statuses documented on every protected operation (``403`` and the other ``500`` codes
#: are in the ``code`` enum, but an identified client that follows the protocol never meets
#: them).
DOCUMENTED_STATUSES = (400, 409, 422, 503)

#: Documented where the operation's recovery policy closes a crashed attempt's record (``"fail"``):
#: every later retry gets the stored ``500`` ``idempotency_outcome_unknown``.
CLOSED_STATUS = _problems.OUTCOME_UNKNOWN.status

# Answers that tell the client when to come back.
_RETRY_AFTER_STATUSES = frozenset({409, 503})

#: The documented form of a key: printable ASCII without ``,`` (``k,k`` is how a header sent
#: twice arrives, refused), not starting with ``"`` (a key sent as a structured-field string,
#: ``"abc"``, is accepted too but not described by the pattern): every value it admits is
#: taken as it is. Other keys holding ``,`` are accepted too.
KEY_PATTERN = r"^[\x21\x23-\x2B\x2D-\x7E][\x21-\x2B\x2D-\x7E]*$"

_KEY_EXAMPLE = "8e03978e-40d5-43e8-bc93-6894a57f9324"


def code_schema() -> dict[str, Any]:
    """The ``code`` member of this package's problems: every code it can answer with."""
    return {
        "type": "string",
        "enum": [p.code for p in _problems.ALL_PROBLEMS],
        "description": "The stable, machine-readable reason of a django-idempotency problem.",
    }


def problem_schema(code_ref: dict[str, str]) -> dict[str, Any]:
    """The RFC 9457 problem object this package answers with; ``code_ref`` points at its code."""
    return {
        "type": "object",
        "description": (
            "An RFC 9457 problem from django-idempotency. `code` is stable and tells this "
            "package's answers apart from the view's own errors with the same status."
        ),
        "properties": {
            "type": {
                "type": "string",
                "description": "`urn:django-idempotency:<code>`.",
                "example": _problems.KEY_IN_USE.type,
            },
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "code": code_ref,
        },
        "required": ["type", "title", "status", "detail", "code"],
    }


def key_header(options: _options.Options) -> str | None:
    """The header a protected operation takes its key from: the ``HEADER`` setting's, the
    one of a ``sources.header(...)``, or ``None`` when the key is elsewhere (a webhook's
    JSON body, a form field, a function of the view's): then no key header is documented."""
    if options.key is None:
        return app_settings.HEADER
    if isinstance(options.key, sources.Header):
        return options.key.name
    return None


def key_parameter(required: bool, header: str | None = None) -> dict[str, Any]:
    """The key header parameter: ``header``, by default the ``HEADER`` setting's."""
    name = header or app_settings.HEADER
    purpose = (
        "One key per logical operation: make it when the user acts (a UUID is fine) and "
        "send the same key with every retry of that operation. A retry gets the original "
        f"response, marked `{_outcomes.REPLAYED_HEADER}: true`."
        if name.lower() == app_settings.HEADER.lower()
        else "The sender's id of this delivery, the same on every redelivery of it. A "
        f"redelivery gets the original response, marked `{_outcomes.REPLAYED_HEADER}: true`."
    )
    return {
        "in": "header",
        "name": name,
        "required": required,
        "description": (
            f"{purpose} 1 to {MAX_KEY_LENGTH} printable ASCII characters without spaces or "
            'commas; it may also be sent as a structured-field string (`"..."`).'
        ),
        "schema": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_KEY_LENGTH,
            # The bare form: every value of it the server accepts as it is.
            "pattern": KEY_PATTERN,
        },
        "example": _KEY_EXAMPLE,
    }


def replayed_header() -> dict[str, Any]:
    """The ``Idempotent-Replayed`` response header."""
    return {
        "description": (
            "`true` when this is the stored response of an earlier request with the same "
            "key, sent again; absent on the original response."
        ),
        "schema": {"type": "string", "enum": ["true"]},
    }


def retry_after_header() -> dict[str, Any]:
    """The ``Retry-After`` header of the ``409`` and ``503`` answers."""
    return {
        "description": "Seconds to wait before retrying with the same key.",
        "schema": {"type": "integer", "minimum": 0},
    }


def _problem_description(status: int, required: bool) -> str:
    if status == CLOSED_STATUS:
        problem = _problems.OUTCOME_UNKNOWN
        return (
            f"`{problem.code}`: {problem.title}. A retry after the original attempt stopped "
            "midway: whether it took effect is unknown and needs reconciliation; it is not "
            "run again, and every later retry gets this answer."
        )
    found = [
        f"`{p.code}`: {p.title}."
        for p in _problems.ALL_PROBLEMS
        if p.status == status and (required or p is not _problems.KEY_MISSING)
    ]
    return " ".join(found)


def _closes_crashed_attempts(options: _options.Options) -> bool:
    # "fail": a stale record is closed with the "outcome unknown" problem, never run again.
    declared = _policies.recovery_policy(options.recovery or app_settings.RECOVERY)
    return not declared.reruns and not declared.asks_callable


def _is_replayable(code: str) -> bool:
    # Stored and replayed: the view's statuses below 500 but the transient ones (409, 429).
    return code.isdigit() and int(code) < 500 and int(code) not in app_settings.TRANSIENT_STATUSES


def document_operation(
    operation: dict[str, Any], options: _options.Options, problem_ref: dict[str, Any]
) -> None:
    """Add the key header, the problem answers and the replay header to ``operation``.

    ``operation`` is an OpenAPI operation object whose ``responses`` are keyed by the status
    as a string; ``problem_ref`` is the schema of the problem answers (a ``$ref`` to
    :func:`problem_schema` registered as a component, or that schema itself).
    """
    required = app_settings.REQUIRED if options.required is None else options.required
    header = key_header(options)
    parameters: list[dict[str, Any]] = operation.setdefault("parameters", [])
    if header is not None and not any(
        p.get("in") == "header" and str(p.get("name", "")).lower() == header.lower()
        for p in parameters
    ):
        parameters.append(key_parameter(required, header))

    responses: dict[str, Any] = operation.setdefault("responses", {})
    # The view's own answers below 500 are stored and replayed with the marker header.
    for code, response in responses.items():
        if _is_replayable(code) and "$ref" not in response:
            response.setdefault("headers", {})[_outcomes.REPLAYED_HEADER] = replayed_header()

    statuses: tuple[int, ...] = DOCUMENTED_STATUSES
    if _closes_crashed_attempts(options):
        statuses = (*statuses, CLOSED_STATUS)
    for status in statuses:
        description = _problem_description(status, required)
        if not description:
            continue
        response = responses.setdefault(str(status), {"description": ""})
        if "$ref" in response:  # a response component of the view's: leave it alone
            continue
        response["description"] = "\n\n".join(
            filter(None, [response.get("description"), description])
        )
        response.setdefault("content", {})[_problems.PROBLEM_CONTENT_TYPE] = {"schema": problem_ref}
        if status in _RETRY_AFTER_STATUSES:
            response.setdefault("headers", {})["Retry-After"] = retry_after_header()
