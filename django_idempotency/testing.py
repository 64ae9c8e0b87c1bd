"""Helpers for a project's own tests of its idempotent endpoints.

Happy-path tests prove little. These helpers make the tests that matter short: a retry that
must replay byte for byte, a key reused with another payload, two requests at the same
instant, a timeout after the provider answered, a process that dies midway, a lease or a
TTL that runs out, a key shared by two accounts, a queue that delivers twice. Each test
then counts the project's own side effects (rows, provider calls, e-mails), not statuses.

They work in pytest (with pytest-django's fixtures) and in Django's ``TestCase`` and
``TransactionTestCase`` alike: nothing here needs a fixture of its own. Requests go
through Django's or DRF's test client (in-process) or, for the races, through a live
server (pytest-django's ``live_server``, Django's ``LiveServerTestCase``), each request on
a connection of its own.

- Replays: `assert_idempotent`, `assert_replay`, `assert_problem`,
  `assert_accounts_isolated`.
- Races over HTTP: `storm`, `assert_single_execution`, `send`, `settle`, `login_headers`.
- Time, without sleeping: `expire_lease`, `expire_ttl`, `record_for`.
- Crashes and pauses at a point the test chooses: `crash_after`, `crash_before`, `crash`,
  `expect_crash`, `pause_after`.
- Side effects: `FakeProvider`; queues: `redeliver`.
"""

from __future__ import annotations

import http.client
import json
import pkgutil
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol
from unittest import mock

from django_idempotency.exceptions import SimulatedCrash

if TYPE_CHECKING:
    from celery import Task
    from django.contrib.auth.models import User
    from django.http.response import HttpResponseBase

    from django_idempotency.models import IdempotencyRecord

__all__ = [
    "Answer",
    "Call",
    "CrashPoint",
    "FakeProvider",
    "Pause",
    "ReplayCheck",
    "RequestClient",
    "SimulatedCrash",
    "assert_accounts_isolated",
    "assert_idempotent",
    "assert_problem",
    "assert_replay",
    "assert_single_execution",
    "crash",
    "crash_after",
    "crash_before",
    "expect_crash",
    "expire_lease",
    "expire_ttl",
    "login_headers",
    "new_key",
    "pause_after",
    "record_for",
    "redeliver",
    "send",
    "settle",
    "storm",
]

REPLAYED = "idempotent-replayed"
PROBLEM = "application/problem+json"


def new_key() -> str:
    """A fresh idempotency key (a UUID4's hex), as a client makes one per operation."""
    return uuid.uuid4().hex


# -- what an answer looks like ------------------------------------------------------------


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
        """A test client's response as an `Answer` (an `Answer` as it is)."""
        if isinstance(response, Answer):
            return response
        body = getattr(response, "content", None)
        if body is None:  # a streamed response: read it whole
            body = b"".join(getattr(response, "streaming_content", []))
        headers = {name.lower(): value for name, value in response.items()}
        return cls(response.status_code, headers, bytes(body))

    def _describe(self) -> str:
        if self.error:
            return f"no answer ({self.error})"
        replay = ", a replay" if self.replayed else ""
        return f"{self.status}{replay}: {self.body[:200]!r}"

    def _problem_code(self) -> str | None:
        if not self.headers.get("content-type", "").startswith(PROBLEM):
            return None
        try:
            code = json.loads(self.body).get("code")
        except (ValueError, AttributeError):
            return None
        return code if isinstance(code, str) else None


# -- replays through a test client --------------------------------------------------------


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
    body, content_type = _encoded(payload, content_type)
    sent = {**(headers or {}), "Idempotency-Key": key}
    response: HttpResponseBase = client.generic(
        method.upper(), path, body, content_type, headers=sent
    )
    return response


