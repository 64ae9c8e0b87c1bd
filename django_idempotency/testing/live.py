"""Requests through a live server, each on a connection of its own: storms, timeouts,
patient retries, and a logged-in caller's headers."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypedDict

from django_idempotency.testing.answers import Answer, assert_problem, assert_replay

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.http.response import HttpResponseBase
    from typing_extensions import Unpack


# How long `send` waits for an answer when not told (and `settle` for the outcome).
_TIMEOUT = 10.0


class RequestOptions(TypedDict, total=False):
    """The options `storm` and `settle` pass on to each `send`: ``headers``, ``method``
    (``"POST"`` when not given) and ``timeout`` (``10.0`` seconds)."""

    headers: Mapping[str, str] | None
    method: str
    timeout: float


def send(
    base_url: str,
    path: str,
    payload: Any = None,
    *,
    headers: Mapping[str, str] | None = None,
    method: str = "POST",
    timeout: float = _TIMEOUT,
) -> Answer:
    """One request to a live server on a new connection; never waits longer than
    ``timeout`` seconds.

    ``payload``: ``bytes`` or ``str`` are sent as they are, ``None`` sends no body, and
    anything else is sent as JSON (with ``Content-Type: application/json`` unless
    ``headers`` says otherwise). A request that gets no answer in time, or whose connection
    is dropped, gives an `Answer` with status 0 and its ``error``. A ``timeout`` that is
    not more than 0 seconds is a ``ValueError``.
    """
    if not timeout > 0:
        # 0 would make the socket non-blocking, and a negative one is refused by it: either
        # would fail inside http.client with an error that names neither.
        raise ValueError(f"timeout must be more than 0 seconds, not {timeout!r}")
    url = urllib.parse.urlsplit(base_url)
    sent = dict(headers or {})
    body: bytes | None
    if payload is None:
        body = None
    elif isinstance(payload, (bytes, str)):
        body = payload.encode() if isinstance(payload, str) else payload
    else:
        body = json.dumps(payload).encode()
        if not any(name.lower() == "content-type" for name in sent):
            sent["Content-Type"] = "application/json"
    kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    connection = kind(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=sent)
        response = connection.getresponse()
        data = response.read()
        return Answer(
            status=response.status,
            headers={name.lower(): value for name, value in response.getheaders()},
            body=data,
        )
    except TimeoutError:
        return Answer(status=0, error="timed out")
    except (ConnectionError, http.client.HTTPException) as exc:
        return Answer(status=0, error=f"connection closed ({type(exc).__name__})")
    finally:
        connection.close()


def storm(
    base_url: str,
    path: str,
    payload: Any = None,
    *,
    requests: int = 16,
    **options: Unpack[RequestOptions],
) -> list[Answer]:
    """``requests`` identical requests at the same instant, through a live server.

    Each runs in a thread of its own on a connection of its own; the threads start together
    (a barrier) and each waits at most ``timeout`` seconds for its answer. ``headers``,
    ``method`` and ``timeout`` are `send`'s. Returns every answer, in the threads' order:
    check them with `assert_single_execution`.
    """
    if requests < 2:
        raise ValueError(f"a storm needs at least 2 requests, not {requests}")
    barrier = threading.Barrier(requests, timeout=options.get("timeout", _TIMEOUT))

    def one(_: int) -> Answer:
        barrier.wait()
        return send(base_url, path, payload, **options)

    with ThreadPoolExecutor(max_workers=requests) as pool:
        return list(pool.map(one, range(requests)))


def assert_single_execution(answers: Sequence[Answer | HttpResponseBase]) -> Answer:
    """Assert that of answers to one key, exactly one ran the view.

    That one is neither a ``409`` nor a replay; every other answer is a ``409``
    ``idempotency_key_in_use`` with a ``Retry-After``, or a replay of it byte for byte.
    Returns the one that ran, as an `Answer`.
    """
    seen = [Answer.of(answer) for answer in answers]
    lost = [s.describe() for s in seen if s.error]
    assert not lost, f"{len(lost)} of {len(seen)} requests got no answer: {lost[:3]}"
    ran = [s for s in seen if s.status != 409 and not s.replayed]
    assert len(ran) == 1, (
        f"{len(ran)} of {len(seen)} requests ran the view (one should have): "
        f"{[s.describe() for s in ran[:5]]}"
    )
    (original,) = ran
    for other in seen:
        if other is original:
            continue
        if other.status == 409:
            assert_problem(other, "idempotency_key_in_use")
            assert other.headers.get("retry-after"), "a 409 without Retry-After"
        else:
            assert_replay(original, other)
    return original


def settle(
    base_url: str,
    path: str,
    payload: Any = None,
    *,
    pause: float = 0.05,
    **options: Unpack[RequestOptions],
) -> Answer:
    """Retry as a patient client does until the answer is no ``409``: the outcome.

    Retries every ``pause`` seconds (not ``Retry-After``'s whole seconds, to keep tests
    short) for at most ``timeout`` seconds (`send`'s, 10 by default), then fails the test.
    ``headers`` and ``method`` are `send`'s.
    """
    timeout = options.get("timeout", _TIMEOUT)
    deadline = time.monotonic() + timeout
    each = options.copy()
    answer: Answer | None = None
    while True:
        left = deadline - time.monotonic()
        if answer is not None:
            # A pause that overran (a loaded machine) may end past the deadline: the test
            # fails on the last answer, rather than send a request with no time left.
            assert left > 0, (
                f"still no outcome after {timeout} s: the last answer was {answer.describe()}"
            )
        each["timeout"] = left
        answer = send(base_url, path, payload, **each)
        if answer.status != 409 and not answer.error:
            return answer
        # A 409, a timeout or a dropped connection: the outcome is still unknown.
        assert time.monotonic() + pause < deadline, (
            f"still no outcome after {timeout} s: the last answer was {answer.describe()}"
        )
        time.sleep(pause)


def login_headers(user: User) -> dict[str, str]:
    """Headers that make a live server's request come from ``user``: a session cookie, and
    a CSRF cookie with its token (so DRF's ``SessionAuthentication`` and Django's
    ``CsrfViewMiddleware`` accept a ``POST``)."""
    from django.conf import settings
    from django.http import HttpRequest
    from django.middleware.csrf import get_token
    from django.test import Client

    client = Client()
    client.force_login(user)
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    request = HttpRequest()
    token = get_token(request)
    cookies = {settings.SESSION_COOKIE_NAME: session}
    if settings.CSRF_USE_SESSIONS:
        from importlib import import_module

        from django.middleware.csrf import CSRF_SESSION_KEY

        store = import_module(settings.SESSION_ENGINE).SessionStore(session_key=session)
        store[CSRF_SESSION_KEY] = request.META["CSRF_COOKIE"]
        store.save()
        # A session kept in its cookie (signed_cookies) gets another key when saved.
        cookies[settings.SESSION_COOKIE_NAME] = str(store.session_key)
    else:
        cookies[settings.CSRF_COOKIE_NAME] = request.META["CSRF_COOKIE"]
    header = settings.CSRF_HEADER_NAME.removeprefix("HTTP_").replace("_", "-").title()
    return {"Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items()), header: token}
