"""Replays through a test client: the answer of a request, and the assertions on it."""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:
    from django.http.response import HttpResponseBase

REPLAYED = "idempotent-replayed"
PROBLEM = "application/problem+json"


def new_key() -> str:
    """A fresh idempotency key (a UUID4's hex), as a client makes one per operation."""
    return uuid.uuid4().hex


def _refuse_awaitable(pending: object) -> NoReturn:
    close = getattr(pending, "close", None)
    if callable(close):  # no "never awaited" warning later
        close()
    raise TypeError(
        "got a request still to be awaited, not a response: await an AsyncClient's request "
        "first, or, in an async test, call the helper through sync_to_async with a Client"
    )


@dataclass(frozen=True)
class Answer:
    """One answer of a live server: its status, headers (names in lower case) and body.

    ``status`` is 0 and ``error`` says why (``"timed out"``, ``"connection closed"``)
    when no answer came.
    """

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None

    @property
    def replayed(self) -> bool:
        """Whether the answer is a replay (``Idempotent-Replayed: true``)."""
        return self.headers.get(REPLAYED) == "true"

    def json(self) -> Any:
        """The body, parsed as JSON."""
        return json.loads(self.body)

    @classmethod
    def of(cls, response: Answer | HttpResponseBase) -> Answer:
        """A test client's response as an `Answer` (an `Answer` as it is).

        A streamed response is read whole and left readable again. A request still to be
        awaited (an ``AsyncClient``'s) is a ``TypeError``.
        """
        if isinstance(response, Answer):
            return response
        if inspect.isawaitable(response):
            _refuse_awaitable(response)
        body = getattr(response, "content", None)
        if body is None:  # a streamed response: read it whole, and leave it readable again
            body = b"".join(getattr(response, "streaming_content", []))
            if getattr(response, "streaming", False):
                response.streaming_content = [body]  # type: ignore[attr-defined]
        headers = {name.lower(): value for name, value in response.items()}
        return cls(response.status_code, headers, bytes(body))

    def describe(self) -> str:
        """The answer in a few words, for a failure's message."""
        if self.error:
            return f"no answer ({self.error})"
        replay = ", a replay" if self.replayed else ""
        return f"{self.status}{replay}: {self.body[:200]!r}"

    def problem_code(self) -> str | None:
        """The ``code`` of an ``application/problem+json`` answer, else ``None``."""
        if not self.headers.get("content-type", "").startswith(PROBLEM):
            return None
        try:
            code = json.loads(self.body).get("code")
        except (ValueError, AttributeError):
            return None
        return code if isinstance(code, str) else None