def assert_replay(original: Answer | HttpResponseBase, replay: Answer | HttpResponseBase) -> None:
    """Assert that ``replay`` replays ``original`` byte for byte.

    The same status, body bytes, ``Content-Type`` and ``Location``; ``replay`` is marked
    ``Idempotent-Replayed: true`` and ``original`` is not. Takes test client responses and
    `Answer`s alike.
    """
    first, again = Answer.of(original), Answer.of(replay)
    assert first.error is None, f"the first attempt got {first._describe()}"
    assert not first.replayed, (
        f"the first attempt is itself a replay ({first._describe()}): its key was used before"
    )
    assert again.replayed, (
        f"the retry was not replayed: it got {again._describe()}, so the view ran again "
        f"(the first attempt got {first._describe()})"
    )
    assert again.status == first.status, (
        f"the replay's status is {again.status}, the first attempt's {first.status}"
    )
    assert again.body == first.body, (
        f"the replay's body differs: {again.body[:200]!r} against {first.body[:200]!r}"
    )
    for name in ("content-type", "location"):
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
    assert seen._problem_code() == code, f"expected the problem {code!r}, got {seen._describe()}"
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


def _ran(response: HttpResponseBase, key: str) -> None:
    seen = Answer.of(response)
    hints = {
        "idempotency_key_in_use": "another attempt with this key is still running",
        "idempotency_key_reused": "the key was used before with another request",
    }
    code = seen._problem_code()
    assert code not in hints, f"key {key!r}: {hints[code or '']} ({seen._describe()})"
    assert seen.status < 500, (
        f"the first attempt answered {seen._describe()}: a 5xx is never stored, so there is "
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

    Sends ``payload`` with a new key (or ``key``), then again (which must be a replay:
    `assert_replay`), then ``changed`` with the same key, which must be refused with
    ``422`` ``idempotency_key_reused``; pass ``changed=None`` for an endpoint whose
    fingerprint ignores the body (a webhook keyed by the sender's id).

    ``client`` is Django's ``Client`` or DRF's ``APIClient``, logged in as the caller
    (``force_login``, ``force_authenticate``). A ``payload`` that is not ``bytes`` or
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
    """
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


# -- over HTTP, each request on a connection of its own ------------------------------------


def send(
    base_url: str,
    path: str,
    payload: Any = None,
    *,
    headers: Mapping[str, str] | None = None,
    method: str = "POST",
    timeout: float = 10.0,
) -> Answer:
    """One request to a live server on a new connection; never waits longer than
    ``timeout`` seconds.

    ``payload``: ``bytes`` or ``str`` are sent as they are, ``None`` sends no body, and
    anything else is sent as JSON (with ``Content-Type: application/json`` unless
    ``headers`` says otherwise). A request that gets no answer in time, or whose connection
    is dropped, gives an `Answer` with status 0 and its ``error``.
    """
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
    connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
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
    headers: Mapping[str, str] | None = None,
    requests: int = 16,
    method: str = "POST",
    timeout: float = 10.0,
) -> list[Answer]:
    """``requests`` identical requests at the same instant, through a live server.

    Each runs in a thread of its own on a connection of its own; the threads start together
    (a barrier) and each waits at most ``timeout`` seconds for its answer. Returns every
    answer, in the threads' order: check them with `assert_single_execution`.
    """
    if requests < 2:
        raise ValueError(f"a storm needs at least 2 requests, not {requests}")
    barrier = threading.Barrier(requests, timeout=timeout)

    def one(_: int) -> Answer:
        barrier.wait()
        return send(base_url, path, payload, headers=headers, method=method, timeout=timeout)

    with ThreadPoolExecutor(max_workers=requests) as pool:
        return list(pool.map(one, range(requests)))


def assert_single_execution(answers: Sequence[Answer | HttpResponseBase]) -> Answer:
    """Assert that of answers to one key, exactly one ran the view.

    That one is neither a ``409`` nor a replay; every other answer is a ``409``
    ``idempotency_key_in_use`` with a ``Retry-After``, or a replay of it byte for byte.
    Returns the one that ran, as an `Answer`.
    """
    seen = [Answer.of(answer) for answer in answers]
    lost = [s._describe() for s in seen if s.error]
    assert not lost, f"{len(lost)} of {len(seen)} requests got no answer: {lost[:3]}"
    ran = [s for s in seen if s.status != 409 and not s.replayed]
    assert len(ran) == 1, (
        f"{len(ran)} of {len(seen)} requests ran the view (one should have): "
        f"{[s._describe() for s in ran[:5]]}"
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
    headers: Mapping[str, str] | None = None,
    method: str = "POST",
    timeout: float = 10.0,
    pause: float = 0.05,
) -> Answer:
    """Retry as a patient client does until the answer is no ``409``: the outcome.

    Retries every ``pause`` seconds (not ``Retry-After``'s whole seconds, to keep tests
    short) for at most ``timeout`` seconds, then fails the test.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        answer = send(base_url, path, payload, headers=headers, method=method, timeout=left)
        if answer.status != 409 and not answer.error:
            return answer
        assert time.monotonic() + pause < deadline, (
            f"still no outcome after {timeout} s: the last answer was "
            f"{Answer.of(answer)._describe()}"
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
    else:
        cookies[settings.CSRF_COOKIE_NAME] = request.META["CSRF_COOKIE"]
    header = settings.CSRF_HEADER_NAME.removeprefix("HTTP_").replace("_", "-").title()
    return {"Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items()), header: token}


# -- records and time ------------------------------------------------------------------------


def record_for(
    key: str | IdempotencyRecord,
    *,
    account: str | None = None,
    operation: str | None = None,
) -> IdempotencyRecord:
    """The record of ``key``, read afresh from the ``DATABASE`` setting's database.

    ``account`` and ``operation`` narrow it down when several records share the key
    (``"user:42"``, ``"order.create"``); among those left, the newest. A record passed
    instead of a key is read again. Fails the test when there is none.
    """
    from django_idempotency.conf import app_settings
    from django_idempotency.models import IdempotencyRecord

    records = IdempotencyRecord.objects.using(app_settings.DATABASE)
    if isinstance(key, IdempotencyRecord):
        found = records.filter(pk=key.pk).first()
        assert found is not None, f"record {key.pk} is gone (released or purged)"
        return found
    selection = records.filter(key=key)
    if account is not None:
        selection = selection.filter(account=account)
    if operation is not None:
        selection = selection.filter(operation=operation)
    newest = selection.order_by("-created_at", "-pk").first()
    assert newest is not None, (
        f"no idempotency record for key {key!r}"
        + (f", account {account!r}" if account is not None else "")
        + (f", operation {operation!r}" if operation is not None else "")
        + ": the request was not protected, or its claim was released"
    )
    return newest


def _moved(record: IdempotencyRecord, **columns: Any) -> IdempotencyRecord:
    from django_idempotency.conf import app_settings
    from django_idempotency.models import IdempotencyRecord

    IdempotencyRecord.objects.using(app_settings.DATABASE).filter(pk=record.pk).update(**columns)
    return record_for(record)


def expire_lease(
    key: str | IdempotencyRecord,
    *,
    account: str | None = None,
    operation: str | None = None,
) -> IdempotencyRecord:
    """End the lease of an in-progress record now, as if its owner had run out of time:
    the next retry (or the recovery job) meets a stale lease and applies the recovery
    policy. No sleeping. Fails the test when the record is not in progress.

    The record is found as `record_for` finds it; returns it as it is now.
    """
    from django.utils import timezone

    from django_idempotency.states import IN_PROGRESS

    record = record_for(key, account=account, operation=operation)
    assert record.status == IN_PROGRESS, (
        f"the record of key {record.key!r} is {record.status}: only an in-progress record "
        "holds a lease"
    )
    return _moved(record, lease_expires_at=timezone.now() - timedelta(seconds=1))


def expire_ttl(
    key: str | IdempotencyRecord,
    *,
    account: str | None = None,
    operation: str | None = None,
) -> IdempotencyRecord:
    """Move a record's expiry (its TTL) into the past: the next request with its key is a
    new request, and the purge may delete it. No sleeping.

    An in-progress record whose lease is still live stays owned until the lease runs out
    too (`expire_lease`). The record is found as `record_for` finds it; returns it as it is
    now.
    """
    from django.utils import timezone

    record = record_for(key, account=account, operation=operation)
    return _moved(record, expires_at=timezone.now() - timedelta(seconds=1))


# -- crashes and pauses ----------------------------------------------------------------------


def crash() -> None:
    """End the running attempt as a killed process would: raise `SimulatedCrash`.

    Call it from a test double at the point where the process should die. The protected
    body's database work rolls back, and its claim stays in progress under its lease,
    never released: after `expire_lease`, the next retry meets the recovery policy
    (``"retry"``, ``"fail"``, a callable; resumable steps resume). Wrap the request in
    `expect_crash`.
    """
    raise SimulatedCrash("simulated crash")


@contextmanager
def expect_crash() -> Iterator[None]:
    """The block must end with a `SimulatedCrash`, which is swallowed, as a killed
    process ends its request: the test goes on with what the crash left behind."""
    try:
        yield
    except SimulatedCrash:
        return
    raise AssertionError("the block ended without the expected simulated crash")


def _owner_and_name(target: str) -> tuple[Any, str]:
    owner_name, dot, name = target.rpartition(".")
    if not dot:
        raise ValueError(f"{target!r} is not a dotted path such as 'myapp.payments.charge'")
    return pkgutil.resolve_name(owner_name), name


@contextmanager
def _wrapped(
    target: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    owner, name = _owner_and_name(target)
    with mock.patch.object(owner, name, wrap(getattr(owner, name))):
        yield


@dataclass
class CrashPoint:
    """Where `crash_after` or `crash_before` ends the attempt, and what happened there."""

    target: str
    after: bool
    on_call: int
    #: How often the target was called in the block.
    calls: int = 0
    #: Whether the crash happened.
    crashed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def crashing(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls += 1
                due = self.calls == self.on_call
                self.crashed = self.crashed or due
            if due and not self.after:
                crash()
            result = original(*args, **kwargs)
            if due:
                crash()
            return result

        return crashing

    def missed(self) -> str:
        """Why no crash came out of the block."""
        if self.crashed:
            return (
                f"the simulated crash at {self.target} was caught inside the block: "
                "something catches BaseException there, which a killed process never allows"
            )
        if not self.calls:
            return f"{self.target} was never called in the block, so nothing crashed"
        return f"{self.target} was called {self.calls} times, fewer than {self.on_call}"


@contextmanager
def _crash_point(target: str, *, after: bool, on_call: int) -> Iterator[CrashPoint]:
    if on_call < 1:
        raise ValueError(f"on_call counts calls from 1, not {on_call}")
    point = CrashPoint(target, after, on_call)
    with _wrapped(target, point.wrap):
        try:
            yield point
        except SimulatedCrash:
            if point.crashed:
                return
            raise
    raise AssertionError(point.missed())


def crash_after(target: str, *, on_call: int = 1) -> AbstractContextManager[CrashPoint]:
    """A context manager: the process "dies" right after ``target`` returns.

    ``target`` is the dotted path of what the view calls, as ``unittest.mock.patch`` takes
    it (``"myapp.payments.charge"``: patch it where the view looks it up). Within the
    block, its ``on_call``-th call runs and then raises `SimulatedCrash`: the external call
    happened, the view's database work rolls back, and the claim stays in progress under
    its lease. The crash propagates out of the test client and is swallowed when it
    leaves the block; the test fails when no crash happened (the target was not called,
    or something caught the crash).

    For requests in the test's own thread (Django's or DRF's test client, ``run_once``,
    a task's ``apply()``); a live server's handler answers a crash with a 500 instead.
    Yields a `CrashPoint`.
    """
    return _crash_point(target, after=True, on_call=on_call)


def crash_before(target: str, *, on_call: int = 1) -> AbstractContextManager[CrashPoint]:
    """Like `crash_after`, but the process "dies" just before ``target`` is called: the
    external call never happened."""
    return _crash_point(target, after=False, on_call=on_call)


class Pause:
    """Holds the calls of a target until the test resumes them (see `pause_after`)."""

    def __init__(self, target: str, timeout: float) -> None:
        self.target = target
        self.timeout = timeout
        #: How often the target was called.
        self.calls = 0
        self._lock = threading.Lock()
        self._reached = threading.Event()
        self._resumed = threading.Event()

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def pausing(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            with self._lock:
                self.calls += 1
            self._reached.set()
            self._resumed.wait(self.timeout)
            return result

        return pausing

    def wait(self, timeout: float = 10.0) -> None:
        """Wait (at most ``timeout`` seconds) until a call of the target has returned and
        is held; fails the test otherwise."""
        assert self._reached.wait(timeout), f"{self.target} was not called within {timeout} s"

    def resume(self) -> None:
        """Let every held call, and every later one, go on."""
        self._resumed.set()


@contextmanager
def pause_after(target: str, *, timeout: float = 10.0) -> Iterator[Pause]:
    """Hold each call of ``target`` right after it returns, until `Pause.resume` or the end
    of the block (never longer than ``timeout`` seconds).

    For a live server: the external call succeeded and the request is still running, so the
    test can give up waiting (``send(..., timeout=0.5)``), retry while the original holds
    its claim, and then let it finish. ``target`` is a dotted path as for `crash_after`.
    """
    pause = Pause(target, timeout)
    with _wrapped(target, pause.wrap):
        try:
            yield pause
        finally:
            pause.resume()


# -- side effects and queues -----------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One call that reached a `FakeProvider`: its arguments, its key, and its answer."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: str | None
    answer: Any


class FakeProvider:
    """A stand-in for an external API that honours idempotency keys, as payment providers
    do; it counts every call and every effect.

    Put it where the view calls the provider (``monkeypatch.setattr(payments, "charge",
    provider)``, ``unittest.mock.patch``). Each call is recorded in `calls`. A call whose
    ``key_argument`` (a keyword, ``idempotency_key`` by default, or a position: ``0`` for
    the first argument) carries a key already seen gets that key's first answer again; any
    other call makes a new effect, recorded in `effects`, whose answer is ``answer(n)`` for
    the n-th effect (by default ``{"id": "fake_<n>"}``). It lives in memory, so, like a
    remote system, it keeps what a database rollback undoes. Safe to call from a live
    server's threads.
    """

    def __init__(
        self,
        *,
        key_argument: str | int = "idempotency_key",
        answer: Callable[[int], Any] | None = None,
    ) -> None:
        self.key_argument = key_argument
        self.answer = answer or (lambda n: {"id": f"fake_{n}"})
        #: Every call, in order.
        self.calls: list[Call] = []
        #: The answer of every effect made, in order (repeated keys make none).
        self.effects: list[Any] = []
        self._by_key: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One call: the key's first answer, or a new effect's."""
        where = self.key_argument
        if isinstance(where, int):
            key = args[where] if len(args) > where else None
        else:
            key = kwargs.get(where)
        with self._lock:
            if key is not None and key in self._by_key:
                answer = self._by_key[key]
            else:
                answer = self.answer(len(self.effects) + 1)
                self.effects.append(answer)
                if key is not None:
                    self._by_key[key] = answer
            self.calls.append(Call(args, dict(kwargs), key, answer))
        return answer


def redeliver(
    task: Task[Any, Any],
    *args: Any,
    task_id: str | None = None,
    times: int = 2,
    **kwargs: Any,
) -> list[Any]:
    """Deliver one Celery message ``times`` times, as a broker does after a lost
    acknowledgement; returns each delivery's result.

    Each delivery runs the task in this process (``task.apply``) with the same task id
    (``task_id``, or a new one), which is what ``@idempotent_task()`` deduplicates by: its
    body runs once and later deliveries return the stored result. An outbox message is
    delivered with ``task_id=str(message.id)``, as the relay sends it. A delivery that
    raises fails the test with its exception.
    """
    if times < 1:
        raise ValueError(f"times must be at least 1, not {times}")
    task_id = task_id or str(uuid.uuid4())
    return [task.apply(args=args, kwargs=kwargs, task_id=task_id).get() for _ in range(times)]