class RequestClient(Protocol):
    """What the helpers need of a test client: Django's ``Client`` and DRF's ``APIClient``
    both have it."""

    def generic(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        """Send one request; see ``django.test.Client.generic``."""


def _encoded(payload: Any, content_type: str) -> tuple[bytes, str]:
    if isinstance(payload, bytes):
        return payload, content_type
    if isinstance(payload, str):
        return payload.encode(), content_type
    return json.dumps(payload).encode(), content_type


def _through(
    client: RequestClient,
    method: str,
    path: str,
    payload: Any,
    key: str,
    headers: Mapping[str, str] | None,
    content_type: str,
) -> HttpResponseBase:
    from django_idempotency.conf import app_settings

    body, content_type = _encoded(payload, content_type)
    sent = {**(headers or {}), app_settings.HEADER: key}
    response: Any = client.generic(method.upper(), path, body, content_type, headers=sent)
    if inspect.isawaitable(response):
        _refuse_awaitable(response)
    result: HttpResponseBase = response
    return result


def assert_replay(original: Answer | HttpResponseBase, replay: Answer | HttpResponseBase) -> None:
    """Assert that ``replay`` replays ``original`` byte for byte.

    The same status, body bytes, ``Content-Type``, ``Location`` and ``Content-Encoding``;
    ``replay`` is marked ``Idempotent-Replayed: true`` and ``original`` is not. Takes test
    client responses and `Answer`s alike.
    """
    first, again = Answer.of(original), Answer.of(replay)
    assert first.error is None, f"the first attempt got {first.describe()}"
    assert not first.replayed, (
        f"the first attempt is itself a replay ({first.describe()}): its key was used before"
    )
    assert again.replayed, (
        f"the retry was not replayed: it got {again.describe()}, so the view ran again "
        f"(the first attempt got {first.describe()})"
    )
    assert again.status == first.status, (
        f"the replay's status is {again.status}, the first attempt's {first.status}"
    )
    assert again.body == first.body, (
        f"the replay's body differs: {again.body[:200]!r} against {first.body[:200]!r}"
    )
    for name in ("content-type", "location", "content-encoding"):
        assert again.headers.get(name) == first.headers.get(name), (
            f"the replay's {name} is {again.headers.get(name)!r}, "
            f"the first attempt's {first.headers.get(name)!r}"
        )


def assert_problem(
    response: Answer | HttpResponseBase, code: str, status: int | None = None
) -> dict[str, Any]:
    """Assert that ``response`` is one of this package's ``application/problem+json``
    answers with this ``code`` (and ``status``, when given); returns the parsed problem."""
    seen = Answer.of(response)
    assert seen.problem_code() == code, f"expected the problem {code!r}, got {seen.describe()}"
    if status is not None:
        assert seen.status == status, f"expected {status} for {code!r}, got {seen.status}"
    problem: dict[str, Any] = json.loads(seen.body)
    return problem


@dataclass(frozen=True)
class ReplayCheck:
    """What `assert_idempotent` sent and got: the key, the first answer, its replay, and
    the refusal of the changed payload (``None`` when none was sent)."""

    key: str
    first: HttpResponseBase
    replay: HttpResponseBase
    refused: HttpResponseBase | None


# The problems answered before the view runs: a first attempt with one of them ran nothing.
_REFUSED_BEFORE_THE_VIEW = frozenset(
    {
        "idempotency_key_missing",
        "idempotency_key_invalid",
        "idempotency_account_missing",
        "idempotency_account_invalid",
        "idempotency_fingerprint_invalid",
        "idempotency_store_unavailable",
    }
)


def _ran(response: HttpResponseBase, key: str) -> None:
    seen = Answer.of(response)
    hints = {
        "idempotency_key_in_use": "another attempt with this key is still running",
        "idempotency_key_reused": "the key was used before with another request",
        "idempotency_outcome_unknown": "the key was used before by an attempt that crashed",
        "idempotency_record_unreadable": "the key was used before; its record cannot be read",
    }
    code = seen.problem_code()
    assert code not in hints, f"key {key!r}: {hints[code or '']} ({seen.describe()})"
    assert code not in _REFUSED_BEFORE_THE_VIEW, (
        f"the first attempt was refused by django-idempotency with {code!r}, so the view "
        f"never ran: {seen.describe()}"
    )
    assert seen.status < 500, (
        f"the first attempt answered {seen.describe()}: a 5xx is never stored, so there is "
        "nothing to replay"
    )


def assert_idempotent(
    client: RequestClient,
    path: str,
    payload: Any,
    *,
    changed: Any,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    method: str = "post",
    content_type: str = "application/json",
) -> ReplayCheck:
    """Assert that an endpoint runs once per key, replays byte for byte and refuses the
    key with a changed payload.

    Sends ``payload`` with a new key (or ``key``), in the header the ``HEADER`` setting
    names (``Idempotency-Key`` by default), then again (which must be a replay:
    `assert_replay`), then ``changed`` with the same key, which must be refused with
    ``422`` ``idempotency_key_reused``; pass ``changed=None`` for an endpoint whose
    fingerprint ignores the body (a webhook keyed by the sender's id).

    ``client`` is Django's ``Client`` or DRF's ``APIClient``, logged in as the caller
    (``force_login``, ``force_authenticate``); an ``AsyncClient`` is refused with a
    ``TypeError`` (in an async test, call the helper through ``sync_to_async`` with a
    ``Client``). A first attempt that this package refused before the view ran (a key,
    an account or a fingerprint it cannot use, the store unavailable) fails the check
    with that problem's code. A ``payload`` that is not ``bytes`` or
    ``str`` is sent as JSON. Count the endpoint's side effects afterwards: one.
    """
    key = key or new_key()
    first = _through(client, method, path, payload, key, headers, content_type)
    _ran(first, key)
    replay = _through(client, method, path, payload, key, headers, content_type)
    assert_replay(first, replay)
    refused = None
    if changed is not None:
        refused = _through(client, method, path, changed, key, headers, content_type)
        assert_problem(refused, "idempotency_key_reused", 422)
    return ReplayCheck(key, first, replay, refused)


def assert_accounts_isolated(
    clients: Sequence[RequestClient],
    path: str,
    payload: Any,
    *,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    method: str = "post",
    content_type: str = "application/json",
) -> list[ReplayCheck]:
    """Assert that one key sent by several callers is one operation per caller.

    Each client (logged in as another user, or another tenant) sends the same payload with
    the same key: each one's first request runs (it is no replay of another's answer) and
    each one's retry replays its own answer. Returns the checks, in the clients' order.
    Fewer than two clients is a ``ValueError``: one caller cannot meet another's record.
    """
    if len(clients) < 2:
        raise ValueError(
            f"isolation needs at least 2 callers, not {len(clients)}: one caller cannot "
            "meet another's record"
        )
    key = key or new_key()
    return [
        assert_idempotent(
            client,
            path,
            payload,
            changed=None,
            key=key,
            headers=headers,
            method=method,
            content_type=content_type,
        )
        for client in clients
    ]
